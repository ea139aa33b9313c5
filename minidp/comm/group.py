"""Group: the ranks that run a collective together, and what minidp keeps about them.

A Group wraps one MPI communicator and adds what the algorithms need:

    rank, size          this process's place in the group, and the group's size
    wire                what p2p.py sends data through: the communicator, or a netem.Link
                        when MINIDP_NET_* asks for an emulated network (netem.py)
    left, right         ring neighbours: (rank - 1) % size and (rank + 1) % size
    world_ranks         world rank of each group rank (for error messages and logs)
    scratch             reusable work buffers (buffers.py), owned by this group alone
    plans               the fast path's plans, one per kind of call (fast_path.py)
    shared              its shm.SharedMemory, made when shm is first used: whether its
                        ranks share a machine, the pool of their shared arrays, a scratch
    counters            {collective: {"calls", "bytes_sent", "bytes_recv", "messages_sent"}}
    seconds             wall time this rank spent inside the group's collectives, in total
    checks, timeout     cross-rank fingerprints and the wait deadline (checks.py); the
                        deadline follows `checks` unless `timeout` was set explicitly
    exchanging_since,   when the running collective's data exchange began (perf_counter;
    waiting_on          None outside one) and the peer its blocking wait is on, for the
                        watchdog (watchdog.py) that holds the deadline there

Groups are made from other groups, and every rank of the parent must take part:

    world()                      every process (a duplicate of MPI.COMM_WORLD, so minidp's
                                 messages never meet the application's own); cached
    group.split(color, key)      one group per color, ordered by key (None: not a member)
    group.subgroup([0, 2, 4])    the listed ranks, in that order (None on the others)
    group.dup()                  the same ranks on a fresh communicator, fresh counters and
                                 scratch: give one to each thread that runs collectives
    group.members([0, 2])        the listed ranks, made by them alone (the others may be
                                 dead: the parameter server's live ranks after a drop)

Threads: a group runs one collective at a time. Two threads calling collectives on the same
group would interleave their messages, so the second raises RuntimeError at once; give each
thread its own `dup()` (MPI is initialized with MPI_THREAD_MULTIPLE by mpi4py).
"""

import functools
import threading
import time

from mpi4py import MPI

from minidp.comm.buffers import Scratch
from minidp.comm.checks import (
    Fingerprints,
    checks_from_env,
    ranges,
    timeout_from_env,
)
from minidp.comm.errors import CollectiveError
from minidp.comm.netem import wire
from minidp.comm.watchdog import watch

_FROM_ENV = object()


