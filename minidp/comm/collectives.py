"""The collectives every rank calls together: allreduce, reduce_scatter, allgather, alltoall,
barrier. (Those with a root are in rooted.py.)

The contract, once. Every rank of the group calls the same collective, in the same order,
with the same shape, dtype, op and algo (checks.py verifies this unless MINIDP_CHECKS=0).
Inputs are C-contiguous NumPy arrays of any shape, treated as flat; they are only read,
unless you pass `out=x`. `out=` takes a preallocated result (the fast path: nothing is
allocated after the first call); without it the result is a new array. Pass everything but x
by keyword. `group=None` means `world()`.

    allreduce(x, op, algo, group, out)        -> x.shape: the op over all ranks' x
    allreduce_coalesced(xs, op, algo, group)  -> None: allreduce(x, out=x) for each x of the
                                                 list xs, the same bits, as one call where
                                                 the algorithm can (shm)
    reduce_scatter(x, op, algo, group, out)   -> 1-D: this rank's chunk of the reduced x,
                                                 elements [b[r], b[r+1]) where
                                                 b = chunk_bounds(x.size, p)
    allgather(x, algo, group, out)            -> out=None: shape (p, *x.shape), row i from rank i
                                                 out given (any shape, size n): rank i's x fills
                                                 out.flat[b[i]:b[i+1]], b = chunk_bounds(n, p),
                                                 so chunks may differ by one (the inverse of
                                                 reduce_scatter, as ZeRO wants)
    alltoall(x, algo, group, out)             -> x.shape == (p, ...): row j of the result
                                                 is row r of rank j's x
    barrier(group, algo)                      -> None, once every rank has arrived

ops: sum, avg, max, min, prod. Every rank gets bitwise-identical results (each algorithm
either computes each element on one rank and copies it, or has both partners combine the
same operands in the same order; see reduce_ops.py). Algorithm names and costs are in the
docstrings of ring.py, recursive.py, tree.py, naive.py, alltoall.py, barrier.py; "auto" is
explained in auto.py.
"""

import functools

import numpy as np

from minidp.comm.alltoall import naive_alltoall, pairwise_alltoall
from minidp.comm.args import flat, pick, result, same_memory, writable
from minidp.comm.auto import choose_shared
from minidp.comm.barrier import dissemination_barrier
from minidp.comm.builtin import (
    mpi_allgather,
    mpi_allreduce,
    mpi_alltoall,
    mpi_barrier,
    mpi_reduce_scatter,
)
from minidp.comm.group import Group, world
from minidp.comm.naive import naive_allgather, naive_allreduce, naive_reduce_scatter
from minidp.comm.recursive import (
    doubling_allgather_chunks,
    halving_reduce_scatter_chunks,
    rabenseifner_allreduce,
    recursive_doubling_allreduce,
)
from minidp.comm.reduce_ops import check_op, finish
from minidp.comm.ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from minidp.comm.shm import in_shared_memory, shm_allreduce, shm_allreduce_many
from minidp.comm.tree import tree_allreduce
from minidp.tools.chunks import chunk_bounds
from minidp.tools.names import table

# The tables of functions; names.table() checks each against the one list in minidp/tools/names.py.
ALLREDUCE = table(
    "allreduce",
    {
        "ring": ring_allreduce,
        "recursive_doubling": recursive_doubling_allreduce,
        "rabenseifner": rabenseifner_allreduce,
        "tree": tree_allreduce,
        "naive": naive_allreduce,
        "shm": shm_allreduce,
        "mpi": mpi_allreduce,
    },
)
REDUCE_SCATTER = table(
    "reduce_scatter",
    {
        "ring": functools.partial(ring_reduce_scatter, full=False),
        "recursive_halving": halving_reduce_scatter_chunks,
        "naive": naive_reduce_scatter,
        "mpi": mpi_reduce_scatter,
    },
)
ALLGATHER = table(
    "allgather",
    {
        "ring": ring_allgather,
        "recursive_doubling": doubling_allgather_chunks,
        "naive": naive_allgather,
        "mpi": mpi_allgather,
    },
)
ALLTOALL = table(
    "alltoall", {"pairwise": pairwise_alltoall, "naive": naive_alltoall, "mpi": mpi_alltoall}
)
BARRIER = table("barrier", {"dissemination": dissemination_barrier, "mpi": mpi_barrier})

