"""Hand-written collectives against MPI's own, nccl-tests style.

    mpiexec -n 2 python -m minidp bench collectives
    mpiexec -n 4 python -m minidp bench collectives --ops allreduce --algos ring,rabenseifner \
        --sizes 4K,64K,1M,16M,64M --json collectives.json

For each collective, size and algorithm, the hand-written call and MPI's builtin (called
directly through mpi4py) alternate in one job, A B A B ...: after --warmup calls of each,
--iters timed pairs. One call's time is the slowest rank's (Barrier, time, max over ranks);
the table shows medians. Both sides get preallocated inputs and outputs; page faults per
call (ru_minflt) show who allocates temporaries. allreduce `shm` runs in place on an array
in shared memory (comm.shared_zeros, as DDP's buckets are), against MPI's in place
(MPI_IN_PLACE) on a plain array of the same values.

    algbw = bytes / time            bytes: the whole vector (allgather: the gathered output)
    busbw = algbw * 2(p-1)/p        allreduce
            algbw * (p-1)/p         reduce_scatter, allgather, alltoall
            algbw                   broadcast, reduce
    ratio = the median over pairs of MPI's time / ours (> 1: ours is faster)

Before timing, each algorithm's result at each size is compared with the builtin's (same
input, float tolerance); a mismatch ends the run with exit code 1: a fast wrong answer is
not a result. MINIDP_CHECKS is ignored here: the group runs with checks off unless
`--checks on` (the header says which), since MPI's builtin checks nothing; `--checks on`
measures what minidp's default (fingerprints and deadlines) costs per call.
"""

import argparse

import numpy as np
from mpi4py import MPI

from minidp import comm
from minidp.tools.info import mpi_library
from minidp.tools.log import die
from minidp.tools.parser import Parser
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
}
DEFAULT_OPS = "allreduce,reduce_scatter,allgather,broadcast"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def contenders(op: str, algo: str, nbytes: int, dtype: np.dtype, group: comm.Group):
    """(ours, builtin, output): zero-argument callables on buffers allocated once, here;
    output() is what the last call wrote (None where this rank gets nothing)."""
    p, r, mpi = group.size, group.rank, group.comm
    n = max(nbytes // dtype.itemsize, 1)
    rng = np.random.default_rng(r)
    x = rng.standard_normal(n).astype(dtype)
    out = np.empty_like(x)
    if op == "allreduce" and algo == "shm":  # in place on shared memory, as DDP's buckets
        return _in_place_shm(x, group)
    if op == "allreduce":
        return (
            lambda: comm.allreduce(x, algo=algo, group=group, out=out),
            lambda: mpi.Allreduce(x, out, op=MPI.SUM),
            out.copy,
        )
    if op == "reduce_scatter":
        bounds = comm.chunk_bounds(n, p)
        mine = np.empty(bounds[r + 1] - bounds[r], dtype)
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        return (
            lambda: comm.reduce_scatter(x, algo=algo, group=group, out=mine),
            lambda: mpi.Reduce_scatter(x, mine, counts, op=MPI.SUM),
            mine.copy,
        )
    if op == "allgather":
        bounds = comm.chunk_bounds(n, p)
        mine = x[bounds[r] : bounds[r + 1]].copy()
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        return (
            lambda: comm.allgather(mine, algo=algo, group=group, out=out),
            lambda: mpi.Allgatherv(
                mine, [out, counts, bounds[:-1], MPI.Datatype.fromcode(dtype.char)]
            ),
            out.copy,
        )
    if op == "broadcast":
        return (
            lambda: comm.broadcast(x, root=0, algo=algo, group=group),
            lambda: mpi.Bcast(x, root=0),
            x.copy,  # in place: ours runs first, on the ranks' own data
        )
    if op == "reduce":
        return (
            lambda: comm.reduce(x, root=0, algo=algo, group=group, out=out),
            lambda: mpi.Reduce(x, out if r == 0 else None, op=MPI.SUM, root=0),
            lambda: out.copy() if r == 0 else None,
        )
    if op == "alltoall":
        rows = x[: n // p * p].reshape(p, -1)
        got = np.empty_like(rows)
        return (
            lambda: comm.alltoall(rows, algo=algo, group=group, out=got),
            lambda: mpi.Alltoall(rows, got),
            got.copy,
        )
    raise AssertionError(op)


def _in_place_shm(x: np.ndarray, group: comm.Group):
    """contenders() for allreduce "shm": ours in place on a copy of x in shared memory, MPI's
    in place (MPI_IN_PLACE) on a plain copy; output() is what the last call reduced. Both
    start from x and sum in place every call, so their values grow alike."""
    shared, plain = comm.shared_zeros(x.size, x.dtype, group), x.copy()
    shared[...] = x
    last = [shared]

    def ours():
        comm.allreduce(shared, algo="shm", group=group, out=shared)
        last[0] = shared

    def builtin():
        group.comm.Allreduce(MPI.IN_PLACE, plain, op=MPI.SUM)
        last[0] = plain

    return ours, builtin, lambda: last[0].copy()


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
    op: str, algo: str, nbytes: int, dtype: np.dtype, group: comm.Group, warmup: int, iters: int
) -> dict:
    """One row of the table: `op` by `algo` against MPI's own on nbytes of dtype, alternated
    (warmup calls of each, then iters timed pairs); medians, busbw, ratio and page faults as
    the module docstring defines them. Every rank of group calls it and gets the same row.
    Public: tutorial 04 measures its ring with it."""
    calls = contenders(op, algo, nbytes, dtype, group)
    check_result(op, algo, nbytes, dtype, group, calls)
    ours, builtin, _ = calls
    for _ in range(warmup):
        ours()
        builtin()
    times: dict[str, list[float]] = {"ours": [], "mpi": []}
    faults = {"ours": 0, "mpi": 0}
    for _ in range(iters):  # A B A B: drift hits both alike
        for name, call in (("ours", ours), ("mpi", builtin)):
            t, f = timed(call, group.comm)
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
    }


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
    known = {op: [a for a in comm.ALGORITHMS[op] if a != "mpi"] for op in ops}
    wanted = args.algos.split(",") if args.algos else []
    stray = [a for a in wanted if not any(a in algos for algos in known.values())]
    if stray:
        raise die(f"bench collectives: no chosen collective has algorithm(s) {stray}")
    plan = [(op, [a for a in have if not wanted or a in wanted]) for op, have in known.items()]
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
            measure(op, algo, nbytes, dtype, group, args.warmup, args.iters)
            for nbytes in sizes
            for algo in algos
        ]
        records += [{**row, "env": env} for row in rows]
        if group.rank == 0:
            print_table(rows, COLUMNS)
    if group.rank == 0:
        write_json(args.json, records)
    group.free()
    return 0