class Group:
    """An MPI communicator plus scratch buffers, counters and checks. See the module doc."""

    def __init__(
        self,
        comm: MPI.Comm,
        *,
        checks: bool | None = None,
        timeout: float | None | object = _FROM_ENV,
    ) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.left, self.right = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        self.world_ranks = tuple(
            comm.Get_group().Translate_ranks(list(range(self.size)), MPI.COMM_WORLD.Get_group())
        )
        self.wire = wire(comm, self)  # comm itself unless the network is emulated (netem.py)
        self.checks = checks_from_env() if checks is None else checks
        self._timeout = timeout  # _FROM_ENV: follow self.checks (the timeout property)
        self._timeout_for = (timeout_from_env(False), timeout_from_env(True))  # [checks]
        self.scratch = Scratch()
        self.plans: dict = {}  # the fast path's plans for this group's calls (fast_path.py)
        self.deadline: float | None = None  # set while a collective runs with a timeout
        self.broken: str | None = None  # why this group refuses further collectives
        self.abandoned: list = []  # requests left by a failed call, kept alive for MPI
        # receives posted by the running collective: id(request) -> (request, bytes posted),
        # for p2p.waitall's size check and for cancelling after an error
        self.receiving: dict[int, tuple[MPI.Request, int]] = {}
        self.statuses = [MPI.Status(), MPI.Status()]  # reused by p2p.py; grows in waitall
        self.patient = False  # wait by napping, not spinning (p2p.py); dup() starts impatient
        self._counts: dict[str, list[int]] = {}
        self.seconds = 0.0  # inside collectives, checks included (_Running adds to it)
        self._outside = [0, 0, 0, 0]  # messages sent outside any collective ("p2p")
        self.current = self._outside  # [calls, bytes_sent, bytes_recv, messages_sent]
        self._seq = 0
        self._doing = ("", "", "")  # (collective, algo, phase) for error messages
        self._lock = threading.Lock()
        self._fingerprints: Fingerprints | None = None  # made at the first checked call
        self.shared = None  # shm.SharedMemory: segments every rank reads, made on first use
        self.exchanging_since: float | None = None  # the watchdog's clock (watchdog.py)
        self.waiting_on: int | list | None = None  # the peer(s) of the blocking wait
        watch(self)

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, size={self.size}, world_ranks={self.world_ranks})"

    @property
    def timeout(self) -> float | None:
        """Seconds one collective call may wait (None: forever). Set it to fix it; otherwise
        it follows `checks`: MINIDP_TIMEOUT if set, else 300 s with checks, none without."""
        if self._timeout is _FROM_ENV:
            return self._timeout_for[bool(self.checks)]
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self._timeout = seconds

    # -- making groups -------------------------------------------------------------------------
    def _wrap(self, comm: MPI.Comm) -> "Group | None":
        if comm == MPI.COMM_NULL:
            return None
        return Group(comm, checks=self.checks, timeout=self._timeout)

    def split(self, color: int | None, key: int | None = None) -> "Group | None":
        """Ranks passing the same color form one group, ordered by key (default: rank)."""
        if color is not None and color < 0:
            raise ValueError(f"color must be >= 0 or None, got {color}")
        color = MPI.UNDEFINED if color is None else color
        return self._wrap(self.comm.Split(color, self.rank if key is None else key))

    def subgroup(self, ranks: list[int]) -> "Group | None":
        """The listed ranks (of this group) as a new group, rank i being ranks[i]."""
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.size for r in ranks):
            raise ValueError(f"ranks must be distinct and in [0, {self.size}), got {ranks}")
        member = self.rank in ranks
        return self.split(0 if member else None, ranks.index(self.rank) if member else 0)

    def members(self, ranks: list[int]) -> "Group":
        """The listed ranks (of this group) as a new group, made by those ranks alone
        (MPI_Comm_create_group): the others take no part, so a rank that is dead or stopped
        cannot hold it up. Every listed rank must call it with the same list."""
        ranks = [int(r) for r in ranks]
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not one of the members {ranks}")
        return self._wrap(self.comm.Create_group(self.comm.Get_group().Incl(ranks)))

    def dup(self) -> "Group":
        """Same ranks, own communicator, scratch and counters (e.g. for a comm thread)."""
        return self._wrap(self.comm.Dup())

    def free(self) -> None:
        """Release the communicator (collective over the group); the group is unusable after."""
        if self._fingerprints is not None and not self.broken:
            self._fingerprints.free()
        if not self.broken:  # a broken group's requests may still be active
            for plan in self.plans.values():
                getattr(plan, "free", lambda: None)()
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self.comm.Free()
        self.broken = "freed"
        self.scratch.clear()

    def buffer_bytes(self) -> int:
        """Bytes of the work buffers this group holds for its collectives: the plain path's
        scratch and the fast path's plans (their scratch and staged copies; fast_path.py)."""
        plans = sum(getattr(plan, "nbytes", 0) for plan in self.plans.values())
        return self.scratch.nbytes + plans

    # -- counters ------------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, dict[str, int]]:
        """A snapshot: {name: {"calls", "bytes_sent", "bytes_recv", "messages_sent"}}.

        Per collective, on this rank: what its point-to-point messages carried. Two extra
        names: "checks" holds the fingerprints (MINIDP_CHECKS), "p2p" the messages sent
        with minidp.comm.p2p outside any collective. MPI's own collectives (algo="mpi")
        count calls only: what MPI sends inside them is not visible from here.
        """
        counts = dict(self._counts)
        if any(self._outside):
            counts["p2p"] = self._outside
        return {
            name: {"calls": c[0], "bytes_sent": c[1], "bytes_recv": c[2], "messages_sent": c[3]}
            for name, c in counts.items()
        }

    def reset_counters(self) -> None:
        self._counts.clear()
        self._outside[:] = [0, 0, 0, 0]

    def traffic(self, sent: int, received: int, messages: int) -> None:
        """Add one message's bytes to the collective in progress (called by p2p.py)."""
        counts = self.current
        counts[1] += sent
        counts[2] += received
        counts[3] += messages

    # -- running one collective ----------------------------------------------------------------
    def collective(
        self,
        name: str,
        algo: str,
        op: str | None = None,
        dtype=None,
        root: int | None = None,
        shape: tuple = (),
        locked: bool = False,
    ) -> "_Running":
        """`with group.collective(...):` wraps the messages of one collective call. locked:
        the caller takes the group's lock itself before entering (the fast path, which
        holds it from its plan's lookup on: fast_path.py); the exit releases it all the same."""
        return _Running(self, name, algo, op, dtype, root, shape, locked)

    # -- error messages ------------------------------------------------------------------------
    def _where(self) -> str:
        """'rank 0 of 5 (world 0): allgather #3 (algo=ring)', or '...: a point-to-point message'."""
        me = f"rank {self.rank} of {self.size} (world {self.world_ranks[self.rank]}): "
        if self.current is self._outside:
            return me + "a point-to-point message"
        name, algo, _ = self._doing
        return me + f"{name} #{self._seq} (algo={algo})"

    def timeout_message(self, missing: list[int]) -> str:
        world = ", ".join(str(self.world_ranks[r]) for r in missing)
        return (
            f"{self._where()} heard nothing from rank(s) {ranges(missing)} (world {world}) "
            f"within {self.timeout:g} s, during the {self._doing[2]}; this group is unusable now"
        )

    def size_message(self, peer: int | None, posted: int | None, got: int | None) -> str:
        """A receive from peer posted for `posted` bytes got `got` (None: more, truncated)."""
        source = "a peer" if peer is None else f"rank {peer} (world {self.world_ranks[peer]})"
        if got is None:
            expected = "than expected" if posted is None else f"than the {posted} expected"
            arrived = f"more bytes {expected} from {source} (MPI truncated the message)"
        else:
            arrived = f"{got} bytes from {source}, {posted} expected"
        if self.current is self._outside:  # a p2p call outside any collective breaks nothing
            return f"{self._where()} got {arrived}"
        return (
            f"{self._where()} got {arrived}, during the {self._doing[2]}. The ranks passed "
            "different shapes, dtypes or arguments; this group is unusable now"
        )


