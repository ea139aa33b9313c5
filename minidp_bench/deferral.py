"""What do deferred weight gradients buy? One gradient-accumulation step, the trick on and off.

    python -m minidp bench deferral [--cases mlp,mlp-small,gpt] [--micro-batches 4]
        [--iters 20] [--warmup 3] [--threads 1] [--json FILE]

The step: K micro-batches (--micro-batches, default 4), each a forward, its loss weighed by
its share of the batch, and a backward, the first K-1 inside `defer_weight_grads()` (what
DDP's no_sync enters), then an SGD update (it reads every .grad). float32, one process.
Cases (rows per micro-batch = batch / K; a weight (in, out) keeps at most in*out/(in+out)):
  mlp        MLP 784-1024-1024-10, batch 256: 64 rows, both hidden weights defer (<= 444)
  mlp-small  the same MLP, batch 64: 16 rows a micro-batch
  gpt        the default GPT (C 64, 2 layers, T 64), batch 8: 128 rows of a (64, 192) weight
             keep at most 48, so nothing defers: the case shows what the Products cost
Contenders, in one process, the order rotated each round (A B, B A, ...): `deferred`
(weight_grads.deferral(True), the default) and `plain` (deferral(False): nn.linear returns
x^T g multiplied). Reported: median step time of each and the median of the per-round ratios
deferred/plain (below 1: the trick pays).
"""

import contextlib
import time

import numpy as np

from minidp.engine import nn, optim
from minidp.engine.tensor import Tensor
from minidp.fast import weight_grads
from minidp.models.gpt import GPT, GPTConfig
from minidp.tools.log import die
from minidp.tools.parser import Parser
from minidp_bench._common import environment, median, median_ratio, print_table, summary, write_json
from minidp_bench._mlp import SIZES, make_data, make_model

CASES = {"mlp": ("mlp", 256), "mlp-small": ("mlp", 64), "gpt": ("gpt", 8)}
PAUSE_S = 0.15  # let BLAS threads of the last contender stop spinning (bench autograd says why)


def case_data(model: str, batch: int):
    """(build a fresh model, inputs, targets, rows per example) for a case; every model from
    the same seed."""
    if model == "mlp":
        x, y = make_data(SIZES, batch, seed=1)
        return (lambda: make_model(SIZES)), x, y, 1
    cfg = GPTConfig()
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, cfg.block_size + 1))
    return (lambda: GPT(cfg, seed=0)), tokens[:, :-1], tokens[:, 1:], cfg.block_size


def accumulation_step(model, x, y, micro_batches: int, deferred: bool):
    """One step: K micro-batches accumulated (all but the last deferred), then SGD."""
    opt = optim.SGD(model.parameters(), lr=0.01)
    cuts = np.linspace(0, len(x), micro_batches + 1).astype(int)
    inputs = Tensor if isinstance(model, nn.MLP) else np.asarray

    def step():
        opt.zero_grad()
        with weight_grads.deferral(deferred):
            for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
                last = k == micro_batches - 1
                with contextlib.nullcontext() if last else weight_grads.defer_weight_grads():
                    loss = nn.cross_entropy(model(inputs(x[lo:hi])), y[lo:hi])
                    (loss * ((hi - lo) / len(x))).backward()
        opt.step()

    return step


def measure(case: str, micro_batches: int, threads: int, iters: int, warmup: int) -> dict:
    from threadpoolctl import threadpool_limits

    kind, batch = CASES[case]
    build, x, y, rows_per_example = case_data(kind, batch)
    steps = {
        "deferred": accumulation_step(build(), x, y, micro_batches, deferred=True),
        "plain": accumulation_step(build(), x, y, micro_batches, deferred=False),
    }
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    with threadpool_limits(limits=threads, user_api="blas"):
        for i in range(warmup + iters):
            k = i % len(names)
            for name in names[k:] + names[:k]:  # rotated: neither always runs second
                time.sleep(PAUSE_S)
                start = time.perf_counter()
                steps[name]()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
    return {
        "case": case,
        "batch": batch,
        "micro_batches": micro_batches,
        "rows": batch // micro_batches * rows_per_example,  # a weight's rows, per micro-batch
        "threads": threads,
        "deferred_ms": 1e3 * median(times["deferred"]),
        "plain_ms": 1e3 * median(times["plain"]),
        "deferred/plain": median_ratio(times["deferred"], times["plain"]),
    }


def main(argv: list[str]) -> int:
    parser = Parser(prog="minidp bench deferral", description=summary(__doc__))
    parser.add_argument("--cases", default=",".join(CASES), help="cases (default: all)")
    parser.add_argument("--micro-batches", type=int, default=4, help="K (default 4)")
    parser.add_argument("--iters", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--threads", default="1", help="BLAS thread counts (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise die(f"bench deferral: unknown --cases {unknown} (known: {', '.join(CASES)})")
    if args.micro_batches < 1:
        raise die(f"bench deferral: --micro-batches must be >= 1, got {args.micro_batches}")
    env = environment()
    print(
        f"bench deferral: K = {args.micro_batches} micro-batches, float32 | numpy {env['numpy']} "
        f"| {env['blas']} | OPENBLAS_CORETYPE={env['OPENBLAS_CORETYPE']} "
        f"OPENBLAS_L2_SIZE={env['OPENBLAS_L2_SIZE']}",
        flush=True,
    )
    rows = [
        measure(case, args.micro_batches, int(t), args.iters, args.warmup)
        for case in cases
        for t in args.threads.split(",")
    ]
    columns = [
        ("case", "s"),
        ("batch", "d"),
        ("rows", "d"),
        ("threads", "d"),
        ("deferred_ms", ".2f"),
        ("plain_ms", ".2f"),
        ("deferred/plain", ".3f"),
    ]
    print_table(rows, columns)
    print("deferred/plain: median of per-round ratios (below 1: the trick pays)", flush=True)
    write_json(args.json, [{"bench": "deferral", **env, **r} for r in rows])
    return 0
