"""The collectives with a root: broadcast, reduce, gather, scatter.

Same contract as collectives.py (every rank calls, same shape, dtype, op, root and algo;
contiguous arrays treated as flat; `group=None` is `world()`; pass all but x by keyword):

    broadcast(x, root, group, algo)          -> x, filled in place on every rank with the
                                                root's x
    reduce(x, op, root, group, algo, out)    -> the op over all ranks' x on the root (out=x:
                                                in place there); None on the other ranks
    gather(x, root, group, algo, out)        -> on the root, shape (p, *x.shape), row i from
                                                rank i; None elsewhere
    scatter(x, root, group, algo, out)       -> row `rank` of the root's x, shape x.shape[1:].
                                                x has shape (p, ...) on every rank (only the
                                                root's values are read); a non-root rank may
                                                pass x=None when it passes out

Algorithms: "tree" (binomial, tree.py), "naive" (linear, naive.py), "mpi" (MPI's own),
"ring" for broadcast (binomial scatter of p chunks, then a ring allgather: van de Geijn's
long-message broadcast, ~2nβ instead of lg(p)·nβ) and for reduce (ring reduce-scatter, then
the chunks gathered at the root: ~2nβ + nγ instead of lg(p)·n(β + γ)). "auto": auto.py.
"""

import numpy as np

from minidp.comm.args import flat, pick, result, root_in, same_memory
from minidp.comm.builtin import mpi_broadcast, mpi_gather, mpi_reduce, mpi_scatter
from minidp.comm.collectives import FAST
from minidp.comm.group import Group, world
from minidp.comm.naive import linear_broadcast, linear_gather, linear_reduce, linear_scatter
from minidp.comm.reduce_ops import check_op, finish
from minidp.comm.ring import ring_allgather, ring_reduce_scatter
from minidp.comm.tree import (
    binomial_broadcast,
    binomial_gather,
    binomial_reduce,
    binomial_scatter,
    subtree_chunks,
)
from minidp.tools.chunks import chunk_bounds
from minidp.tools.names import table


def _scatter_allgather_broadcast(group, buf: np.ndarray, root: int) -> None:
    bounds = chunk_bounds(buf.size, group.size)  # chunk v belongs to relative rank v
    binomial_scatter(group, buf, bounds, root)
    ring_allgather(group, buf, bounds, shift=root)


def _ring_reduce(group, src: np.ndarray, acc: np.ndarray, root: int, op: str) -> None:
    bounds = chunk_bounds(src.size, group.size)
    r = group.rank
    mine = acc[bounds[r] : bounds[r + 1]]
    ring_reduce_scatter(group, src, bounds, op, mine, full=False)
    linear_gather(group, mine, acc, bounds, root)


def _subtree_rows(group, rows: np.ndarray | None, row: np.ndarray, root: int):
    """(relative rank v, row bounds, offset, buffer for v's subtree of rows)."""
    p, m = group.size, row.size
    v = (group.rank - root) % p
    first, last = subtree_chunks(p, v)
    bounds = tuple(i * m for i in range(p + 1))
    if v == 0 and root == 0:
        return v, bounds, 0, rows  # the root's own rows are already in relative order
    return v, bounds, bounds[first], group.scratch.get("tree.rows", (last - first) * m, row.dtype)


def _tree_gather(group, row: np.ndarray, rows: np.ndarray | None, root: int) -> None:
    """Binomial gather in relative order; the root rotates rows back to rank order."""
    p, m = group.size, row.size
    v, bounds, offset, held = _subtree_rows(group, rows, row, root)
    np.copyto(held[:m], row)
    binomial_gather(group, held, bounds, root, offset=offset)
    if v == 0 and root != 0:  # relative row v is rank (v + root) % p
        np.copyto(rows[root * m :], held[: (p - root) * m])
        np.copyto(rows[: root * m], held[(p - root) * m :])


def _tree_scatter(group, rows: np.ndarray | None, row: np.ndarray, root: int) -> None:
    p, m = group.size, row.size
    v, bounds, offset, held = _subtree_rows(group, rows, row, root)
    if v == 0 and root != 0:  # rotate into relative order: row v is rank (v + root) % p
        np.copyto(held[: (p - root) * m], rows[root * m :])
        np.copyto(held[(p - root) * m :], rows[: root * m])
    binomial_scatter(group, held, bounds, root, offset=offset)
    np.copyto(row, held[:m])


