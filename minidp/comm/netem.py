"""Network emulation: make this machine's shared memory behave like a slower network.

Ranks on one machine exchange messages through shared memory at several GB/s in a few
microseconds; a cluster's network is slower, and slow networks are where the algorithms and
the schemes differ. Three environment variables slow minidp's messages down:

    MINIDP_NET_LATENCY_US=50      α: microseconds added to every message
    MINIDP_NET_GBITS=1            the bandwidth cap: β = 8 / (GBITS·1e9) seconds per byte
    MINIDP_NET_STRAGGLER=1:5,3:2  world rank 1 is 5 ms late to every collective, rank 3 2 ms

    MINIDP_NET_GBITS=1 mpiexec -n 4 python -m minidp bench netem

The model: every message of n bytes this rank sends waits α + n·β on the sender before MPI
gets it, so it reaches its receiver no earlier than send_start + α + n·β; MPI's own transfer
(α₀ + n·β₀, what `bench calibrate` measures) comes on top, so the emulated network costs
α + α₀ per message and β + β₀ per byte. A rank's sends wait one after another (a rank has
one link, as the α-β model of Thakur et al. assumes): a tree root sending to two children
pays 2(α + n·β). A straggler's delay is paid before the first message it sends in each
collective call (outside collectives, before each message): a rank that computes slowly
reaches every collective late, and the ranks that wait on its messages wait with it.

What it is not: there is no contention (two ranks sending to one receiver do not share its
link), no full-duplex limit (a rank sends and receives at once, as in a sendrecv), no
topology (every pair is one hop), no jitter, no loss. The wait is a sleep that releases the
GIL, so computation beside it (DDP's overlap) goes on, as it would beside a real transfer;
sleep wakes late (`sleep_overshoot`), so a wait sleeps that much less and spins the rest.
(Spinning the whole wait instead, as MPI's blocking calls do, was slower with more ranks
than cores: a spinning rank takes the core the rank it waits for needs; docs/collectives.md.)
On a machine with fewer cores than ranks, a rank that sleeps may wait for a time slice
before it runs again: the emulated network is then slower than asked; `bench netem` shows
by how much. A wait lies inside its collective's data exchange, so it counts toward the
watchdog's deadline (MINIDP_TIMEOUT, watchdog.py) as a slow transfer would.

Where: only `Isend` and `Sendrecv`, the calls comm/p2p.py sends data with, through
`group.wire`, a `Link` when emulation is on and the communicator itself when it is off, so
the off path runs exactly the code it ran before (the group decides once, when it is made).
Not emulated: MPI's own collectives (algo="mpi": what MPI sends inside is not visible from
here), algo="shm" (it loads the other ranks' memory and sends nothing; DDP's "auto" arena
stands aside when emulation is on), and the fingerprints of MINIDP_CHECKS.
"""

import math
import os
import time
import weakref
from dataclasses import dataclass, field
from functools import cache

VARIABLES = ("MINIDP_NET_LATENCY_US", "MINIDP_NET_GBITS", "MINIDP_NET_STRAGGLER")


@dataclass(frozen=True)
class Network:
    """An emulated network: α seconds per message, β seconds per byte, stragglers' delays."""

    latency_s: float = 0.0  # α
    seconds_per_byte: float = 0.0  # β
    straggler_s: dict[int, float] = field(default_factory=dict)  # world rank -> seconds

    def message_delay(self, nbytes: int) -> float:
        """α + n·β: how long a message of n bytes waits on its sender."""
        return self.latency_s + nbytes * self.seconds_per_byte

    def describe(self) -> str:
        parts = [f"α {self.latency_s * 1e6:g} us"]
        if self.seconds_per_byte:
            parts.append(f"{8 / self.seconds_per_byte / 1e9:g} Gb/s")
        parts += [f"rank {r} +{s * 1e3:g} ms" for r, s in sorted(self.straggler_s.items())]
        return "emulated network: " + ", ".join(parts)


def _number(name: str, raw: str, rule: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf or (name == "MINIDP_NET_GBITS" and value == 0):
        raise ValueError(f"{name}={raw!r}: {rule}")
    return value


def from_env(environ=os.environ) -> Network | None:
    """The Network the variables ask for, or None when none is set (emulation off).
    A bad value is a ValueError of one line naming the variable."""
    latency, gbits, straggler = (environ.get(name, "").strip() for name in VARIABLES)
    if not (latency or gbits or straggler):
        return None
    latency_s = _number(VARIABLES[0], latency, "give microseconds >= 0") * 1e-6 if latency else 0
    per_byte = 0.0
    if gbits:
        per_byte = 8 / (_number(VARIABLES[1], gbits, "give gigabits per second > 0") * 1e9)
    delays = {}
    for item in filter(None, (s.strip() for s in straggler.split(","))):
        rank, _, ms = item.partition(":")
        rule = "give RANK:MS pairs, e.g. 1:5 or 1:5,3:2 (ranks >= 0, milliseconds >= 0)"
        try:
            delays[int(rank)] = _number(VARIABLES[2], ms, rule) * 1e-3
        except ValueError:
            raise ValueError(f"{VARIABLES[2]}={straggler!r}: {rule}") from None
        if int(rank) < 0:
            raise ValueError(f"{VARIABLES[2]}={straggler!r}: {rule}")
    return Network(latency_s, per_byte, delays)


@cache
def network() -> Network | None:
    """This process's emulated network (read from the environment once), or None."""
    return from_env()


@cache
def sleep_overshoot() -> float:
    """How late time.sleep wakes here (the median of 15 naps of 100 us, measured once per
    process): a wait sleeps that much less, then spins to its end."""
    late = []
    for _ in range(15):
        start = time.perf_counter()
        time.sleep(100e-6)
        late.append(time.perf_counter() - start - 100e-6)
    return max(sorted(late)[7], 0.0)


def wait(seconds: float) -> None:
    """Return `seconds` from now: sleep (the GIL and the core are free) all but the
    sleep's overshoot, then spin on the clock to the end (at most the overshoot)."""
    end = time.perf_counter() + seconds
    time.sleep(max(seconds - sleep_overshoot(), 0.0))
    while time.perf_counter() < end:
        pass


class Link:
    """A communicator whose data sends pay the emulated network first (see the module doc).
    Everything else (receives, probes, splits) is the communicator's own."""

    def __init__(self, comm, group, net: Network, pause=wait) -> None:
        self.comm, self.network, self.pause = comm, net, pause
        self._group = weakref.ref(group)  # the group holds this link: no cycle
        self.late_s = net.straggler_s.get(group.world_ranks[group.rank], 0.0)
        self._late_for = -1  # the collective call (group._seq) this rank was last late to

    def __getattr__(self, name: str):
        return getattr(self.comm, name)

    def delay(self, nbytes: int) -> float:
        """The wait before sending nbytes now: α + n·β, plus the straggler's delay if this
        is its first message of the collective call (or a message outside any)."""
        seconds = self.network.message_delay(nbytes)
        if self.late_s:
            group = self._group()
            if group.current is group._outside or group._seq != self._late_for:
                self._late_for = group._seq
                seconds += self.late_s
        return seconds

    def Isend(self, buf, dest: int, tag: int):
        self.pause(self.delay(buf[0].nbytes))
        return self.comm.Isend(buf, dest, tag)

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag, status=None):
        self.pause(self.delay(sendbuf[0].nbytes))
        return self.comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)


def wire(comm, group):
    """What a group sends data through: `comm` itself when emulation is off, else a Link."""
    net = network()
    return comm if net is None else Link(comm, group, net)
