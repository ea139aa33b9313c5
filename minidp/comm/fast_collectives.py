"""The fast path of reduce_scatter, allgather and broadcast: fast_path.py's tricks for three more.

    mpiexec -n 2 python -m minidp bench collectives --ops reduce_scatter,allgather,broadcast \
        --algos auto,ring --sizes 4K,64K --paths

Read fast_path.py first: the same plans (one per kind of call, in `group.plans`), the same
persistent requests (the plain algorithms' steps, laid out by persistent.py message for
message and operand for operand, so the bits and the counters are the plain path's:
tests/test_comm_fast_more.py), the same rules (`usable` on every call, nothing above
FAST_MAX, the group's lock held from the plan's lookup to the call's end, the plain
path's fingerprint, `fast_path.plain()` and MINIDP_FAST_COMM=0 to switch it off). What
each call's steps are laid on:

    reduce_scatter   ring; recursive halving      out given: bound to x and out;
                     (p a power of two)           else staged (x in, the chunk out)
    allgather        ring; recursive doubling     out given: bound to out (x copied into
                     (p a power of two)           its chunk, unless it is that chunk);
                                                  out=None: staged (the rows copied out)
    broadcast        tree (what auto picks up     bound to x once a call repeats x's address
                     to FAST_MAX)                 (or above STAGE_MAX); else staged

Staged steps exist up to STAGE_MAX bytes; a call with neither (or with the persistent
trick off) runs the plain algorithm's function through its plan (the checks and the pick
saved). Everywhere else the call returns None and the plain path runs (and raises its own
errors): the other algorithms (naive, mpi, the ring broadcast, the butterflies' fold where
p is not a power of two; one set lookup decides most), an argument the plain path must
judge (a root that is not an int of the group, an `out` of another kind, arrays that
overlap), a table entry a test replaced.
"""

from functools import partial

import numpy as np
from mpi4py import MPI

from minidp.comm import collectives, rooted
from minidp.comm.args import flat, pick, result
from minidp.comm.fast_path import (
    FAST_MAX,
    NOT_FAST,
    STAGE_MAX,
    TRICKS,
    Plan,
    lookup,
    register,
    run_bound,
    usable,
)
from minidp.comm.persistent import (
    doubling_allgather_steps,
    halving_reduce_scatter_steps,
    ring_allgather_steps,
    ring_reduce_scatter_steps,
    tree_broadcast_steps,
)
from minidp.comm.reduce_ops import check_op, finish
from minidp.tools.chunks import chunk_bounds

TABLES = {
    "reduce_scatter": collectives.REDUCE_SCATTER,
    "allgather": collectives.ALLGATHER,
    "broadcast": rooted.BROADCAST,
}
PLAIN = {name: dict(table) for name, table in TABLES.items()}  # what the steps copy
STEPS = {  # the algorithms with steps here (auto picks one of them up to FAST_MAX)
    "reduce_scatter": frozenset({"auto", "ring", "recursive_halving"}),
    "allgather": frozenset({"auto", "ring", "recursive_doubling"}),
    "broadcast": frozenset({"auto", "tree"}),
}
_REDUCE_SCATTER, _ALLGATHER, _BROADCAST = (STEPS[name] for name in TABLES)


class MovePlan(Plan):
    """One kind of reduce_scatter, allgather or broadcast call: its algorithm, the plain
    function `run` (for calls without steps), chunk bounds (this rank's [lo, hi)), and
    where the persistent trick applies, staged steps on `work` (one buffer per view)."""

    def __init__(self, name, algo: str, bounds, rank: int, build, sizes, dtype, held=()) -> None:
        super().__init__(build, sizes, dtype, held)
        self.algo, self.table, self.run = algo, TABLES[name], PLAIN[name][algo]
        self.bounds = bounds  # None for a broadcast, which moves the whole of x
        self.lo, self.hi = (bounds[rank], bounds[rank + 1]) if bounds else (0, 0)
        self.last = None  # broadcast: the address of the previous call's x
        if build is not None and max(sizes) * dtype.itemsize <= STAGE_MAX:
            self.work = [np.empty(n, dtype) for n in sizes]
            self.held += self.work
            self.staged = build(*self.work)


