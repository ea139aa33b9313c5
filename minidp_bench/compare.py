"""minidp against PyTorch: one training step, side by side, alone and data parallel.

    mpiexec -n 2 python -m minidp bench compare [--model gpt] [--iters 10] [--device cpu]
        [--n-embd 64 --n-layer 2 --n-head 4 --block-size 64 --batch-size 16] [--json FILE]

The step is training/loop.py's: forward, cross-entropy, backward, gradient sync (DP), clip by the
global norm, AdamW, on the tiny GPT (or --model mlp), --dtype float32. Contenders:
  minidp numpy     minidp's engine on NumPy arrays, one process (the global batch alone)
  minidp torch     the same engine on torch tensors (--backend torch), one process
  pytorch          the same model in plain PyTorch (torch_ref.py: torch autograd, AdamW)
  minidp DP        minidp's data parallelism over every rank (NumPy)
  minidp DP torch  the same on torch tensors (on CUDA its buckets stage through host buffers)
  pytorch DDP      torch.nn.parallel.DistributedDataParallel over gloo on 127.0.0.1
The one-process contenders run on every rank at once (each rank its own copy), so they share
the machine as the DP ones do; each time is the slowest rank's (barrier, time, max), the
order rotated every round, medians reported. Ratios, each the median of per-round ratios:
vs_minidp against minidp numpy (one-process rows) or minidp DP (DP rows), vs_torch against
pytorch or pytorch DDP. `faults`: rank 0's minor page faults per step (median; allocator.py
says why they cost time). Alone (`python -m minidp bench compare`, no mpiexec) the
one-process rows are the one-process step. First, a check: every contender took the same
steps on the same data, so their losses must agree (1e-4 relative), else exit code 1.
"Where the time goes" for minidp: communication and staging milliseconds per step (the
strategy's own counters), the rest is compute.
The torch contenders run on --device (default: cuda when a GPU is visible, else cpu).
"""

import itertools
import os
from dataclasses import replace

from minidp import comm
from minidp.cli.training.config import TrainConfig
from minidp.engine import backend
from minidp.tools.log import die, print0
from minidp.tools.parser import Parser
from minidp_bench._common import (
    environment,
    median,
    median_ratio,
    print_table,
    rotated_rounds,
    summary,
    write_json,
)

