"""Every collective, algorithm and root, on several kinds of group, with checks on and off.

test_comm_collectives.py walks dtypes x ops x lengths on `world().dup()` with checks on (the
suite sets MINIDP_CHECKS=1). This file walks the other axis, as mpi4py's own test suite runs
one mixin over several communicators: one table (`walk`) over

    kind              made by                                   checks   group rank -> world
    dup, fast         Group(world().comm.Dup(),                 off      r -> r
                      checks=False, timeout=None)
    reversed, fast    fast.split(0, key=-r)                     off      r -> p - 1 - r
    parity            split(r % 2, key=-r): evens descending,   on       e.g. [4, 2, 0], [3, 1]
                      odds descending, both halves at once
    parity, fast      the same                                  off
    alternating       split(0, key=r) with checks off and       off/on   r -> r and
                      split(0, key=(r + 1) % p) with checks on,          rotated by one
                      called in turn

Checks off with no timeout is the fast path that training runs: blocking `Sendrecv` and
`Waitall` (p2p.py); checks on polls Isend/Irecv against a deadline instead. One large length,
2^16 + 3 elements (messages of many pages, not divisible by p), runs on the reversed fast
group only, from one root; test_comm_collectives.py has the 2^20 that would catch a send/send
order relying on MPI's eager buffering.

The reference is NumPy: inputs are a function of (world rank, call number), so every rank
builds every member's input and computes the expected result itself; a group that mixes up
its rank order gets the wrong rows. Results are compared byte for byte with that reference,
and the replicated ones (allreduce, allgather, broadcast) also by digest across the group.
The barrier is checked by time: one rank sleeps, then enters, and no rank may leave before
that (checks off matters here: the fingerprint exchange alone already waits for everyone).
"""

import time
import zlib

import numpy as np
import pytest
from test_comm_collectives import DTYPES, check, make

from minidp import comm

MOVE_DTYPES = [*DTYPES, np.uint8, np.bool_]  # collectives without an op carry these too
LENGTHS = (0, 1, 7, 23)
BIG = (1 << 16) + 3
LATE_S = 0.1  # how long the late rank sleeps before it enters the barrier
REDUCTIONS = ("allreduce", "reduce_scatter", "reduce")
_UFUNC = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def fast(group: comm.Group) -> comm.Group:
    """A new group of the same ranks with checks off and no timeout: the fast path."""
    return comm.Group(group.comm.Dup(), checks=False, timeout=None)


def kinds() -> list[tuple[str, list[comm.Group]]]:
    """(name, groups called in turn) for each kind of group in the module doc (collective)."""
    world = comm.world()
    p, r = world.size, world.rank
    quick = fast(world)
    reversed_ = quick.split(0, key=-r)
    assert reversed_.world_ranks == tuple(range(p - 1, -1, -1))
    halves = [world.split(r % 2, key=-r), quick.split(r % 2, key=-r)]
    for half in halves:
        assert half.world_ranks == tuple(range(p - 1, -1, -1))[(p - 1 - r) % 2 :: 2]
    assert halves[0].checks and not halves[1].checks and halves[1].timeout is None
    rotated = world.split(0, key=(r + 1) % p)
    assert rotated.world_ranks == (p - 1, *range(p - 1))
    return [
        ("dup, fast", [quick]),
        ("reversed, fast", [reversed_]),
        ("parity", [halves[0]]),
        ("parity, fast", [halves[1]]),
        ("alternating", [quick.split(0), rotated]),
    ]


def reduced(xs: list[np.ndarray], op: str) -> np.ndarray:
    """The op over the members' inputs, in NumPy; avg divides once at the end (reduce_ops.py)."""
    dtype = xs[0].dtype
    total = _UFUNC[op].reduce(np.stack(xs), axis=0).astype(dtype)
    if op == "avg":
        divide = np.divide if dtype.kind == "f" else np.floor_divide
        divide(total, len(xs), out=total)
    return total


