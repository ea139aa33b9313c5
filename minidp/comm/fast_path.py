"""The fast path of small collectives: the plain algorithms' steps, with less Python per call.

    mpiexec -n 2 python -m minidp bench collectives --ops allreduce --algos auto,ring --paths
    MINIDP_FAST_COMM=0 mpiexec -n 2 python -m minidp ...       # the plain path everywhere

At 4 KiB a collective's time is Python's own work, not the wire: the local checks, the pick
of an algorithm, the chunk arithmetic, the scratch lookups, a request object and a list per
message (`bench collectives --profile` times each part; docs/collectives.md has the table).
MPICH pays for none of it: its plan is C. This module keeps the algorithms (the step tables
of ring.py and recursive.py, message for message, operand for operand, so the bits are the
plain path's, tests/test_comm_fast_path.py) and does the per-call work once, as two tricks,
each switchable in `TRICKS`:

    plans        a call's decisions (the algorithm auto picks, the op and dtype checks, the
                 chunk bounds) made once per (group, size, dtype, op, algorithm) and kept in
                 `group.plans`; a call looks its plan up and runs it
    persistent   at most STAGE_MAX bytes: the steps as persistent requests (MPI_Send_init,
                 MPI_Recv_init, started with MPI_Startall) on the plan's own buffers, made
                 once: a call copies x in, starts and waits each step, copies the result out

The plain functions (collectives.py) ask `FAST[name]` first (a table filled here, as
engine/registry.py's is by minidp/fast/); a plan returns None where it does not apply (a
size above FAST_MAX, where Python's share of a call is small; a deadline polled by the
data's waits; a patient group; an emulated network; a group of one; an argument the plain
path must judge), and the plain path runs. The plain path is always one switch away:
`MINIDP_FAST_COMM=0` (read at import), or `with fast_path.plain():` for a block.
Counters, the fingerprints, the watchdog's `waiting_on` and the size check of every message
received are kept as the plain path keeps them.
"""

import contextlib
import os

import numpy as np
from mpi4py import MPI

from minidp.comm import collectives
from minidp.comm.args import flat, pick
from minidp.comm.errors import MessageSizeMismatch
from minidp.comm.p2p import BYTE, DATA_TAG
from minidp.comm.reduce_ops import _UFUNC, check_op, finish
from minidp.comm.shm_memory import in_shared_memory, pool
from minidp.tools.chunks import chunk_bounds

TRICKS = {"persistent": True}  # "plans": the table itself (plain() empties it)
STAGE_MAX = 16 * 1024  # bytes: persistent requests on staged buffers up to here
FAST_MAX = 512 * 1024  # bytes: above it every call takes the plain path
MAX_PLANS = 64  # per group: more distinct calls than this, and the plans start over
NOT_FAST = object()  # a plan's entry where the plain path runs
PLAIN = dict(collectives.ALLREDUCE)  # the algorithms the staged steps copy


class Steps:
    """A staged schedule: `work` holds the vector; each step starts a receive and a send on
    persistent requests and waits, then maybe combines `a ⊕ b` into `out` (views of the
    plan's buffers, fixed when the plan is made)."""

    def __init__(self, group, n: int, dtype: np.dtype, spare: int) -> None:
        self.comm, self.work = group.comm, np.empty(n, dtype)
        self.recv = np.empty(max(spare, 1), dtype)
        self.steps: list[tuple] = []
        self.statuses = [MPI.Status(), MPI.Status()]
        self.sent = self.received = 0

    def add(self, send: np.ndarray, dest: int, got: np.ndarray, source: int, combine=None):
        """One step: send `send` to dest while receiving `got` from source; then combine,
        (ufunc, a, b, out), if given."""
        comm = self.comm
        requests = [
            comm.Recv_init([got, BYTE], source, DATA_TAG),
            comm.Send_init([send, BYTE], dest, DATA_TAG),
        ]
        self.steps.append((requests, got.nbytes, source, combine))
        self.sent += send.nbytes
        self.received += got.nbytes

    def run(self, group) -> None:
        """Every step, in order: the messages of the plain algorithm, counted as p2p counts."""
        counts, statuses = group.current, self.statuses
        counts[1] += self.sent
        counts[2] += self.received
        counts[3] += len(self.steps)
        for requests, nbytes, source, combine in self.steps:
            group.waiting_on = source  # for the watchdog (watchdog.py)
            MPI.Prequest.Startall(requests)
            try:
                MPI.Request.Waitall(requests, statuses)
            except MPI.Exception as error:
                raise MessageSizeMismatch(group.size_message(source, nbytes, None)) from error
            if statuses[0].Get_count(BYTE) != nbytes:
                got = statuses[0].Get_count(BYTE)
                raise MessageSizeMismatch(group.size_message(source, nbytes, got))
            if combine is not None:
                ufunc, a, b, out = combine
                ufunc(a, b, out=out)

    def free(self) -> None:
        for requests, *_ in self.steps:
            for request in requests:
                request.Free()
        self.steps = []


