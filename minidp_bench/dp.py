"""Data-parallel training, measured: what a second rank costs, and how close minidp's DDP
comes to a hand-written data-parallel loop.

    mpiexec -n 2 python -m minidp bench dp [--iters 15] [--algos ring,mpi] [--checks off]
    mpiexec -n 4 python -m minidp bench dp --case shallowspeed [--json FILE]
    mpiexec -n 2 python -m minidp bench dp --case tricks [--iters 30]

--case weak (the default): weak scaling. The step: forward, backward, gradient allreduce,
SGD, for an MLP 784-1024-1024-10 (--sizes) with a batch of 256 (--batch) *per rank*,
float32, one BLAS thread per rank. Contenders, each once per round:
  solo        rank 0 trains alone (same model, no communication) while the others wait
  dp ALGO     every rank takes a data-parallel step, gradients reduced with ALGO (every
              allreduce algorithm by default, MPI's own included), with and without
              overlapping communication and backward
  torch DDP   the same step in PyTorch DDP (gloo over 127.0.0.1), when torch is installed
Weak-scaling efficiency = solo time / DP time (1.0: the second rank costs nothing).

--case shallowspeed: the setup of ShallowSpeed (siboehm/ShallowSpeed), minidp's DDP against
a hand-written NumPy data-parallel loop of the same shape (see _dp_shallowspeed.py).

--case tricks: the weak case's step with each of DDP's speed tricks on and off, side by
side (see _dp_tricks.py): what each one buys.

Every time is the slowest rank's (barrier, time, allreduce-max); the contenders' order is
rotated by one every round (A B C, B C A, ...); reported are medians of per-round ratios,
and communication and exposed times as the maximum over ranks, per timed step.

Checks: `--checks off` (the default) runs minidp's groups without cross-rank fingerprints,
as MPI and torch DDP run (they check nothing); `--checks on` measures what minidp's
default (fingerprints and deadlines) costs. MINIDP_CHECKS in the environment is ignored;
the header says which ran.
"""

import functools
import socket

import numpy as np
from mpi4py import MPI

from minidp import comm
from minidp.parallel.data_parallel.ddp import overlap_helps
from minidp.tools.log import die, print0
from minidp.tools.parser import Parser
from minidp_bench import _dp_shallowspeed, _dp_tricks
from minidp_bench._common import (
    environment,
    median,
    median_ratio,
    per_timed_step_ms,
    print_table,
    rotated_rounds,
    summary,
    write_json,
    zero_comm_seconds,
)
from minidp_bench._mlp import (
    BATCH,
    LR,
    SIZES,
    ddp_per_algo,
    ddp_sgd_step,
    make_data,
    make_model,
    minidp_sgd_step,
    parse_sizes,
    torch_mlp_step,
)

ALGOS = comm.ALGORITHMS["allreduce"]  # every hand-written allreduce, and "mpi"
CASES = ("weak", "shallowspeed", "tricks")


