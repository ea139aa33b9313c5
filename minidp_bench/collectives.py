"""Hand-written collectives against MPI's own, nccl-tests style.

    mpiexec -n 2 python -m minidp bench collectives
    mpiexec -n 4 python -m minidp bench collectives --ops allreduce --algos ring,rabenseifner \
        --sizes 4K,64K,1M,16M,64M --json collectives.json
    mpiexec -n 2 python -m minidp bench collectives --ops allreduce,p2p --algos auto,ring --paths

For each collective, size and algorithm, the hand-written call and MPI's builtin (called
directly through mpi4py) alternate in one job, A B A B ...: after --warmup calls of each,
--iters timed pairs. One call's time is the slowest rank's (Barrier, time, max over ranks);
the table shows medians. Both sides get preallocated inputs and outputs; page faults per
call (ru_minflt) show who allocates temporaries. allreduce `shm` runs in place on an array
in shared memory (comm.shared_zeros, as DDP's buckets are), against MPI's in place
(MPI_IN_PLACE) on a plain array of the same values. `auto` (asked for by name: --algos
auto) is the algorithm DDP and the schemes use. `p2p` pairs the ranks (0 sends to 1, 2 to
3, ...): comm.p2p.send/recv against MPI's Send/Recv. `--paths` adds ours through the plain
path (comm/fast_path.py's `plain()`) as a third in every round: plain_us, and speedup =
the median over rounds of plain's time / the fast path's.

    algbw = bytes / time            bytes: the whole vector (allgather: the gathered output)
    busbw = algbw * 2(p-1)/p        allreduce
            algbw * (p-1)/p         reduce_scatter, allgather, alltoall
            algbw                   broadcast, reduce, p2p
    ratio = the median over pairs of MPI's time / ours (> 1: ours is faster)

Before timing, each algorithm's result at each size is compared with the builtin's (same
input, float tolerance); a mismatch ends the run with exit code 1: a fast wrong answer is
not a result. MINIDP_CHECKS is ignored here: the group runs with checks off unless
`--checks on` (the header says which), since MPI's builtin checks nothing; `--checks on`
measures what minidp's default (fingerprints and deadlines) costs per call.
"""

import argparse
import contextlib

import numpy as np
from mpi4py import MPI

from minidp import comm
from minidp.comm import fast_path
from minidp.tools.info import mpi_library
from minidp.tools.log import die
from minidp.tools.parser import Parser
from minidp_bench._collective_calls import contenders
from minidp_bench._common import (
    environment,
    median,
    median_ratio,
    print_table,
    timed,
    write_json,
)

BUS_FACTOR = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
    "p2p": lambda p: 1.0,
}
DEFAULT_OPS = "allreduce,reduce_scatter,allgather,broadcast"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def check_result(op: str, algo: str, nbytes: int, dtype: np.dtype, group: comm.Group, calls):
    """Run ours, then the builtin, on the same input; die (exit code 1, every rank) unless
    the outputs agree to a float tolerance (sums in another order round differently)."""
    ours, builtin, output = calls
    ours()
    got = output()
    builtin()
    want = output()
    error = 0.0  # this rank's max |difference| beyond the tolerance (NaN counts)
    if want is not None:
        diff = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max(initial=0))
        scale = float(np.abs(want).max(initial=1.0))
        tol = 0.0 if dtype.kind in "iu" else 8 * group.size * float(np.finfo(dtype).eps) * scale
        error = 0.0 if diff <= tol else diff
    errors = group.comm.allgather(error)
    if any(errors):
        rank = int(np.argmax(errors))
        raise die(
            f"bench collectives: {op} algo {algo} at {human(nbytes)} {dtype} gives another "
            f"result than MPI's builtin (max |difference| {errors[rank]:.3g} on rank {rank}); "
            "not timing a wrong answer",
            code=1,
        )