def ring_allreduce_steps(group, n: int, dtype: np.dtype, op: str) -> Steps:
    """ring.py's ring_allreduce on the plan's buffers: reduce-scatter, then allgather."""
    p, r, ufunc = group.size, group.rank, _UFUNC[op]
    b = chunk_bounds(n, p)
    plan = Steps(group, n, dtype, b[1] - b[0])
    work, recv = plan.work, plan.recv
    s = (r - 1) % p
    sending = work[b[s] : b[s + 1]]
    for k in range(p - 1):
        t = (r - k - 2) % p
        target = work[b[t] : b[t + 1]]
        received = recv[: b[t + 1] - b[t]]
        plan.add(sending, group.right, received, group.left, (ufunc, received, target, target))
        sending = target
    for k in range(p - 1):
        s, t = (r - k) % p, (r - k - 1) % p
        plan.add(work[b[s] : b[s + 1]], group.right, work[b[t] : b[t + 1]], group.left)
    return plan


def doubling_allreduce_steps(group, n: int, dtype: np.dtype, op: str) -> Steps | None:
    """recursive.py's recursive doubling, for a group whose size is a power of two (no fold:
    else None, and the plain path runs)."""
    p, r, ufunc = group.size, group.rank, _UFUNC[op]
    if p & (p - 1):
        return None
    plan = Steps(group, n, dtype, n)
    work, recv = plan.work, plan.recv[:n]
    mask = 1
    while mask < p:
        low, high = (work, recv) if r & mask == 0 else (recv, work)
        plan.add(work, r ^ mask, recv, r ^ mask, (ufunc, low, high, work))
        mask *= 2
    return plan


STAGED = {"ring": ring_allreduce_steps, "recursive_doubling": doubling_allreduce_steps}


class AllreducePlan:
    """What one kind of allreduce call needs, decided once: the algorithm and, where the
    persistent trick applies, its staged steps."""

    def __init__(self, group, n: int, dtype: np.dtype, op: str, algo: str) -> None:
        self.algo, self.op = algo, op
        self.run = collectives.ALLREDUCE[algo]
        self.steps = None
        if TRICKS["persistent"] and n * dtype.itemsize <= STAGE_MAX and algo in STAGED:
            self.steps = STAGED[algo](group, n, dtype, op)

    def free(self) -> None:
        if self.steps is not None:
            self.steps.free()


def _plan(group, key: tuple, make):
    """group.plans[key], made by make() the first time (NOT_FAST: the plain path)."""
    plans = group.plans
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= MAX_PLANS:
            free_plans(group)
        plan = plans[key] = make()
    return plan


def free_plans(group) -> None:
    """Forget the group's plans, releasing their persistent requests (between calls)."""
    for plan in group.plans.values():
        if plan is not NOT_FAST:
            plan.free()
    group.plans.clear()


def _usable(group) -> bool:
    """Whether a call on group may take the fast path: data on MPI's blocking waits (no
    deadline to poll, not patient), the communicator itself as the wire, more than one rank."""
    return (
        group.size > 1
        and not group.patient
        and group.wire is group.comm
        and (group.checks or group.timeout is None)
    )


def allreduce(x, op: str, algo: str, group, out):
    """collectives.allreduce through a plan, or None for the plain path."""
    if type(x) is not np.ndarray or not x.flags.c_contiguous:
        return None
    if algo == "auto" and pool(group) and in_shared_memory(x, group):
        return None  # shared memory: the plain path picks shm or, below its threshold, ring
    dtype = x.dtype
    plan = group.plans.get(("allreduce", x.size, dtype, op, algo, TRICKS["persistent"]))
    if plan is None:
        plan = _new_plan(group, x, op, algo)
    if plan is NOT_FAST or collectives.ALLREDUCE[plan.algo] is not PLAIN[plan.algo]:
        return None  # no plan, or the table's algorithm replaced (a test's): the plain path
    if out is x:
        res = x
    elif out is None:
        res = np.empty(x.shape, dtype)
    elif type(out) is np.ndarray and out.shape == x.shape and out.dtype == dtype:
        flags = out.flags
        if not (flags.c_contiguous and flags.writeable):
            return None  # the plain path raises
        if (x.base is not None or out.base is not None) and np.may_share_memory(x, out):
            return None  # in place through another view, or a partial overlap: plain path
        res = out
    else:
        return None
    src = x if x.ndim == 1 else x.reshape(-1)
    dst = res if res.ndim == 1 else res.reshape(-1)
    steps = plan.steps
    with group.collective("allreduce", plan.algo, op, dtype, None, x.shape):
        if steps is None:
            plan.run(group, src, dst, op)
        else:
            np.copyto(steps.work, src)
            steps.run(group)
            np.copyto(dst, steps.work)
        if op == "avg":
            finish(op, dst, group.size)
    return res


def _new_plan(group, x, op: str, algo: str):
    """The plan for this call, made and kept (NOT_FAST, not kept, where none applies)."""
    if not _usable(group) or x.nbytes > FAST_MAX:
        return NOT_FAST
    key = ("allreduce", x.size, x.dtype, op, algo, TRICKS["persistent"])
    return _plan(group, key, lambda: _allreduce_plan(x, op, algo, group))


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


PATHS = {"allreduce": allreduce}


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


if enabled_from_env():
    collectives.FAST.update(PATHS)