FAST: dict = {}
"""The fast path's table (fast_path.py and fast_collectives.py fill it): name -> a function
taking the public call's arguments that returns the result, or None where the plain path
below must run."""


def _reduction(x, op: str, algo: str, group, table: dict, name: str):
    """The checks every reduction starts with: (group, flat view of x, algorithm to run)."""
    group = group or world()
    src = flat(x)
    check_op(op, x.dtype)
    return group, src, pick(algo, table, name, x.nbytes, group.size)


def allreduce(
    x: np.ndarray,
    op: str = "sum",
    algo: str = "auto",
    group: Group | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The op over every rank's x, on every rank. `out=x` reduces in place."""
    group = group or world()
    fast = FAST.get("allreduce")
    if fast is not None:
        res = fast(x, op, algo, group, out)
        if res is not None:
            return res
    if algo == "auto" and in_shared_memory(x, group):  # made by shared_zeros: read in place
        algo = choose_shared(x.nbytes, group.size)  # shm, or the ring below auto.SHM_MIN
    group, src, algo = _reduction(x, op, algo, group, ALLREDUCE, "allreduce")
    res = result(out, x.shape, x.dtype)
    dst = res if res.ndim == 1 else res.reshape(-1)
    in_place = out is x or same_memory(src, dst)
    with group.collective("allreduce", algo, op, x.dtype, None, x.shape):
        if group.size == 1:
            if not in_place:
                np.copyto(dst, src)
        else:
            ALLREDUCE[algo](group, dst if in_place else src, dst, op)
        finish(op, dst, group.size)
    return res


def allreduce_coalesced(
    xs: list[np.ndarray], op: str = "sum", algo: str = "auto", group: Group | None = None
) -> None:
    """Reduce every array of xs in place, with the bits of `allreduce(x, out=x)` for each.

    With "shm" (or "auto" when every x lies in shared memory, as DDP's buckets do, for those
    of at least auto.SHM_MIN bytes; the smaller ones go first, one by one) it is one
    collective: one agreement, one barrier after the reductions and one after the copies,
    for all of them, instead of three synchronizations per array (torch.distributed's
    all_reduce_coalesced, Horovod's tensor fusion, without packing: the arrays stay where
    they are). Any other algorithm reduces them one by one. The arrays must not overlap.
    The default checks fingerprint the call as an allreduce whose shape lists the arrays'
    sizes, so it does not pass for a single allreduce of their total."""
    group = group or world()
    if not xs:
        return
    if algo == "auto" and all(in_shared_memory(x, group) for x in xs):
        small = [x for x in xs if choose_shared(x.nbytes, group.size) != "shm"]
        for x in small:  # below auto.SHM_MIN: the ring (the same bits), one by one
            allreduce(x, op=op, algo="auto", group=group, out=x)
        xs, algo = [x for x in xs if not any(x is y for y in small)], "shm"
    if algo != "shm" or group.size == 1 or len(xs) <= 1:
        for x in xs:
            allreduce(x, op=op, algo=algo, group=group, out=x)
        return
    arrays = [flat(x) for x in xs]
    for x in xs:
        check_op(op, x.dtype)
    sizes = tuple(a.size for a in arrays)
    with group.collective("allreduce", "shm", op, xs[0].dtype, None, sizes):
        shm_allreduce_many(group, arrays, op)
        for a in arrays:
            finish(op, a, group.size)


def reduce_scatter(
    x: np.ndarray,
    op: str = "sum",
    algo: str = "auto",
    group: Group | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """This rank's chunk (chunk_bounds(x.size, p)) of the op over every rank's x, as 1-D."""
    group = group or world()
    fast = FAST.get("reduce_scatter")
    if fast is not None:
        res = fast(x, op, algo, group, out)
        if res is not None:
            return res
    group, src, algo = _reduction(x, op, algo, group, REDUCE_SCATTER, "reduce_scatter")
    bounds = chunk_bounds(src.size, group.size)
    lo, hi = bounds[group.rank], bounds[group.rank + 1]
    res = result(out, (hi - lo,), x.dtype)
    if np.may_share_memory(src, res):  # the algorithms read all of x until the end
        raise ValueError("reduce_scatter: out must not overlap x")
    with group.collective("reduce_scatter", algo, op, x.dtype, None, x.shape):
        if group.size == 1:
            np.copyto(res, src)
        else:
            REDUCE_SCATTER[algo](group, src, bounds, op, res)
        finish(op, res, group.size)
    return res


def allgather(
    x: np.ndarray, algo: str = "auto", group: Group | None = None, out: np.ndarray | None = None
) -> np.ndarray:
    """Every rank's x, in rank order: shape (p, *x.shape), or chunks of `out` (see above)."""
    group = group or world()
    fast = FAST.get("allgather")
    if fast is not None:
        res = fast(x, algo, group, out)
        if res is not None:
            return res
    p, r = group.size, group.rank
    src = flat(x)
    if out is None:
        res = np.empty((p, *x.shape), x.dtype)
    else:
        flat(out, "out")
        writable(out)
        if out.dtype != x.dtype:
            raise ValueError(f"out has dtype {out.dtype}, x has {x.dtype}")
        res = out
    buf = res.reshape(-1)
    bounds = chunk_bounds(buf.size, p)
    if bounds[r + 1] - bounds[r] != src.size:
        raise ValueError(
            f"allgather: rank {r}'s chunk of out ({buf.size} elements over {p} "
            f"ranks, chunk_bounds) has {bounds[r + 1] - bounds[r]} elements, "
            f"x has {src.size}"
        )
    mine = buf[bounds[r] : bounds[r + 1]]
    in_place = same_memory(src, mine)  # raises on a partial overlap, before any message
    algo = pick(algo, ALLGATHER, "allgather", buf.nbytes, p)
    with group.collective("allgather", algo, None, x.dtype, None, res.shape):
        if not in_place:
            np.copyto(mine, src)
        if p > 1:
            ALLGATHER[algo](group, buf, bounds)
    return res


def alltoall(
    x: np.ndarray, algo: str = "auto", group: Group | None = None, out: np.ndarray | None = None
) -> np.ndarray:
    """Row j of x goes to rank j; row i of the result came from rank i. x.shape[0] == p."""
    group = group or world()
    flat(x)
    if x.ndim == 0 or x.shape[0] != group.size:
        raise ValueError(
            f"alltoall: x must have shape (p, ...) with p = {group.size}, got {x.shape}"
        )
    algo = pick(algo, ALLTOALL, "alltoall", x.nbytes, group.size)
    res = result(out, x.shape, x.dtype)
    if np.may_share_memory(x, res):
        raise ValueError("alltoall: out must not overlap x")
    rows, out_rows = x.reshape(group.size, -1), res.reshape(group.size, -1)
    with group.collective("alltoall", algo, None, x.dtype, None, x.shape):
        ALLTOALL[algo](group, rows, out_rows)
    return res


def barrier(group: Group | None = None, algo: str = "auto") -> None:
    """Return once every rank of the group has entered the barrier."""
    group = group or world()
    algo = pick(algo, BARRIER, "barrier", 0, group.size)
    with group.collective("barrier", algo):
        if group.size > 1:
            BARRIER[algo](group)