def torch_ddp_step(world, sizes, x, y):
    """The same step in torch.nn.parallel.DistributedDataParallel over gloo (or None)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    port = np.zeros(1, dtype=np.int64)
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    world.Bcast(port, root=0)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{int(port[0])}",
        rank=world.rank,
        world_size=world.size,
    )
    wrap = torch.nn.parallel.DistributedDataParallel
    return torch_mlp_step(torch, make_model(sizes), x, y, LR, wrap=wrap)


def weak_scaling(args, group: comm.Group, world) -> tuple[list[dict], list, str]:
    """The default case: solo, DP per algorithm and overlap, torch DDP. Returns (one row
    per DP contender, the table's columns, the goals line)."""
    sizes, batch = args.sizes, args.batch
    x, y = make_data(sizes, batch, seed=100 + world.rank)
    steps = {}
    solo = minidp_sgd_step(make_model(sizes), x, y)
    steps["solo"] = lambda: solo() if world.rank == 0 else None
    ddps = ddp_per_algo(sizes, group, args.algos, args.bucket_mb)
    for name, ddp in ddps.items():
        steps[name] = ddp_sgd_step(ddp, x, y)
    torch_step = None if args.no_torch else torch_ddp_step(world, sizes, x, y)
    if torch_step:
        steps["torch"] = torch_step

    forget_warmup = functools.partial(zero_comm_seconds, ddps.values())
    times = rotated_rounds(steps, args.warmup, args.iters, world, forget_warmup)
    rows = []
    for (algo, overlap), ddp in ddps.items():
        ts = times[(algo, overlap)]
        row = {
            "case": "weak",
            "algo": algo,
            "overlap": overlap,
            "nprocs": world.size,
            "threads": 1,
            "batch_per_rank": batch,
            "sizes": "-".join(map(str, sizes)),
            "buckets": len(ddp.buckets),
            "step_ms": 1e3 * median(ts),
            "solo_ms": 1e3 * median(times["solo"]),
            "efficiency": median_ratio(times["solo"], ts),
            "comm_ms": per_timed_step_ms(ddp.comm_seconds, args.iters, world),
            "exposed_ms": per_timed_step_ms(ddp.exposed_seconds, args.iters, world),
        }
        if ("mpi", overlap) in times:
            row["vs_mpi_dp"] = median_ratio(ts, times[("mpi", overlap)])
        if "torch" in times:
            row["torch_ddp_ms"] = 1e3 * median(times["torch"])
            row["vs_torch_ddp"] = median_ratio(ts, times["torch"])
        rows.append(row)
        ddp.close()
    if rows:
        print0(
            f"solo step {rows[0]['solo_ms']:.2f} ms"
            + (f" | torch DDP step {rows[0]['torch_ddp_ms']:.2f} ms" if "torch" in times else "")
        )
        print0(default_settings(rows, world.size))
    columns = [
        ("algo", "s"),
        ("overlap", ""),
        ("buckets", "d"),
        ("step_ms", ".2f"),
        ("efficiency", ".3f"),
        ("comm_ms", ".2f"),
        ("exposed_ms", ".2f"),
        ("vs_mpi_dp", ".3f"),
        ("vs_torch_ddp", ".3f"),
    ]
    goals = (
        "goals: efficiency >= 0.80 (stretch 0.85); ring within 3% of mpi (vs_mpi_dp <= 1.03); "
        "vs_torch_ddp <= 0.8"
    )
    return rows, columns, goals


def default_settings(rows: list[dict], nprocs: int) -> str:
    """The row a user gets without flags: algo auto, overlap as overlap="auto" decides here."""
    overlap, why = overlap_helps(nprocs)
    row = next((r for r in rows if r["algo"] == "auto" and r["overlap"] == overlap), None)
    if row is None:
        return "default settings (algo auto) not measured: add auto to --algos"
    torch = f", {row['vs_torch_ddp']:.3f}x torch DDP's step" if "vs_torch_ddp" in row else ""
    return (
        f"default settings (algo auto, overlap {'on' if overlap else 'off'}: {why}): "
        f"efficiency {row['efficiency']:.3f}{torch}"
    )


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench dp", description=summary(__doc__))
    parser.add_argument("--case", choices=CASES, default="weak", help="what to measure")
    parser.add_argument("--iters", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds (default 3)")
    parser.add_argument(
        "--algos", default=None, help="allreduce algorithms (weak: all; shallowspeed: auto)"
    )
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help=f"bucket size, MiB (weak: 2; shallowspeed: {_dp_shallowspeed.BUCKET_MB})",
    )
    parser.add_argument("--checks", choices=("on", "off"), default="off", help="default off")
    parser.add_argument("--sizes", default=None, help=f"weak case's MLP (default {SIZES})")
    parser.add_argument("--batch", type=int, default=BATCH, help="weak case: batch per rank")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch DDP")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    args = parser.parse_args(argv)
    shallow = args.case == "shallowspeed"
    args.algos = (args.algos or ("auto" if shallow else ",".join(("auto", *ALGOS)))).split(",")
    known = ("auto", *ALGOS)
    unknown = [a for a in args.algos if a not in known]
    if unknown:
        raise die(f"bench dp: unknown allreduce algorithm(s) {unknown}; choose from {known}")
    if args.bucket_mb is None:
        args.bucket_mb = _dp_shallowspeed.BUCKET_MB if shallow else 2.0
    if args.iters < 1 or args.warmup < 0 or args.batch < 1 or args.bucket_mb <= 0:
        raise die("bench dp: --iters, --batch and --bucket-mb must be positive, --warmup >= 0")
    if shallow and args.sizes:
        raise die("bench dp: --case shallowspeed has its own network; drop --sizes")
    try:
        args.sizes = (
            _dp_shallowspeed.SIZES if shallow else parse_sizes(args.sizes) if args.sizes else SIZES
        )
    except ValueError as error:
        raise die(f"bench dp: bad --sizes: {error}") from None
    return args


def header(args, world, env: dict, checks: str) -> str:
    if args.case == "shallowspeed":
        batch = (
            f"global batch {_dp_shallowspeed.GLOBAL_BATCH}, "
            f"{_dp_shallowspeed.MICRO_BATCHES} micro-batches per rank, SGD"
        )
    else:
        batch = f"batch {args.batch}/rank"
    return (
        f"bench dp: case {args.case} | MLP {'-'.join(map(str, args.sizes))}, {batch}, "
        f"float32 | {world.size} ranks x 1 BLAS thread | bucket {args.bucket_mb} MiB | "
        f"checks {checks} | {env['blas']}"
    )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from threadpoolctl import threadpool_limits

    world = MPI.COMM_WORLD
    if world.size < 2:
        print0("bench dp needs at least 2 ranks: mpiexec -n 2 python -m minidp bench dp")
        return 2
    group = comm.Group(world.Dup(), checks=args.checks == "on")
    checks = "on" if group.checks else "off"  # what the groups do, DDP's dup() included
    measure = {"shallowspeed": _dp_shallowspeed.measure, "tricks": _dp_tricks.measure}.get(
        args.case, weak_scaling
    )
    with threadpool_limits(limits=1, user_api="blas"):
        env = environment()  # inside: it reports the BLAS threads the steps run with
        print0(header(args, world, env, checks))
        rows, columns, goals = measure(args, group, world)
    group.free()
    if world.rank == 0:
        print_table(rows, columns)
        print(goals, flush=True)
        write_json(args.json, [{"bench": "dp", **env, "checks": checks, **r} for r in rows])
    return 0
