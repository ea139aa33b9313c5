"""Where the microseconds of one small allreduce go: its parts, each timed alone.

    mpiexec -n 2 python -m minidp bench percall
    mpiexec -n 2 python -m minidp bench percall --bytes 4K --algo ring --calls 2000

A ring allreduce of 4 KiB on p ranks is Python's work around 2(p - 1) messages of n/p
bytes. Each part below runs --calls times back to back on every rank at once (the parts
with messages in lockstep), and the table gives the slowest rank's time per call, the
median of --rounds such batches, and how many times one allreduce of the plain path does
it: the product is its share. The last rows time the whole call (the plain path, the fast
path of comm/fast_path.py, MPI's own Allreduce) the same way, checks off, then on.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

from minidp import comm
from minidp.comm import fast_path
from minidp.comm.args import flat, pick, result, same_memory
from minidp.comm.collectives import ALLREDUCE
from minidp.comm.p2p import BYTE, DATA_TAG, sendrecv
from minidp.comm.reduce_ops import check_op, combine
from minidp.tools.chunks import chunk_bounds
from minidp.tools.parser import Parser
from minidp_bench._common import median, print_table, write_json
from minidp_bench.collectives import parse_size


def per_call(call, calls: int, rounds: int, mpi) -> float:
    """Seconds per call: `calls` calls back to back after a Barrier, the slowest rank's,
    the median of `rounds` batches."""
    for _ in range(min(calls, 100)):
        call()
    batches = []
    for _ in range(rounds):
        mpi.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        batches.append(mpi.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX))
    return median(batches)


def parts(group: comm.Group, x: np.ndarray, out: np.ndarray, algo: str) -> list[tuple]:
    """(part, call, times one plain allreduce does it)."""
    p, mpi = group.size, group.comm
    b = chunk_bounds(x.size, p)
    half, got = x[b[0] : b[1]], np.empty(b[1] - b[0], x.dtype)
    steps = 2 * (p - 1) if algo == "ring" else max(p.bit_length() - 1, 1)
    if algo != "ring":
        half, got = x, np.empty_like(x)
    persistent = [
        mpi.Recv_init([got, BYTE], group.left, DATA_TAG + 1),
        mpi.Send_init([half, BYTE], group.right, DATA_TAG + 1),
    ]

    def started():
        MPI.Prequest.Startall(persistent)
        MPI.Request.Waitall(persistent)

    def checks():
        flat(x)
        check_op("sum", x.dtype)
        pick(algo, ALLREDUCE, "allreduce", x.nbytes, p)
        same_memory(x, result(out, x.shape, x.dtype))

    def entered():
        with group.collective("allreduce", algo, "sum", x.dtype, None, x.shape):
            pass

    def requests():
        MPI.Request.Waitall(
            [mpi.Irecv([got, BYTE], group.left, 9), mpi.Isend([half, BYTE], group.right, 9)]
        )

    return [
        ("argument checks (flat, op, pick, out)", checks, 1),
        ("in shared memory? (auto only)", lambda: comm.in_shared_memory(x, group), 0),
        ("collective enter/exit, checks off", entered, 1),
        ("chunk bounds + scratch lookup", lambda: group.scratch.get("x", b[1], x.dtype), 1),
        ("a step's slices (2 views)", lambda: (x[b[0] : b[1]], out[b[0] : b[1]]), steps),
        (
            "step: p2p.sendrecv (the plain path)",
            lambda: sendrecv(group, half, group.right, got, group.left),
            steps,
        ),
        (
            "step: bare mpi4py Sendrecv",
            lambda: mpi.Sendrecv([half, BYTE], group.right, 8, [got, BYTE], group.left, 8),
            0,
        ),
        ("step: Irecv + Isend + Waitall", requests, 0),
        ("step: persistent Startall + Waitall", started, 0),
        (
            "numpy reduce of a chunk",
            lambda: combine("sum", got, half, out=got),
            steps // 2 if algo == "ring" else steps,
        ),
        ("copy of the vector (fast path's staging)", lambda: np.copyto(out, x), 0),
        ("MPI's own Allreduce", lambda: mpi.Allreduce(x, out, op=MPI.SUM), 0),
        ("allreduce, plain path", lambda: _plain(x, out, algo, group), 0),
        ("allreduce, fast path", lambda: comm.allreduce(x, algo=algo, group=group, out=out), 0),
    ]


def _plain(x, out, algo, group):
    with fast_path.plain():
        comm.allreduce(x, algo=algo, group=group, out=out)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="minidp bench percall",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--bytes", default="4K", help="the allreduce's size (K/M suffixes)")
    parser.add_argument("--algo", default="ring", choices=("ring", "recursive_doubling"))
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed batch")
    parser.add_argument("--rounds", type=int, default=7, help="batches (the median)")
    parser.add_argument("--json", default=None, help="write JSON lines here")
    args = parser.parse_args(argv)
    group = comm.Group(MPI.COMM_WORLD.Dup(), checks=False, timeout=None)
    n = max(parse_size(args.bytes) // 4, 1)
    x = np.random.default_rng(group.rank).standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    rows = []
    for name, call, times in parts(group, x, out, args.algo):
        us = per_call(call, args.calls, args.rounds, group.comm) * 1e6
        rows.append({"part": name, "us": us, "times": times, "in_a_call_us": us * times})
    group.checks = True
    for name, algo in (("allreduce, checks on, plain", None), ("allreduce, checks on, fast", 1)):
        call = (
            (lambda: comm.allreduce(x, algo=args.algo, group=group, out=out))
            if algo
            else (lambda: _plain(x, out, args.algo, group))
        )
        us = per_call(call, args.calls // 4, args.rounds, group.comm) * 1e6
        rows.append({"part": name, "us": us, "times": 0, "in_a_call_us": 0.0})
    if group.rank == 0:
        print(f"# {args.algo} allreduce of {x.nbytes} B on {group.size} ranks, float32", flush=True)
        print_table(rows, [("part", ""), ("us", ".2f"), ("times", "d"), ("in_a_call_us", ".2f")])
        write_json(args.json, rows)
    group.free()
    return 0