def measure(
    op: str,
    algo: str,
    nbytes: int,
    dtype: np.dtype,
    group: comm.Group,
    warmup: int,
    iters: int,
    paths: bool = False,
) -> dict:
    """One row of the table: `op` by `algo` against MPI's own on nbytes of dtype, alternated
    (warmup calls of each, then iters timed pairs); medians, busbw, ratio and page faults as
    the module docstring defines them. Every rank of group calls it and gets the same row.
    paths: ours through the plain path too (fast_path.plain()), a third in each round.
    Public: tutorial 04 measures its ring with it."""
    calls = contenders(op, algo, nbytes, dtype, group)
    check_result(op, algo, nbytes, dtype, group, calls)
    ours, builtin, _ = calls
    rounds = [("ours", ours), ("mpi", builtin)] + [("plain", ours)] * paths
    times: dict[str, list[float]] = {name: [] for name, _ in rounds}
    faults = dict.fromkeys(times, 0)
    for i in range(warmup + iters):  # A B A B: drift hits both alike
        for name, call in rounds:
            with fast_path.plain() if name == "plain" else contextlib.nullcontext():
                t, f = timed(call, group.comm)
            if i >= warmup:
                times[name].append(t)
                faults[name] += f
    p = group.size
    t_ours, t_mpi = median(times["ours"]), median(times["mpi"])
    nbytes = max(nbytes // dtype.itemsize, 1) * dtype.itemsize
    bus = BUS_FACTOR[op](p)
    worst = group.comm.allreduce(faults["ours"], op=MPI.MAX)
    worst_mpi = group.comm.allreduce(faults["mpi"], op=MPI.MAX)
    return {
        "op": op,
        "algo": algo,
        "bytes": nbytes,
        "size": human(nbytes),
        "nprocs": p,
        "dtype": dtype.name,
        "time_s": t_ours,
        "builtin_time_s": t_mpi,
        "time_us": t_ours * 1e6,
        "mpi_us": t_mpi * 1e6,
        "algbw_gbs": nbytes / t_ours / 1e9,
        "busbw_gbs": nbytes / t_ours / 1e9 * bus,
        "builtin_busbw_gbs": nbytes / t_mpi / 1e9 * bus,
        "ratio": median_ratio(times["mpi"], times["ours"]),
        "faults_per_call": worst / iters,
        "builtin_faults_per_call": worst_mpi / iters,
    } | _plain_path(times, paths)


def _plain_path(times: dict, paths: bool) -> dict:
    """The plain path's median and its time over the fast path's, per round (> 1: faster)."""
    if not paths:
        return {}
    plain = times["plain"]
    return {"plain_us": median(plain) * 1e6, "speedup": median_ratio(plain, times["ours"])}


def human(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
    return str(nbytes)


COLUMNS = [
    ("op", ""),
    ("algo", ""),
    ("size", ""),
    ("nprocs", "d"),
    ("time_us", ".1f"),
    ("mpi_us", ".1f"),
    ("algbw_gbs", ".2f"),
    ("busbw_gbs", ".2f"),
    ("builtin_busbw_gbs", ".2f"),
    ("ratio", ".2f"),
    ("faults_per_call", ".1f"),
    ("builtin_faults_per_call", ".1f"),
]


PATH_COLUMNS = [("plain_us", ".1f"), ("speedup", ".2f")]


def check_args(args) -> tuple[np.dtype, list[int], list[tuple[str, list[str]]]]:
    """(dtype, sizes, [(op, its algorithms)]), or die() naming the bad value: every rank alike.

    --algos keeps, for each op, the algorithms it has (ring serves four ops, pairwise one);
    a name that no chosen op has is an error, not a silently empty table."""
    try:
        dtype = np.dtype(args.dtype)
        sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    except (TypeError, ValueError) as error:
        raise die(f"bench collectives: bad --dtype or --sizes: {error}") from None
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in BUS_FACTOR]
    if unknown:
        choices = ", ".join(BUS_FACTOR)
        raise die(f"bench collectives: unknown collective(s) {unknown}; choose from {choices}")
    known = {op: ["send_recv"] if op == "p2p" else [*comm.ALGORITHMS[op], "auto"] for op in ops}
    wanted = args.algos.split(",") if args.algos else []
    stray = [a for a in wanted if not any(a in algos for algos in known.values())]
    if stray:
        raise die(f"bench collectives: no chosen collective has algorithm(s) {stray}")
    default = [a for algos in known.values() for a in algos if a not in ("mpi", "auto")]
    wanted = wanted or default
    plan = [(op, [a for a in have if a in wanted or op == "p2p"]) for op, have in known.items()]
    return dtype, sizes, [(op, algos) for op, algos in plan if algos]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="minidp bench collectives",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ops", default=DEFAULT_OPS, help=f"comma list (default {DEFAULT_OPS})")
    parser.add_argument("--algos", default="", help="comma list (default: all but mpi)")
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="bytes, K/M/G suffixes")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--iters", type=int, default=20, help="timed pairs (>= 15)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--checks", choices=("on", "off"), default="off", help="default off")
    parser.add_argument("--json", default=None, help="write JSON lines here")
    parser.add_argument(
        "--paths", action="store_true", help="time ours through the plain path too (a third)"
    )
    args = parser.parse_args(argv)
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)  # one BLAS thread per rank: ranks share the cores; collectives use none
    group = comm.Group(MPI.COMM_WORLD.Dup(), checks=args.checks == "on")  # deadline follows
    dtype, sizes, plan = check_args(args)
    env = environment()
    if group.rank == 0:
        print(
            f"# {group.size} ranks, {dtype}, median of {args.iters} after {args.warmup} "
            f"warm-up; checks {args.checks}; {env['blas']}; MPI: {mpi_library()}",
            flush=True,
        )
    records = []
    for op, algos in plan:
        rows = [
            measure(op, algo, nbytes, dtype, group, args.warmup, args.iters, args.paths)
            for nbytes in sizes
            for algo in algos
        ]
        records += [{**row, "env": env} for row in rows]
        if group.rank == 0:
            print_table(rows, COLUMNS + PATH_COLUMNS * args.paths)
    if group.rank == 0:
        write_json(args.json, records)
    group.free()
    return 0
