"""The fast path of small collectives: the plain algorithms' steps, with less Python per call.

    mpiexec -n 2 python -m minidp bench collectives --ops allreduce --algos auto,ring --paths
    MINIDP_FAST_COMM=0 mpiexec -n 2 python -m minidp ...       # the plain path everywhere

At 4 KiB a collective's time is Python's own work, not the wire: the local checks, the pick
of an algorithm, the chunk arithmetic, the scratch lookups, a request object and a list per
message (`bench percall` times each part; docs/collectives.md has the table).
MPICH pays for none of it: its plan is C. This module keeps the algorithms (the step tables
of ring.py and recursive.py, message for message, operand for operand, so the bits are the
plain path's, tests/test_comm_fast_path.py) and does the per-call work once, as two tricks,
each switchable in `TRICKS`, for allreduce here and, with the same pieces (`Plan`,
`lookup`, `usable`, `register`), for reduce_scatter, allgather and broadcast in
fast_collectives.py:

    plans        a call's decisions (the algorithm auto picks, the op and dtype checks, the
                 chunk bounds) made once per (group, size, dtype, op, algorithm) and kept in
                 `group.plans`; a call looks its plan up and runs it
    persistent   the steps as persistent requests (MPI_Send_init, MPI_Recv_init, started
                 with MPI_Startall; persistent.py), made once: bound to the caller's own
                 x and out where a call passes `out` (keyed by their addresses: no copy),
                 else, up to STAGE_MAX bytes, staged on the plan's buffers (the call
                 copies x in and the result out)

The plain functions (collectives.py, rooted.py) ask `FAST[name]` first (a table filled by
`register`, as engine/registry.py's is by minidp/fast/); a fast path returns None where it
does not apply (a size above FAST_MAX, where Python's share of a call is small; a deadline
polled by the data's waits; a patient group; an emulated network; a group of one; an
argument the plain path must judge), and the plain path runs. Those settings are read on
every call (a group's `timeout`, `checks`, `patient` and `wire` may change between calls),
and a call looks up, makes and frees plans holding the group's lock, so a second thread on
the same group meets the plain path's RuntimeError and never frees requests the first is
waiting on.
The plain path is always one switch away:
`MINIDP_FAST_COMM=0` (read at import), or `with fast_path.plain():` for a block.
Counters, the fingerprints, the watchdog's `waiting_on` and the size check of every message
received are kept as the plain path keeps them.
"""

import contextlib
import os

import numpy as np
from mpi4py import MPI

from minidp.comm import collectives
from minidp.comm.args import flat, pick, result, same_memory
from minidp.comm.auto import choose_shared
from minidp.comm.persistent import allreduce_steps
from minidp.comm.reduce_ops import check_op, finish
from minidp.comm.shm_memory import in_shared_memory, pool

TRICKS = {"persistent": True}  # "plans": the table itself (plain() empties it)
STAGE_MAX = 16 * 1024  # bytes: persistent requests on staged buffers up to here
BOUND_MAX = 4  # per plan: (x, out) address pairs with persistent requests of their own
FAST_MAX = 512 * 1024  # bytes: above it every call takes the plain path
MAX_PLANS = 64  # per group: more distinct calls than this, and the plans start over
NOT_FAST = object()  # a plan's entry where the plain path runs
PLAIN = dict(collectives.ALLREDUCE)  # the algorithms the staged steps copy