class Call:
    """One collective call of the table: its group, algo, length, root, and what varies with k.

    k numbers the calls (the same on every member) and picks the op, the dtype and how the
    result is asked for: mode 0 a new array, 1 into out=, 2 in place (where the call has one).
    """

    def __init__(self, g: comm.Group, name: str, algo: str, n: int, root: int, k: int) -> None:
        self.g, self.algo, self.n, self.root, self.k = g, algo, n, root, k
        self.op = comm.OPS[k % len(comm.OPS)]
        dtypes = DTYPES if name in REDUCTIONS else MOVE_DTYPES
        self.dtype = np.dtype(dtypes[k // len(comm.OPS) % len(dtypes)])
        self.mode = k % 3
        op = f" {self.op}" if name in REDUCTIONS else ""
        self.what = f"{name} {algo}{op} {self.dtype} n={n} root={root} mode={self.mode} "
        self.what += f"on world ranks {g.world_ranks}, checks {'on' if g.checks else 'off'}"

    def inputs(self, n: int, op: str = "sum") -> list[np.ndarray]:
        """Every member's input of n elements, in group rank order."""
        return [make(n, self.dtype, op, seed=(w, self.k)) for w in self.g.world_ranks]

    def reduction_inputs(self) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """(every member's input, this rank's copy to pass, the output for the mode)."""
        xs = self.inputs(self.n, self.op)
        x = xs[self.g.rank].copy()
        return xs, x, [None, np.empty_like(x), x][self.mode]


def run_allreduce(c: Call) -> np.ndarray:
    xs, x, out = c.reduction_inputs()
    got = comm.allreduce(x, op=c.op, algo=c.algo, group=c.g, out=out)
    assert out is None or got is out, c.what
    check(got, reduced(xs, c.op), c.what)
    if out is not x:
        check(x, xs[c.g.rank], c.what + ": input changed")
    return got


def run_reduce_scatter(c: Call) -> None:
    xs, x, _ = c.reduction_inputs()
    b, r = comm.chunk_bounds(c.n, c.g.size), c.g.rank
    out = np.empty(b[r + 1] - b[r], x.dtype) if c.mode else None
    got = comm.reduce_scatter(x, op=c.op, algo=c.algo, group=c.g, out=out)
    assert out is None or got is out, c.what
    check(got, reduced(xs, c.op)[b[r] : b[r + 1]], c.what)
    check(x, xs[r], c.what + ": input changed")


def run_allgather(c: Call) -> np.ndarray:
    g, r = c.g, c.g.rank
    if c.mode == 0:  # rows: every rank's x of the same size
        xs = c.inputs(c.n)
        got = comm.allgather(xs[r], algo=c.algo, group=g)
        check(got, np.stack(xs), c.what)
        return got
    b = comm.chunk_bounds(c.n, g.size)  # chunks of out, which may differ by one
    whole = np.concatenate([x[: b[i + 1] - b[i]] for i, x in enumerate(c.inputs(c.n))])
    out = np.zeros(c.n, c.dtype)
    mine = whole[b[r] : b[r + 1]].copy()
    if c.mode == 2:  # in place: rank r's chunk already sits in out
        out[b[r] : b[r + 1]] = mine
        mine = out[b[r] : b[r + 1]]
    assert comm.allgather(mine, algo=c.algo, group=g, out=out) is out, c.what
    check(out, whole, c.what)
    return out


def run_broadcast(c: Call) -> np.ndarray:
    theirs = c.inputs(c.n)[c.root]
    x = theirs.copy() if c.g.rank == c.root else np.ones(c.n, c.dtype)
    assert comm.broadcast(x, root=c.root, algo=c.algo, group=c.g) is x, c.what
    check(x, theirs, c.what)
    return x


def run_reduce(c: Call) -> None:
    xs, x, out = c.reduction_inputs()
    got = comm.reduce(x, op=c.op, root=c.root, algo=c.algo, group=c.g, out=out)
    if c.g.rank == c.root:
        assert out is None or got is out, c.what
        check(got, reduced(xs, c.op), c.what)
    else:
        assert got is None, c.what
    if out is not x or c.g.rank != c.root:
        check(x, xs[c.g.rank], c.what + ": input changed")


def run_gather(c: Call) -> None:
    xs = c.inputs(c.n)
    out = np.empty((c.g.size, c.n), c.dtype) if c.mode and c.g.rank == c.root else None
    got = comm.gather(xs[c.g.rank], root=c.root, algo=c.algo, group=c.g, out=out)
    if c.g.rank == c.root:
        assert out is None or got is out, c.what
        check(got, np.stack(xs), c.what)
    else:
        assert got is None, c.what


def run_scatter(c: Call) -> None:
    p, r = c.g.size, c.g.rank
    rows = c.inputs(p * c.n)[c.root].reshape(p, c.n)
    x = rows.copy() if r == c.root else np.zeros_like(rows)
    out = None
    if c.mode:  # into out=; mode 2 passes x=None off the root, as the contract allows
        out = np.empty(c.n, c.dtype)
        x = None if c.mode == 2 and r != c.root else x
    got = comm.scatter(x, root=c.root, algo=c.algo, group=c.g, out=out)
    assert out is None or got is out, c.what
    check(got, rows[r], c.what)


def run_alltoall(c: Call) -> None:
    p, r = c.g.size, c.g.rank
    xs = [x.reshape(p, c.n) for x in c.inputs(p * c.n)]
    out = np.empty((p, c.n), c.dtype) if c.mode else None
    got = comm.alltoall(xs[r], algo=c.algo, group=c.g, out=out)
    assert out is None or got is out, c.what
    check(got, np.stack([x[r] for x in xs]), c.what)  # row j is row r of rank j's x


def run_barrier(c: Call) -> None:
    """Rank k % p sleeps, then enters; every other rank must leave after it entered.

    All ranks share one machine, hence one wall clock: the late rank records time.time()
    just before it enters, the others just after they leave, so a correct barrier gives
    left >= entered whatever the scheduler does, and one that returns early gives left <
    entered by about LATE_S.
    """
    g, late = c.g, c.k % c.g.size
    if g.rank == late:
        time.sleep(LATE_S)
        stamp = time.time()
        comm.barrier(group=g, algo=c.algo)
    else:
        comm.barrier(group=g, algo=c.algo)
        stamp = time.time()
    stamps = g.comm.allgather(stamp)  # MPI's own, outside minidp
    early = [i for i in range(g.size) if stamps[i] < stamps[late]]
    assert not early, f"{c.what}: ranks {early} left before late rank {late} entered"
    assert g.counters["barrier"]["bytes_sent"] == 0, c.what


RUN = {
    "allreduce": run_allreduce,
    "reduce_scatter": run_reduce_scatter,
    "allgather": run_allgather,
    "broadcast": run_broadcast,
    "reduce": run_reduce,
    "gather": run_gather,
    "scatter": run_scatter,
    "alltoall": run_alltoall,
    "barrier": run_barrier,
}
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def walk(groups: list[comm.Group], lengths, names=tuple(RUN), roots=None) -> None:
    """Every algorithm of each named collective, every length and root (default: all), the
    calls dealt to `groups` in turn; then the replicated results compared across ranks."""
    size = groups[0].size
    assert all(g.size == size for g in groups)  # the same calls on every rank
    digests = [0] * len(groups)
    k = 0
    for name in names:
        for algo in comm.ALGORITHMS[name]:
            for n in lengths[:1] if name == "barrier" else lengths:
                for root in (roots or range(size)) if name in ROOTED else [None]:
                    i = k % len(groups)
                    got = RUN[name](Call(groups[i], name, algo, n, root, k))
                    if got is not None:
                        digests[i] = zlib.crc32(np.ascontiguousarray(got).tobytes(), digests[i])
                    k += 1
    for g, digest in zip(groups, digests):
        everyone = g.comm.allgather(digest)
        assert len(set(everyone)) == 1, f"group {g.world_ranks}: ranks differ: {everyone}"


@pytest.mark.timeout(240)
@pytest.mark.parallel(nprocs=[3, 4, 5])
def test_every_collective_on_every_kind_of_group():
    made = kinds()
    for _, groups in made:
        walk(groups, LENGTHS)
    big = dict(made)["reversed, fast"]
    walk(big, (BIG,), roots=[big[0].size - 1])
    for _, groups in made:
        for g in groups:
            g.free()


@pytest.mark.timeout(240)
@pytest.mark.parallel(nprocs=[7])
def test_butterflies_fold_two_or_more_left_over_ranks():
    """p = 7: rem = 3 ranks fold onto p' = 4 (recursive.py), checks on and off (the fold is
    the same code for any rem >= 2)."""
    world = comm.world()
    quick = fast(world)
    names = ("allreduce", "reduce_scatter", "allgather")
    for groups in ([world.dup()], [quick.split(0, key=-world.rank)]):
        walk(groups, (0, 1, 5, 23, 1000), names)
        groups[0].free()
    quick.free()
