"""Cross-rank checks: ranks that disagree raise a clear error instead of hanging or corrupting.

Every rank of a group must call the same collectives in the same order with matching
arguments. When one does not, MPI alone gives you a hang (a message never sent), a
truncation error, or, worst, a silently wrong answer. Three guards, all on by default:

1. The fingerprint (`group.checks`; from `MINIDP_CHECKS`, on unless it is 0/false/no/off).
   Each collective begins by exchanging a fingerprint of 16 int64s, plus the time the rank
   entered the call (compared separately, see `Fingerprints`):

       seq | collective | algo | op | dtype | root | size | ndim | dims[0..7] | entered

   `seq` counts this rank's collectives on the group; collective, algo and op are indices
   into minidp/tools/names.py's lists. The exchange is done by hand, every rank sending its
   fingerprint to every other rank (p - 1 tiny messages each way on their own tag, so they
   never match a data message), because that lets each rank see for itself who sent what and
   who never arrived: cost (p - 1)α. `Fingerprints` sets the exchange up once per group
   (persistent requests, each distinct call's fingerprint cached), so a call costs one
   `Startall` and one wait (docs/collectives.md). Then every rank holds the same table,
   so either all ranks go on or all raise `CollectiveMismatch`, with one line per distinct
   call naming its ranks.

2. The deadline (`group.timeout` seconds). Unless set on the group (`Group(timeout=...)` or
   `group.timeout = ...`; None: no deadline), it follows `group.checks`: `MINIDP_TIMEOUT`
   seconds if that is set, checks on or off (0/off/none: no deadline), else 300 s while
   checks are on and none while they are off. The environment is read when the group is
   made. The deadline is fixed when a call starts (group.py), and every wait under it
   (p2p.waitall, MPI's own non-blocking collectives in builtin.py) compares the clock with it
   every 64 polls. A rank still waiting past it raises `CollectiveTimeout` naming the peers
   of the requests it still waits for. A rank that never entered the collective cannot
   raise; every rank that did, does: one that arrives after the others gave up learns it
   from their entry times (`Fingerprints`). With checks on, the deadline covers the
   fingerprint exchange, the rendezvous: once every rank has shown the same fingerprint and
   none has given up, all are inside the same call with the same arguments, so the data
   moves on MPI's blocking calls (p2p.py's fast path; polling with a deadline cost the main
   job time: docs/collectives.md), and the watchdog (watchdog.py) holds the deadline there: a
   data exchange still running past it prints one line and aborts the job. With checks
   off and a deadline set, it covers every wait of the call. Without a deadline a wait can
   last forever (MPI's own blocking call).

3. The size of every message (p2p.py, always on): a receive that gets fewer bytes than it
   posted, or more (MPI's truncation error), raises `MessageSizeMismatch`, a
   `CollectiveMismatch`, on the rank that received it.

After any of these errors, or any other raised inside a collective, the group is marked broken
on that rank (messages of the failed call may still be in flight) and refuses further
collectives: make a new group from a healthy one.
"""

import math
import os
import time
import zlib

import numpy as np
from mpi4py import MPI

from minidp.comm.errors import CollectiveMismatch, CollectiveTimeout
from minidp.comm.p2p import BYTE, CHECK_TAG, poll, statuses_for
from minidp.tools.names import ALGORITHMS, COLLECTIVES
from minidp.tools.names import OPS as OP_NAMES

FIELDS = 16
MAX_DIMS = FIELDS - 8
DEFAULT_TIMEOUT_S = 300.0

ALGOS = tuple(dict.fromkeys(a for listed in ALGORITHMS.values() for a in listed))
"""Every algorithm name once; a fingerprint's algo field is an index into it."""
OPS = ("-", *OP_NAMES)  # "-": a collective without an op
_DTYPE_CODES = {zlib.crc32(np.dtype(c).str.encode()): np.dtype(c).name for c in "?bBhHiIlLqQefd"}


def checks_from_env() -> bool:
    """MINIDP_CHECKS: on unless it is 0, false, no or off (case and spaces ignored)."""
    return os.environ.get("MINIDP_CHECKS", "1").strip().lower() not in ("0", "false", "no", "off")


def timeout_from_env(checks: bool) -> float | None:
    """MINIDP_TIMEOUT seconds ('0', 'off', 'none': no deadline); unset: 300 s with checks,
    none without. Anything else (a word, a negative number, nan, inf) is a ValueError."""
    raw = os.environ.get("MINIDP_TIMEOUT", "")
    value = raw.strip().lower()
    if value in ("0", "off", "none"):
        return None
    if not value:
        return DEFAULT_TIMEOUT_S if checks else None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if seconds == 0:  # "0.0" as "0"
        return None
    if not 0 < seconds < math.inf:
        raise ValueError(
            f"MINIDP_TIMEOUT={raw!r}: give the seconds a collective may wait (a number > 0), "
            "or 0, off or none for no deadline"
        )
    return seconds


def fingerprint(
    out: np.ndarray,
    seq: int,
    collective: str,
    algo: str,
    op: str | None,
    dtype: np.dtype | None,
    root: int | None,
    shape: tuple,
) -> np.ndarray:
    """Write this rank's fingerprint of one call into out (FIELDS int64s) and return it."""
    dims = list(shape)[:MAX_DIMS]
    out[:8] = (
        seq,
        COLLECTIVES.index(collective),
        ALGOS.index(algo),
        OPS.index(op or "-"),
        zlib.crc32(dtype.str.encode()) if dtype is not None else -1,
        -1 if root is None else root,
        int(np.prod(shape)),
        len(shape),
    )
    out[8:] = dims + [-1] * (MAX_DIMS - len(dims))
    return out


