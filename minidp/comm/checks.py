"""Cross-rank checks: ranks that disagree raise a clear error instead of hanging or corrupting.

Every rank of a group must call the same collectives in the same order with matching
arguments. When one does not, MPI alone gives you a hang (a message never sent), a
truncation error, or, worst, a silently wrong answer. Three guards, all on by default:

1. The fingerprint (`group.checks`; from `MINIDP_CHECKS`, on unless it is 0/false/no/off).
   Each collective begins by exchanging a fingerprint of 16 int64s:

       seq | collective | algo | op | dtype | root | size | ndim | dims[0..7]

   `seq` counts this rank's collectives on the group; collective, algo and op are indices
   into minidp/names.py's lists. The exchange is done by hand, every rank sending its
   fingerprint to every other rank (p - 1 tiny Isend/Irecv pairs on their own tag, so they
   never match a data message), because that lets each rank see for itself who sent what and
   who never arrived: cost (p - 1)α, a few microseconds for the group sizes minidp runs. Then
   every rank holds the same table, so either all ranks go on or all raise
   `CollectiveMismatch`, with one line per distinct call naming its ranks.

2. The deadline (`group.timeout` seconds). Unless set on the group (`Group(timeout=...)` or
   `group.timeout = ...`; None: no deadline), it follows `group.checks`: `MINIDP_TIMEOUT`
   seconds if that is set, checks on or off (0/off/none: no deadline), else 300 s while
   checks are on and none while they are off. The environment is read when the group is
   made. One deadline covers a whole collective call: it is fixed when the call starts
   (group.py), and every wait of the call (p2p.waitall, MPI's own non-blocking collectives
   in builtin.py) compares the clock with it every 64 polls. A rank still waiting past it
   raises `CollectiveTimeout` naming the peers of the requests it still waits for. A rank
   that never entered the collective cannot raise; every rank that did, does. Without a
   deadline a wait can last forever (it is MPI's own blocking call: p2p.py's fast path).

3. The size of every message (p2p.py, always on): a receive that gets fewer bytes than it
   posted, or more (MPI's truncation error), raises `MessageSizeMismatch`, a
   `CollectiveMismatch`, on the rank that received it.

After any of these errors, or any other raised inside a collective, the group is marked broken
on that rank (messages of the failed call may still be in flight) and refuses further
collectives: make a new group from a healthy one.
"""

import os
import zlib

import numpy as np

from minidp.comm.errors import CollectiveMismatch
from minidp.comm.p2p import CHECK_TAG, irecv, isend, waitall
from minidp.names import ALGORITHMS, COLLECTIVES
from minidp.names import OPS as OP_NAMES

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
    none without."""
    value = os.environ.get("MINIDP_TIMEOUT", "").strip().lower()
    if value in ("0", "off", "none"):
        return None
    if value:
        return float(value)
    return DEFAULT_TIMEOUT_S if checks else None


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


def exchange_fingerprints(group, mine: np.ndarray) -> None:
    """Every rank sends its fingerprint to every other; all raise if any two differ."""
    p, me = group.size, group.rank
    table = group.scratch.get("fingerprints", p * FIELDS, np.int64).reshape(p, FIELDS)
    table[me] = mine
    others = [r for r in range(p) if r != me]
    requests = [irecv(group, table[r], r, CHECK_TAG) for r in others]
    requests += [isend(group, table[me], r, CHECK_TAG) for r in others]
    waitall(group, requests, others + others)
    if (table != table[me]).any():
        raise CollectiveMismatch(
            f"rank {me} of {p}: ranks called different collectives or passed different "
            f"arguments:\n{mismatch_report(table)}"
        )