class Plan:
    """One kind of call, decided once. Where the persistent trick applies, `build(*views)`
    lays its steps on views of `sizes` elements of dtype: the plan's own buffers (staged,
    made by the plan) or the caller's arrays, bound by their addresses (at most BOUND_MAX
    sets per plan). `running` is the call's enter/exit (group.py), made once per shape
    by `enter_exit`."""

    def __init__(self, build, sizes: tuple, dtype: np.dtype, held=()) -> None:
        self.build, self.sizes, self.dtype = build, sizes, dtype
        self.staged = self.running = None
        self.bound: dict = {}
        self.held = list(held)  # the buffers this plan owns (scratch, staged copies)

    @property
    def nbytes(self) -> int:
        """Bytes of the plan's own buffers: counted as the group's (Group.buffer_bytes)."""
        return sum(a.nbytes for a in self.held)

    def enter_exit(self, group, name: str, op, root, shape: tuple):
        """The call's enter/exit (group.py), made once per shape: the lock (held already),
        the counters and the plain path's fingerprint (name, algo, op, dtype, root, shape)."""
        running = self.running
        if running is None or running.shape != shape:
            call = (name, self.algo, op, self.dtype, root, shape)
            running = self.running = group.collective(*call, locked=True)
        return running

    def bind(self, key: tuple):
        """The steps on the arrays at the addresses of key, one per view. The requests hold
        the raw addresses, not the arrays (MPI.buffer.fromaddress), so nothing the caller
        frees is kept alive; they are started only when a call passes arrays at these very
        addresses, of this very size."""
        if len(self.bound) >= BOUND_MAX:
            self.free_bound()
        size = self.dtype.itemsize
        views = [
            np.frombuffer(MPI.buffer.fromaddress(address, n * size), self.dtype)
            for address, n in zip(key, self.sizes)
        ]
        steps = self.bound[key] = self.build(*views)
        return steps

    def free_bound(self) -> None:
        for steps in self.bound.values():
            steps.free()
        self.bound.clear()

    def free(self) -> None:
        if self.staged is not None:
            self.staged.free()
        self.free_bound()


class AllreducePlan(Plan):
    """What one kind of allreduce call needs, decided once: the algorithm and, where the
    persistent trick applies, its steps: staged on the plan's own buffer (up to STAGE_MAX
    bytes, for a call without `out`, in place), bound to the caller's x and out."""

    def __init__(self, group, n: int, dtype: np.dtype, op: str, algo: str) -> None:
        self.algo, self.op, self.group = algo, op, group
        self.run = collectives.ALLREDUCE[algo]
        found = allreduce_steps(algo, n, group.size)
        build, held = None, []
        if TRICKS["persistent"] and n > 0 and found is not None:
            steps_on, spare = found
            recv = np.empty(spare, dtype)
            build, held = lambda src, dst: steps_on(group, src, dst, recv, op), [recv]  # noqa: E731
        super().__init__(build, (n, n), dtype, held)
        if build is not None and n * dtype.itemsize <= STAGE_MAX:
            self.work = np.empty(n, dtype)
            self.held.append(self.work)
            self.staged = build(self.work, self.work)


def lookup(group, key: tuple, make):
    """group.plans[key], made by make() the first time (NOT_FAST: the plain path)."""
    plans = group.plans
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= MAX_PLANS:
            free_plans(group)
        plan = plans[key] = make()
    return plan


def free_plans(group) -> None:
    """Forget the group's plans, releasing their persistent requests (under its lock)."""
    for plan in group.plans.values():
        if plan is not NOT_FAST:
            plan.free()
    group.plans.clear()


def run_bound(steps, group, *arrays) -> None:
    """Run steps bound to the caller's arrays. Should they fail, messages may still be in
    flight into or out of those arrays: the group keeps the arrays alive for MPI, as p2p
    keeps its requests in group.abandoned."""
    try:
        steps.run(group)
    except BaseException:
        group.abandoned += arrays
        raise


def usable(group) -> bool:
    """Whether a call on group may take the fast path: data on MPI's blocking waits (no
    deadline to poll, not patient), the communicator itself as the wire, more than one rank."""
    return (
        group.size > 1
        and not group.broken  # the plain path says why (a freed or failed group)
        and not group.patient
        and group.wire is group.comm
        and (group.checks or group.timeout is None)
    )