class _Running:
    """Context of one collective call: lock, sequence number, deadline, checks, counters."""

    __slots__ = ("group", "name", "algo", "op", "dtype", "root", "shape", "locked", "start")

    def __init__(self, group: Group, name, algo, op, dtype, root, shape, locked) -> None:
        self.group, self.name, self.algo = group, name, algo
        self.op, self.dtype, self.root, self.shape = op, dtype, root, shape
        self.locked = locked  # the caller holds the group's lock already

    def __enter__(self) -> Group:
        g, name = self.group, self.name
        if g.broken:
            if self.locked:
                g._lock.release()
            raise CollectiveError(f"{name} on a broken group (rank {g.rank}): {g.broken}")
        if not self.locked and not g._lock.acquire(False):
            raise RuntimeError(
                f"{name}: this group is already running a collective on "
                "another thread; give each thread its own group.dup()"
            )
        self.start = now = time.perf_counter()  # under the lock: a _Running may be reused
        try:
            g._seq += 1
            timeout = g.timeout
            if timeout is not None:
                g.deadline = time.monotonic() + timeout
            if g.checks and g.size > 1:
                g._doing = (name, self.algo, "fingerprint exchange")
                g.current = g._counts.setdefault("checks", [0, 0, 0, 0])
                g.current[0] += 1
                if g._fingerprints is None:
                    g._fingerprints = Fingerprints(g)
                call = (name, self.algo, self.op, self.dtype, self.root, self.shape)
                g._fingerprints.exchange(g, g._seq, call)
                # Every rank is now inside this very call, with the same arguments: the data
                # exchange cannot wait on a rank that is not coming, so it needs no deadline
                # and runs on MPI's blocking calls (the fast path of p2p.py).
                g.deadline = None
                now = time.perf_counter()
            g._doing = (name, self.algo, "data exchange")
            g.exchanging_since = now  # past timeout: the watchdog aborts
            counts = g._counts.get(name)
            if counts is None:
                counts = g._counts[name] = [0, 0, 0, 0]
            g.current = counts
            counts[0] += 1
        except BaseException as error:
            self.__exit__(type(error), error, None)
            raise
        return g

    def __exit__(self, kind, error, traceback) -> None:
        g = self.group
        if error is not None:  # messages of this call may still be in flight: never reuse
            g.broken = f"{type(error).__name__}: {error}"
            for request, _ in g.receiving.values():
                if request != MPI.REQUEST_NULL:
                    request.Cancel()  # best effort: a message already matched still lands
                    g.abandoned.append(request)  # MPI may still write its buffer
        g.deadline = g.exchanging_since = None
        g.current = g._outside
        g.seconds += time.perf_counter() - self.start
        if g.receiving:
            g.receiving.clear()
        g._lock.release()


@functools.cache
def world() -> Group:
    """The group of every process. The first call is collective (it duplicates COMM_WORLD)."""
    return Group(MPI.COMM_WORLD.Dup())