def describe(row: np.ndarray) -> str:
    """'#7 allreduce(algo=ring, op=sum, dtype=float32, shape=(1000,))' from a fingerprint."""
    seq, coll, algo, op, dtype, root, size, ndim = (int(v) for v in row[:8])
    args = [f"algo={ALGOS[algo]}"]
    if op > 0:
        args.append(f"op={OPS[op]}")
    if dtype != -1:
        args.append(f"dtype={_DTYPE_CODES.get(dtype, f'#{dtype}')}")
    if root >= 0:
        args.append(f"root={root}")
    if ndim > MAX_DIMS:
        args.append(f"size={size}")
    elif coll != COLLECTIVES.index("barrier"):
        args.append(f"shape={tuple(int(d) for d in row[8 : 8 + ndim])}")
    return f"#{seq} {COLLECTIVES[coll]}({', '.join(args)})"


def mismatch_report(table: np.ndarray) -> str:
    """One line per distinct call in the table, naming the ranks that made it."""
    calls: dict[str, list[int]] = {}
    for rank, row in enumerate(table):
        calls.setdefault(describe(row), []).append(rank)
    return "\n".join(
        f"  rank{'s' if len(r) > 1 else ''} {ranges(r)}: {call}" for call, r in calls.items()
    )


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


class Fingerprints:
    """One group's fingerprint exchange, set up once and started again for every call.

    A table of p rows, and *persistent* requests (MPI_Recv_init / MPI_Send_init) from and to
    every peer, so that a call costs one `Startall` and one wait, not 2(p - 1) new requests;
    and each distinct call's fingerprint is built once (everything but `seq` is the same
    every time training repeats a call).

    Each row also carries the wall-clock time its rank entered the call (a last column, not
    compared). It lets the ranks agree on who gave up. A rank that waited past its deadline
    has raised, but its fingerprint was already sent; a rank arriving later still finds every
    fingerprint and would go on into the data exchange alone, and wait there forever. So
    after the exchange every rank looks at the entry times: if the earliest entered more than
    the timeout (less a margin for clocks and polling) before the latest, the earliest have
    given up, and every rank raises CollectiveTimeout too. All ranks that finish the exchange
    hold the same table, so they all decide alike; a rank that really timed out always falls
    inside the margin's verdict."""

    def __init__(self, group):
        p, me = group.size, group.rank
        self.table = np.zeros((p, FIELDS + 1), np.int64)  # + the entry time, in µs
        self.mine = self.table[me]
        others = [r for r in range(p) if r != me]
        recvs = [group.comm.Recv_init([self.table[r], BYTE], r, CHECK_TAG) for r in others]
        sends = [group.comm.Send_init([self.mine, BYTE], r, CHECK_TAG) for r in others]
        self.requests, self.peers = recvs + sends, others + others
        self.nbytes = len(others) * self.mine.nbytes
        width = self.mine.nbytes  # a row's bytes; its first FIELDS words are compared
        self.rows = [slice(r * width, r * width + 8 * FIELDS) for r in range(p)]
        self._calls: dict[tuple, np.ndarray] = {}  # call -> its fingerprint, seq left 0

    def exchange(self, group, seq: int, call: tuple) -> None:
        """Send this call's fingerprint to every peer, receive theirs; raise on a difference,
        or when some rank entered so much earlier than another that it has given up."""
        row = self._calls.get(call)
        if row is None:
            if len(self._calls) > 1024:  # many distinct calls: start over
                self._calls.clear()
            row = self._calls[call] = fingerprint(np.zeros(FIELDS, np.int64), 0, *call)
        mine, table = self.mine, self.table
        mine[:FIELDS] = row
        mine[0] = seq
        mine[FIELDS] = int(time.time() * 1e6)
        group.traffic(self.nbytes, self.nbytes, len(self.peers) // 2)
        MPI.Prequest.Startall(self.requests)
        if group.deadline is None and not group.patient:
            MPI.Request.Waitall(self.requests)
        else:
            poll(group, self.requests, self.peers, statuses_for(group, len(self.requests)))
        alike = group.rank != 0  # every rank reads this table: the group's rank 0 tells
        raw = table.tobytes()  # the rows compared as bytes: cheaper than NumPy's != on a few
        key = raw[self.rows[group.rank]]
        if any(raw[row] != key for row in self.rows):
            raise CollectiveMismatch(
                f"rank {group.rank} of {group.size}: ranks called different collectives or "
                f"passed different arguments:\n{mismatch_report(table[:, :FIELDS])}",
                reported_elsewhere=alike,
            )
        if group.timeout is not None:
            entered = table[:, FIELDS].tolist()
            limit = 1e6 * (group.timeout - min(1.0, 0.1 * group.timeout))
            if max(entered) - min(entered) > limit:
                early = [r for r, t in enumerate(entered) if t < max(entered) - limit]
                spread = (max(entered) - min(entered)) / 1e6
                raise CollectiveTimeout(
                    f"rank {group.rank} of {group.size}: {group._doing[0]} #{seq}: rank(s) "
                    f"{ranges(early)} entered it {spread:.1f} s before the last rank did, past "
                    f"the {group.timeout:g} s deadline, and have given up; so does every rank "
                    "(this group is unusable now)",
                    reported_elsewhere=alike,
                )

    def free(self) -> None:
        """Release the persistent requests (only when none is active: after a healthy call)."""
        for request in self.requests:
            request.Free()
        self.requests = []