def _planned(group, key: tuple, nbytes: int, make, *args):
    """The group's plan for key (made by make(*args) the first time), with the group's lock
    held (the running call's exit releases it); None, the lock released, where the plain
    path must run."""
    lock = group._lock
    if not lock.acquire(False):
        return None  # another thread is inside a collective on this group: the plain path raises
    try:
        plan = group.plans.get(key)
        if plan is None:
            plan = NOT_FAST if nbytes > FAST_MAX else lookup(group, key, lambda: make(*args))
        if plan is not NOT_FAST and plan.table[plan.algo] is plan.run:
            return plan
    except BaseException:
        lock.release()
        raise
    lock.release()  # no plan, or a table's algorithm replaced (a test's): the plain path
    return None


def _address(x: np.ndarray) -> int:
    return MPI.buffer(x).address


def _overlap(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    """Whether the bytes [a, a + a_bytes) and [b, b + b_bytes) meet."""
    return a < b + b_bytes and b < a + a_bytes and a_bytes > 0 and b_bytes > 0


def _power_of_two(p: int) -> bool:
    return p & (p - 1) == 0


# ---- reduce_scatter --------------------------------------------------------------------------
def reduce_scatter(x, op: str, algo: str, group, out):
    """collectives.reduce_scatter through a plan, or None for the plain path."""
    if algo not in _REDUCE_SCATTER or type(x) is not np.ndarray:
        return None
    if not x.flags.c_contiguous or not usable(group):
        return None
    where = None
    if out is not None:
        if type(out) is not np.ndarray or not out.flags.c_contiguous:
            return None  # the plain path judges out
        where = (_address(x), _address(out))
        if _overlap(where[0], x.nbytes, where[1], out.nbytes):
            return None  # the plain path raises its error
    key = ("reduce_scatter", x.size, x.dtype, op, algo, TRICKS["persistent"])
    plan = _planned(group, key, x.nbytes, _reduce_scatter_plan, x, op, algo, group)
    if plan is None:
        return None
    try:
        res = result(out, (plan.hi - plan.lo,), x.dtype)  # the plain path's checks of out
        running = plan.enter_exit(group, "reduce_scatter", op, None, x.shape)
    except BaseException:
        group._lock.release()
        raise
    src = x if x.ndim == 1 else x.reshape(-1)
    with running:
        if plan.build is not None and out is not None:  # bound: on x and out themselves
            run_bound(plan.bound.get(where) or plan.bind(where), group, x, out)
        elif plan.staged is not None:  # staged: x copied in, the chunk out
            np.copyto(plan.work[0], src)
            plan.staged.run(group)
            np.copyto(res, plan.work[1])
        else:
            plan.run(group, src, plan.bounds, op, res)
        if op == "avg":
            finish(op, res, group.size)
    return res


def _reduce_scatter_plan(x, op: str, algo: str, group):
    flat(x)
    check_op(op, x.dtype)
    p, n, dtype = group.size, x.size, x.dtype
    algo = pick(algo, collectives.REDUCE_SCATTER, "reduce_scatter", x.nbytes, p)
    if algo not in _REDUCE_SCATTER or algo == "recursive_halving" and not _power_of_two(p):
        return NOT_FAST  # no steps here (auto retuned), or the fold: the plain path
    bounds = chunk_bounds(n, p)
    sizes, build, scratch = (n, bounds[group.rank + 1] - bounds[group.rank]), None, {}
    persistent = TRICKS["persistent"] and n > 0  # else: the plan runs the plain algorithm
    if persistent and algo == "ring":
        scratch = {"recv": np.empty(bounds[1], dtype), "partial": np.empty(bounds[1], dtype)}
        build = partial(ring_reduce_scatter_steps, group, op=op, **scratch)
    elif persistent:  # recursive halving
        scratch = {"recv": np.empty(n, dtype), "acc": np.empty(n, dtype)}
        build = partial(halving_reduce_scatter_steps, group, op=op, **scratch)
    held = scratch.values()
    return MovePlan("reduce_scatter", algo, bounds, group.rank, build, sizes, dtype, held)


# ---- allgather -------------------------------------------------------------------------------
def allgather(x, algo: str, group, out):
    """collectives.allgather through a plan, or None for the plain path."""
    if algo not in _ALLGATHER or type(x) is not np.ndarray:
        return None
    if not x.flags.c_contiguous or not usable(group):
        return None
    if out is None:
        n_out = x.size * group.size
    elif (
        type(out) is np.ndarray
        and out.flags.c_contiguous
        and out.flags.writeable
        and out.dtype == x.dtype
    ):
        n_out = out.size
    else:
        return None  # the plain path judges out
    key = ("allgather", x.size, n_out, x.dtype, algo, TRICKS["persistent"])
    nbytes = n_out * x.dtype.itemsize
    plan = _planned(group, key, nbytes, _allgather_plan, x, n_out, algo, group)
    if plan is None:
        return None
    try:
        res, where, in_place = out, None, False
        if out is None:
            res = np.empty((group.size, *x.shape), x.dtype)
        else:
            where = (_address(out),)
            mine, at = where[0] + plan.lo * x.dtype.itemsize, _address(x)
            in_place = at == mine
            if not in_place and _overlap(at, x.nbytes, where[0], out.nbytes):
                group._lock.release()
                return None  # the plain path judges the overlap
        running = plan.enter_exit(group, "allgather", None, None, res.shape)
    except BaseException:
        group._lock.release()
        raise
    src = x if x.ndim == 1 else x.reshape(-1)
    buf = res if res.ndim == 1 else res.reshape(-1)
    with running:
        if plan.build is not None and where is not None:  # bound: on out itself
            steps = plan.bound.get(where) or plan.bind(where)
            if not in_place:
                np.copyto(buf[plan.lo : plan.hi], src)
            run_bound(steps, group, out)
        elif plan.staged is not None:  # staged: x copied into its chunk, the rows out
            work = plan.work[0]
            np.copyto(work[plan.lo : plan.hi], src)
            plan.staged.run(group)
            np.copyto(buf, work)
        else:
            if not in_place:
                np.copyto(buf[plan.lo : plan.hi], src)
            plan.run(group, buf, plan.bounds)
    return res


def _allgather_plan(x, n_out: int, algo: str, group):
    flat(x)
    p, dtype = group.size, x.dtype
    bounds = chunk_bounds(n_out, p)
    if bounds[group.rank + 1] - bounds[group.rank] != x.size:
        return NOT_FAST  # the plain path raises its error
    algo = pick(algo, collectives.ALLGATHER, "allgather", n_out * dtype.itemsize, p)
    if algo not in _ALLGATHER or algo == "recursive_doubling" and not _power_of_two(p):
        return NOT_FAST  # no steps here (auto retuned), or the fold: the plain path
    build, persistent = None, TRICKS["persistent"] and n_out > 0  # else: the plain algorithm
    if persistent and algo == "ring":
        build = partial(ring_allgather_steps, group)
    elif persistent:  # recursive doubling
        build = partial(doubling_allgather_steps, group)
    return MovePlan("allgather", algo, bounds, group.rank, build, (n_out,), dtype)


# ---- broadcast -------------------------------------------------------------------------------
def broadcast(x, root: int, group, algo: str):
    """rooted.broadcast through a plan, or None for the plain path."""
    if algo not in _BROADCAST or type(x) is not np.ndarray or type(root) is not int:
        return None
    flags = x.flags
    if not (flags.c_contiguous and flags.writeable and 0 <= root < group.size and usable(group)):
        return None
    key = ("broadcast", x.size, x.dtype, root, algo, TRICKS["persistent"])
    plan = _planned(group, key, x.nbytes, _broadcast_plan, x, root, algo, group)
    if plan is None:
        return None
    running = plan.enter_exit(group, "broadcast", None, root, x.shape)
    buf = x if x.ndim == 1 else x.reshape(-1)
    with running:
        steps = None
        if plan.build is not None:
            where = (_address(x),)
            steps = plan.bound.get(where)
            if steps is None and (plan.staged is None or plan.last == where):
                steps = plan.bind(where)  # x's address seen twice in a row: bound from now on
            plan.last = where
        if steps is not None:
            run_bound(steps, group, x)
        elif plan.staged is not None:  # staged: the root copies x in, the others the result out
            if group.rank == root:
                np.copyto(plan.work[0], buf)
            plan.staged.run(group)
            if group.rank != root:
                np.copyto(buf, plan.work[0])
        else:
            plan.run(group, buf, root)
    return x


def _broadcast_plan(x, root: int, algo: str, group):
    flat(x)
    algo = pick(algo, rooted.BROADCAST, "broadcast", x.nbytes, group.size)
    if algo != "tree":
        return NOT_FAST  # auto's pick above FAST_MAX on more than 2 ranks: the ring
    build = None  # persistent off, or nothing to send: the plan runs the plain algorithm
    if TRICKS["persistent"] and x.size > 0:
        build = partial(tree_broadcast_steps, group, root=root)
    return MovePlan("broadcast", algo, None, group.rank, build, (x.size,), x.dtype)


register({"reduce_scatter": reduce_scatter, "allgather": allgather, "broadcast": broadcast})