SINGLE = ("minidp numpy", "minidp torch", "pytorch")
PARALLEL = ("minidp DP", "minidp DP torch", "pytorch DDP")
COLUMNS = [
    ("contender", "s"),
    ("ranks", "d"),
    ("ms_per_step", ".2f"),
    ("vs_minidp", ".2f"),
    ("vs_torch", ".2f"),
    ("faults", ",.0f"),
    ("comm_ms", ".2f"),
    ("stage_ms", ".2f"),
    ("items_per_s", ",.0f"),
]


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench compare", description=summary(__doc__))
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt", help="default gpt")
    parser.add_argument("--n-embd", type=int, default=64, help="GPT channels (default 64)")
    parser.add_argument("--n-layer", type=int, default=2, help="blocks (default 2)")
    parser.add_argument("--n-head", type=int, default=4, help="heads (default 4)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens (default 64)")
    parser.add_argument("--hidden", type=int, default=128, help="MLP width (default 128)")
    parser.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch (default 16)")
    parser.add_argument("--iters", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    parser.add_argument("--out", default="runs/bench_compare", help="directory for the PNG")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        raise die("bench compare: --iters must be >= 1 and --warmup >= 0")
    return args


def build(args, world: comm.Group, device: str) -> tuple[dict, dict]:
    """{name: step()} for every contender, and {name: minidp run} for the counters."""
    from minidp_bench.torch_train import MinidpRun, ReferenceRun, init_gloo

    config = TrainConfig(
        model=args.model, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
        block_size=args.block_size, hidden=args.hidden, batch_size=args.batch_size,
        steps=args.warmup + args.iters, threads=1, overlap="off", sample_tokens=0,
    )  # fmt: skip
    on_torch = replace(config, backend="torch", device=device)
    alone = world.split(world.rank)  # a group of one: each rank trains alone
    runs = {
        "minidp numpy": MinidpRun(config, alone),
        "minidp torch": MinidpRun(on_torch, alone),
        "pytorch": ReferenceRun(config, None, device),
        "minidp DP": MinidpRun(config, world),
        "minidp DP torch": MinidpRun(on_torch, world),
    }
    init_gloo(world)
    runs["pytorch DDP"] = ReferenceRun(config, world, device)
    steps = {}
    for name, run in runs.items():
        counter, run.losses = itertools.count(), []
        steps[name] = lambda run=run, counter=counter: run.losses.append(run.step(next(counter)))
    return steps, runs


def check_same_losses(runs: dict) -> str | None:
    """Every contender took the same steps on the same data from the same weights: their
    losses must agree (float32: 1e-4 relative). The first disagreement, or None."""
    want = runs["minidp numpy"].losses
    for name, run in runs.items():
        gap = max(abs(a - b) / abs(b) for a, b in zip(run.losses, want, strict=True))
        if not gap < 1e-4:
            return f"bench compare: {name}'s losses differ from minidp numpy's by {gap:.1e}"
    return None


def rows_of(times: dict, faults: dict, runs: dict, args, world_size: int) -> list[dict]:
    """One table row per contender: medians, ratios (medians of per-round ratios) against
    minidp and against PyTorch, rank 0's minor page faults per step (median), minidp's
    comm and staging times."""
    items = args.batch_size * (args.block_size if args.model == "gpt" else 1)
    rows = []
    for name, seconds in times.items():
        ms = 1e3 * median(seconds)
        base, torch = (
            ("minidp numpy", "pytorch") if name in SINGLE else ("minidp DP", "pytorch DDP")
        )
        run = runs[name]
        strategy = getattr(run, "strategy", None)
        row = {
            "contender": name,
            "ranks": 1 if name in SINGLE else world_size,
            "ms_per_step": ms,
            "vs_minidp": median_ratio(seconds, times[base]),
            "vs_torch": median_ratio(seconds, times[torch]),
            "faults": median(faults[name]),
            "items_per_s": items / (ms / 1e3),
        }
        if strategy is not None:  # seconds over every round (warm-up too): per step
            n = args.warmup + args.iters
            row["comm_ms"] = 1e3 * strategy.comm_seconds / n
            row["stage_ms"] = 1e3 * strategy.ddp.stage.seconds / n
        rows.append(row)
    return rows


def plot(rows: list[dict], out: str) -> None:
    from minidp.tools.plots import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["contender"] for r in rows]
    ax.barh(names, [r["ms_per_step"] for r in rows], color="tab:blue", label="step")
    ax.barh(names, [r.get("comm_ms") or 0 for r in rows], color="tab:orange", label="comm")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median)")
    ax.legend()
    fig.tight_layout()
    save(fig, os.path.join(out, "compare.png"))


def main(argv: list[str]) -> int:
    from threadpoolctl import threadpool_limits

    args = parse_args(argv)
    try:
        backend.check("torch", "cpu")
    except backend.BackendUnavailable as error:
        raise die(f"bench compare: {error}") from None
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        backend.check("torch", device)
    except backend.BackendUnavailable as error:
        raise die(f"bench compare: {error}") from None
    world = comm.world()
    with threadpool_limits(limits=1, user_api="blas"):  # one BLAS thread per rank, as torch
        env = {**environment(), "torch": torch.__version__, "device": device}
        times, faults, runs = measure(args, world, device, env)
    wrong = check_same_losses(runs)
    if wrong is not None:  # alike on every rank: the losses are global
        print0(wrong, rank=world.rank)
        return 1
    rows = rows_of(times, faults, runs, args, world.size)
    if world.rank == 0:
        print_table(rows, COLUMNS)
        plot(rows, args.out)
        write_json(args.json, [{"bench": "compare", **env, **r} for r in rows])
    return 0


def measure(args, world: comm.Group, device: str, env: dict) -> tuple[dict, dict, dict]:
    """Build the contenders, run the rotated rounds, tear torch.distributed down:
    ({name: seconds per round}, {name: page faults per round}, {name: run})."""
    import torch

    print0(
        f"bench compare | {args.model} | global batch {args.batch_size} | {world.size} ranks "
        f"| torch {torch.__version__} on {device} | {env['blas']}",
        rank=world.rank,
    )
    steps, runs = build(args, world, device)
    faults: dict = {}
    try:
        times = rotated_rounds(steps, args.warmup, args.iters, world.comm, faults=faults)
    finally:
        for run in runs.values():
            if hasattr(run, "close"):
                run.close()
        backend.use("numpy")
    from minidp_bench.torch_train import close_gloo

    close_gloo(world)  # on success only: a rank that raised is ending the job anyway
    return times, faults, runs