def allreduce(x, op: str, algo: str, group, out):
    """collectives.allreduce through a plan, or None for the plain path."""
    if type(x) is not np.ndarray or not x.flags.c_contiguous or not usable(group):
        return None  # usable() on every call: a group's settings may change between calls
    if algo == "auto" and pool(group) and in_shared_memory(x, group):
        algo = choose_shared(x.nbytes, group.size)  # in shared memory: shm or the ring
        if algo == "shm":
            return None  # the plain path reduces it by loads
    lock = group._lock  # held from the plan's lookup to the call's end (the exit releases it)
    if not lock.acquire(False):
        return None  # another thread is inside a collective on this group: the plain path raises
    try:
        plan = _plan_for(group, x, op, algo)
        if plan is NOT_FAST or collectives.ALLREDUCE[plan.algo] is not PLAIN[plan.algo]:
            lock.release()
            return None  # no plan, or the table's algorithm replaced (a test's): the plain path
        res = result(out, x.shape, x.dtype)  # the plain path's checks of out
        src = x if x.ndim == 1 else x.reshape(-1)
        dst = res if res.ndim == 1 else res.reshape(-1)
        where = None if out is None else (MPI.buffer(src).address, MPI.buffer(dst).address)
        if out is x or (out is not None and _same_memory(where, x.nbytes, src, dst)):
            src, where = dst, (where[1], where[1])  # in place, as the plain path passes it
        running = plan.enter_exit(group, "allreduce", op, None, x.shape)
    except BaseException:
        lock.release()
        raise
    with running:
        if plan.build is not None and out is not None:  # bound: on x and out themselves
            run_bound(plan.bound.get(where) or plan.bind(where), group, x, res)
        elif plan.staged is not None:  # staged: x copied in, the result out
            np.copyto(plan.work, src)
            plan.staged.run(group)
            np.copyto(dst, plan.work)
        else:
            plan.run(group, src, dst, op)
        if op == "avg":
            finish(op, dst, group.size)
    return res


def _same_memory(where: tuple, nbytes: int, src, dst) -> bool:
    """args.same_memory(src, dst) for two contiguous arrays of nbytes at addresses `where`,
    from the addresses: True if the same memory; a partial overlap goes to same_memory,
    which raises its error."""
    a, b = where
    if a == b:
        return True
    return a < b + nbytes and b < a + nbytes and same_memory(src, dst)


def _plan_for(group, x, op: str, algo: str):
    """The group's plan for this call, made and kept the first time (NOT_FAST, not kept,
    above FAST_MAX). Called with the group's lock held: making one may free the others."""
    key = ("allreduce", x.size, x.dtype, op, algo, TRICKS["persistent"])
    plan = group.plans.get(key)
    if plan is None:
        if x.nbytes > FAST_MAX:
            return NOT_FAST
        plan = lookup(group, key, lambda: _allreduce_plan(x, op, algo, group))
    return plan


def _allreduce_plan(x, op: str, algo: str, group):
    flat(x)
    check_op(op, x.dtype)
    algo = pick(algo, collectives.ALLREDUCE, "allreduce", x.nbytes, group.size)
    if algo in ("shm", "mpi"):
        return NOT_FAST
    return AllreducePlan(group, x.size, x.dtype, op, algo)


def enabled_from_env() -> bool:
    """MINIDP_FAST_COMM: on unless it is 0, false, no or off."""
    value = os.environ.get("MINIDP_FAST_COMM", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


PATHS: dict = {}  # name -> the fast path of collectives.FAST[name], when switched on


def register(paths: dict) -> None:
    """Add fast paths to PATHS, and to collectives.FAST unless MINIDP_FAST_COMM is off."""
    PATHS.update(paths)
    if enabled_from_env():
        collectives.FAST.update(paths)


@contextlib.contextmanager
def plain():
    """Inside this block every collective of this process takes the plain path."""
    saved = dict(collectives.FAST)
    collectives.FAST.clear()
    try:
        yield
    finally:
        collectives.FAST.clear()
        collectives.FAST.update(saved)


register({"allreduce": allreduce})
