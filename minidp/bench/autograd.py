"""How much does the autograd engine cost? One training step three ways, side by side.

    python -m minidp bench autograd [--iters 20] [--threads 1,2] [--json FILE]

The step: forward, cross-entropy, backward, SGD update of an MLP 784-1024-1024-10 on a batch
of 256, float32. Contenders, alternated step by step in one process (A B C A B C ...):
  minidp  the engine (minidp.nn.MLP, loss.backward(), optim.SGD)
  numpy   the same network with every matrix product written by hand: the floor for minidp
  torch   torch.nn on the CPU, when torch is installed
Reported: median step time per contender and the median of the per-round ratios.
"""

import time

import numpy as np

from minidp import nn, optim
from minidp.autograd import Tensor
from minidp.bench._common import (
    environment,
    median,
    print_table,
    torch_mlp_step,
    write_json,
)
from minidp.parser import Parser

SIZES = (784, 1024, 1024, 10)
BATCH = 256
LR = 0.01
# BLAS and OpenMP worker threads spin for a while after each call (OpenBLAS ~0.1 s): without
# a pause the contender that runs next would share its cores with them.
PAUSE_S = 0.15


def minidp_step(model, opt, x, y):
    def step():
        loss = nn.cross_entropy(model(Tensor(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def numpy_step(weights, x, y):
    """The MLP's forward and backward written out by hand (what minidp must not be far from)."""
    (W1, b1), (W2, b2), (W3, b3) = weights
    rows = np.arange(len(y))

    def step():
        h1 = x @ W1
        h1 += b1
        a1 = np.maximum(h1, 0)
        h2 = a1 @ W2
        h2 += b2
        a2 = np.maximum(h2, 0)
        z = a2 @ W3
        z += b3
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        dz = p  # d loss / d z = (softmax - onehot) / N
        dz[rows, y] -= 1
        dz /= len(y)
        dW3, db3 = a2.T @ dz, dz.sum(axis=0)
        da2 = dz @ W3.T
        da2 *= h2 > 0
        dW2, db2 = a1.T @ da2, da2.sum(axis=0)
        da1 = da2 @ W2.T
        da1 *= h1 > 0
        dW1, db1 = x.T @ da1, da1.sum(axis=0)
        for w, g in ((W1, dW1), (b1, db1), (W2, dW2), (b2, db2), (W3, dW3), (b3, db3)):
            w -= LR * g

    return step


def measure(threads: int, iters: int, warmup: int) -> dict:
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], BATCH)
    model = nn.MLP(list(SIZES), rng=rng)
    weights = [(layer.weight.data.copy(), layer.bias.data.copy()) for layer in model.layers]
    contenders = {
        "minidp": minidp_step(model, optim.SGD(model.parameters(), lr=LR), x, y),
        "numpy": numpy_step(weights, x, y),
    }
    try:
        import torch

        torch.set_num_threads(threads)
        contenders["torch"] = torch_mlp_step(torch, model, x, y, LR)
    except ImportError:
        pass
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with threadpool_limits(limits=threads, user_api="blas"):
        for i in range(warmup + iters):
            for name, step in contenders.items():
                time.sleep(PAUSE_S)  # let the last contender's idle threads stop spinning
                start = time.perf_counter()
                step()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
    row = {"threads": threads, "batch": BATCH, "sizes": "-".join(map(str, SIZES))}
    for name, ts in times.items():
        row[f"{name}_ms"] = 1e3 * median(ts)
    for other in ("numpy", "torch"):
        if other in times:
            row[f"minidp/{other}"] = median(a / b for a, b in zip(times["minidp"], times[other]))
    if "torch" in times:
        row["numpy/torch"] = median(a / b for a, b in zip(times["numpy"], times["torch"]))
    return row


def main(argv: list[str]) -> int:
    parser = Parser(prog="minidp bench autograd", description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--threads", default="1,2", help="BLAS/torch thread counts (default 1,2)")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines")
    args = parser.parse_args(argv)
    env = environment()
    print(
        f"bench autograd: MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, float32 | "
        f"numpy {env['numpy']} | {env['blas']} | OPENBLAS_CORETYPE={env['OPENBLAS_CORETYPE']} "
        f"OPENBLAS_L2_SIZE={env['OPENBLAS_L2_SIZE']}",
        flush=True,
    )
    rows = [measure(int(t), args.iters, args.warmup) for t in args.threads.split(",")]
    columns = [
        ("threads", "d"),
        ("minidp_ms", ".2f"),
        ("numpy_ms", ".2f"),
        ("torch_ms", ".2f"),
        ("minidp/numpy", ".3f"),
        ("minidp/torch", ".3f"),
        ("numpy/torch", ".3f"),
    ]
    print_table(rows, columns)
    print(
        "goals: minidp/numpy <= 1.15; minidp/torch <= 1.0 at 1 thread "
        "(medians of per-round ratios)",
        flush=True,
    )
    write_json(args.json, [{"bench": "autograd", **env, **r} for r in rows])
    return 0