# The tables of functions; names.table() checks each against the one list in minidp/tools/names.py.
BROADCAST = table(
    "broadcast",
    {
        "tree": binomial_broadcast,
        "ring": _scatter_allgather_broadcast,
        "naive": linear_broadcast,
        "mpi": mpi_broadcast,
    },
)
REDUCE = table(
    "reduce",
    {"tree": binomial_reduce, "ring": _ring_reduce, "naive": linear_reduce, "mpi": mpi_reduce},
)
GATHER = table(
    "gather",
    {
        "tree": _tree_gather,
        "naive": lambda g, row, rows, root: linear_gather(
            g, row, rows, [i * row.size for i in range(g.size + 1)], root
        ),
        "mpi": mpi_gather,
    },
)
SCATTER = table(
    "scatter",
    {
        "tree": _tree_scatter,
        "naive": lambda g, rows, row, root: linear_scatter(
            g, rows, [i * row.size for i in range(g.size + 1)], row, root
        ),
        "mpi": mpi_scatter,
    },
)


def broadcast(
    x: np.ndarray, root: int = 0, group: Group | None = None, algo: str = "auto"
) -> np.ndarray:
    """Fill x on every rank with the root's x; returns x."""
    group = group or world()
    fast = FAST.get("broadcast")
    if fast is not None:
        res = fast(x, root, group, algo)
        if res is not None:
            return res
    buf = flat(x)
    root = root_in(root, group.size)
    if not x.flags.writeable:
        raise ValueError("broadcast: x is read-only")
    algo = pick(algo, BROADCAST, "broadcast", x.nbytes, group.size)
    with group.collective("broadcast", algo, None, x.dtype, root, x.shape):
        if group.size > 1:
            BROADCAST[algo](group, buf, root)
    return x


def reduce(
    x: np.ndarray,
    op: str = "sum",
    root: int = 0,
    group: Group | None = None,
    algo: str = "auto",
    out: np.ndarray | None = None,
) -> np.ndarray | None:
    """The op over every rank's x, on the root only (None elsewhere); out=x: in place."""
    group = group or world()
    src = flat(x)
    check_op(op, x.dtype)
    root = root_in(root, group.size)
    algo = pick(algo, REDUCE, "reduce", x.nbytes, group.size)
    is_root = group.rank == root
    res = result(out, x.shape, x.dtype) if is_root else None
    if is_root:
        acc = res.reshape(-1)
        src = acc if same_memory(src, acc) else src
    elif algo == "mpi":
        acc = None
    else:
        acc = group.scratch.get("reduce.acc", src.size, src.dtype)
    with group.collective("reduce", algo, op, x.dtype, root, x.shape):
        if group.size == 1:
            if src is not acc:
                np.copyto(acc, src)
        else:
            REDUCE[algo](group, src, acc, root, op)
        if is_root:
            finish(op, acc, group.size)
    return res


def gather(
    x: np.ndarray,
    root: int = 0,
    group: Group | None = None,
    algo: str = "auto",
    out: np.ndarray | None = None,
) -> np.ndarray | None:
    """Every rank's x, stacked on the root: shape (p, *x.shape); None elsewhere."""
    group = group or world()
    row = flat(x)
    root = root_in(root, group.size)
    algo = pick(algo, GATHER, "gather", x.nbytes * group.size, group.size)
    res = result(out, (group.size, *x.shape), x.dtype) if group.rank == root else None
    if res is not None and np.may_share_memory(res, x):
        raise ValueError("gather: out must not overlap x")
    with group.collective("gather", algo, None, x.dtype, root, x.shape):
        GATHER[algo](group, row, None if res is None else res.reshape(-1), root)
    return res


def scatter(
    x: np.ndarray | None,
    root: int = 0,
    group: Group | None = None,
    algo: str = "auto",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Row `rank` of the root's x (shape (p, ...)); x may be None off the root if out is given."""
    group = group or world()
    p = group.size
    root = root_in(root, p)
    if x is None and (group.rank == root or out is None):
        raise ValueError("scatter: x is required on the root, and elsewhere unless out is given")
    if x is not None:
        flat(x)
        if x.ndim == 0 or x.shape[0] != p:
            raise ValueError(f"scatter: x must have shape (p, ...) with p = {p}, got {x.shape}")
        shape, dtype = x.shape[1:], x.dtype
    else:
        flat(out, "out")  # out alone gives the dtype here: one collectives carry (no objects)
        shape, dtype = out.shape, out.dtype
    res = result(out, shape, dtype)
    if x is not None and np.may_share_memory(res, x):
        raise ValueError("scatter: out must not overlap x")
    rows = x.reshape(-1) if group.rank == root else None
    algo = pick(algo, SCATTER, "scatter", res.nbytes * p, p)
    with group.collective("scatter", algo, None, dtype, root, (p, *shape)):
        SCATTER[algo](group, rows, res.reshape(-1), root)
    return res
