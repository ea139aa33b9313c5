"""How much does the autograd engine cost? One training step three ways, side by side.

    python -m minidp bench autograd [--iters 20] [--threads 1,2] [--json FILE]
        [--sizes 784,1024,1024,10] [--batch 256] [--no-torch]

The step: forward, cross-entropy, backward, SGD update of an MLP 784-1024-1024-10 on a batch
of 256 (--sizes, --batch), float32. Contenders, alternated step by step in one process
(A B C A B C ...):
  minidp  the engine (minidp.nn.MLP, loss.backward(), optim.SGD)
  unfused the same, each hidden Linear and its ReLU as two ops (MLP(fuse_relu=False)): the
          plain path of the fused Linear + ReLU; minidp/unfused says what fusing buys
  numpy   the same network with every matrix product written by hand: the floor for minidp
  torch   torch.nn on the CPU, when torch is installed
Reported: median step time per contender, the median of the per-round ratios, and the
median minor page faults per step of minidp and torch (allocator.py says why they matter).
"""

import time

from minidp.tools.log import die
from minidp.tools.parser import Parser
from minidp_bench._common import (
    environment,
    median,
    median_ratio,
    minor_faults,
    print_table,
    summary,
    write_json,
)
from minidp_bench._mlp import (
    BATCH,
    SIZES,
    make_data,
    make_model,
    minidp_sgd_step,
    numpy_step,
    parse_sizes,
    torch_mlp_step,
    weights_of,
)

# BLAS and OpenMP worker threads spin for a while after each call (OpenBLAS ~0.1 s): without
# a pause the contender that runs next would share its cores with them.
PAUSE_S = 0.15


def measure(
    threads: int, iters: int, warmup: int, sizes=SIZES, batch: int = BATCH, torch_too=True
) -> dict:
    from threadpoolctl import threadpool_limits

    x, y = make_data(sizes, batch, seed=1)
    model = make_model(sizes)
    contenders = {
        "minidp": minidp_sgd_step(model, x, y),
        "unfused": minidp_sgd_step(make_model(sizes, fuse_relu=False), x, y),
        "numpy": numpy_step(weights_of(model), x, y),
    }
    if torch_too:
        try:
            import torch
        except ImportError:  # torch is optional: the table shows "-"
            torch_too = False
    if torch_too:
        torch.set_num_threads(threads)
        contenders["torch"] = torch_mlp_step(torch, model, x, y)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    faults: dict[str, list[int]] = {name: [] for name in contenders}
    with threadpool_limits(limits=threads, user_api="blas"):
        for i in range(warmup + iters):
            for name, step in contenders.items():
                time.sleep(PAUSE_S)  # let the last contender's idle threads stop spinning
                faulted, start = minor_faults(), time.perf_counter()
                step()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
                    faults[name].append(minor_faults() - faulted)
    row = {"threads": threads, "batch": batch, "sizes": "-".join(map(str, sizes))}
    for name, ts in times.items():
        row[f"{name}_ms"] = 1e3 * median(ts)
        row[f"{name}_faults"] = median(faults[name])
    for other in ("unfused", "numpy", "torch"):
        if other in times:
            row[f"minidp/{other}"] = median_ratio(times["minidp"], times[other])
    if "torch" in times:
        row["numpy/torch"] = median_ratio(times["numpy"], times["torch"])
    return row


def main(argv: list[str]) -> int:
    parser = Parser(prog="minidp bench autograd", description=summary(__doc__))
    parser.add_argument("--iters", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--threads", default="1,2", help="BLAS/torch thread counts (default 1,2)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="MLP layer sizes")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"batch (default {BATCH})")
    parser.add_argument("--no-torch", action="store_true", help="leave torch out")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines")
    args = parser.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as error:
        raise die(f"bench autograd: bad --sizes: {error}") from None
    env = environment()
    print(
        f"bench autograd: MLP {'-'.join(map(str, sizes))}, batch {args.batch}, float32 | "
        f"numpy {env['numpy']} | {env['blas']} | OPENBLAS_CORETYPE={env['OPENBLAS_CORETYPE']} "
        f"OPENBLAS_L2_SIZE={env['OPENBLAS_L2_SIZE']}",
        flush=True,
    )
    rows = [
        measure(int(t), args.iters, args.warmup, sizes, args.batch, not args.no_torch)
        for t in args.threads.split(",")
    ]
    columns = [
        ("threads", "d"),
        ("minidp_ms", ".2f"),
        ("unfused_ms", ".2f"),
        ("numpy_ms", ".2f"),
        ("torch_ms", ".2f"),
        ("minidp/unfused", ".3f"),
        ("minidp/numpy", ".3f"),
        ("minidp/torch", ".3f"),
        ("numpy/torch", ".3f"),
        ("minidp_faults", ",.0f"),
        ("torch_faults", ",.0f"),
    ]
    print_table(rows, columns)
    print(
        "goals: minidp/numpy <= 1.15; minidp/torch <= 1.0 at 1 thread "
        "(medians of per-round ratios)",
        flush=True,
    )
    write_json(args.json, [{"bench": "autograd", **env, **r} for r in rows])
    return 0
