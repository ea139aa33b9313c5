"""Shared memory on one machine, where it comes from: windows every rank of a group maps.

MPI-3 can map a piece of memory into the address spaces of all the ranks of a group on one
machine (MPI_Win_allocate_shared): a **segment** here, one window with every rank's part
seen by every rank (`Segment.per_rank[q]`, rank q's bytes). shm.py reduces by loading from
them; this module makes, pools and finds them.

    shared_zeros(n, dtype, group)   (shm.py) an array of zeros in a segment (DDP's arena,
                                    parallel/data_parallel/shm_arena.py)
    in_shared_memory(x, group)      whether x lies in one of the group's segments
    peer_arrays(x, group)           every rank's array at x's place (tutorial 04 does the
                                    allreduce by hand with it)
    release_shared(x, group)        hand x's segment back to the pool

Segments are never freed: MPI_Win_free waits for every rank, and a DDP closes on error paths
too, where the other ranks may never come. Instead `release_shared` hands an array back to
the pool of its ranks (every group over the same ranks, dup()s included, shares one), and
the next `shared_zeros` of the same size reuses it (`take_segment`), so a process that
builds many DDPs holds only as many segments as it uses at once.
"""

import os
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from minidp.comm.errors import CollectiveMismatch


@dataclass
class Segment:
    """One window: this rank's address and size, and every rank's bytes (uint8), by rank."""

    address: int
    nbytes: int
    win: MPI.Win
    per_rank: list
    in_use: bool = True


_POOLS: dict[tuple[int, ...], list[Segment]] = {}  # world ranks -> the segments among them


def new_window(group, nbytes: int) -> Segment:
    """A window of nbytes on every rank of group (collective), locked for its whole life."""
    info = MPI.Info.Create()
    info.Set("alloc_shared_noncontig", "true")  # each rank's segment page-aligned
    win = MPI.Win.Allocate_shared(max(nbytes, 1), 1, info, comm=group.comm)
    info.Free()
    win.Lock_all(MPI.MODE_NOCHECK)  # passive target for the whole life: Sync() orders
    per_rank = []
    for q in range(group.size):
        buf, _ = win.Shared_query(q)
        per_rank.append(np.frombuffer(buf, dtype=np.uint8, count=nbytes))
    return Segment(per_rank[group.rank].__array_interface__["data"][0], nbytes, win, per_rank)


def _room() -> int:
    """Bytes free in /dev/shm, where MPI maps shared windows (0 if it cannot tell)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def take_segment(group, nbytes: int, check_room: bool = False) -> Segment | None:
    """A released segment of nbytes from the group's pool, or a new window (collective);
    None if check_room and /dev/shm lacks room on some rank. Every rank agrees first (one
    allgather): the same size, and the same segment to reuse, or CollectiveMismatch."""
    segments = pool(group)
    free = [i for i, s in enumerate(segments) if not s.in_use and s.nbytes == nbytes]
    reuse = free[0] if free else -1
    room = reuse >= 0 or not check_room or _room() >= 2 * group.size * nbytes
    agreed = group.comm.allgather((nbytes, reuse, room))
    if len({a[0] for a in agreed}) != 1:
        sizes = [a[0] for a in agreed]
        raise CollectiveMismatch(
            f"shared memory: the ranks asked for different sizes {sizes} (bytes, by rank)"
        )
    if len({a[1] for a in agreed}) != 1:
        raise CollectiveMismatch(
            "shared memory: the ranks' pools differ (segment to reuse, by rank: "
            f"{[a[1] for a in agreed]}): some rank released an array the others did not"
        )
    if reuse >= 0:
        segments[reuse].in_use = True
        return segments[reuse]
    if not all(a[2] for a in agreed):
        return None
    segments.append(new_window(group, nbytes))
    return segments[-1]


def pool(group) -> list[Segment]:
    """The segments among the group's ranks (local: no message)."""
    return _POOLS.setdefault(group.world_ranks, [])


def find(segments: list[Segment], x) -> tuple[int, int] | None:
    """(segment number, byte offset) of ndarray x inside one of this rank's segments in use."""
    if not isinstance(x, np.ndarray):
        return None
    start = x.__array_interface__["data"][0]
    for i, s in enumerate(segments):
        if s.in_use and s.address <= start and start + x.nbytes <= s.address + s.nbytes:
            return i, start - s.address
    return None


def peers(segment: Segment, offset: int, x: np.ndarray) -> list[np.ndarray]:
    """Every rank's array at x's place (byte offset in the segment), shaped like x."""
    return [b[offset : offset + x.nbytes].view(x.dtype).reshape(x.shape) for b in segment.per_rank]


def release_shared(x: np.ndarray, group) -> None:
    """Hand a shared_zeros array back to its ranks' pool; the next shared_zeros of its size
    reuses the memory (no MPI call: every rank must release the same arrays). x must not
    be used after."""
    where = find(pool(group), x)
    if where is None or where[1] != 0:
        raise ValueError("release_shared: x is not an array shared_zeros made for these ranks")
    pool(group)[where[0]].in_use = False


def in_shared_memory(x, group) -> bool:
    """Whether x lies in an array made by shared_zeros for these ranks (local: no message)."""
    return find(pool(group), x) is not None


def peer_arrays(x: np.ndarray, group) -> list[np.ndarray]:
    """Every rank's array at x's place in shared memory, element q rank q's (x: made by
    shared_zeros, or a contiguous slice of one). Reading another rank's element is a load
    from its memory: order it with a barrier after the writes (shm.py also calls
    MPI_Win_sync around its barriers, as the MPI standard asks)."""
    where = find(pool(group), x)
    if where is None or not x.flags.c_contiguous:
        raise ValueError("peer_arrays: x is not in this group's shared memory (shared_zeros)")
    return peers(pool(group)[where[0]], where[1], x)
