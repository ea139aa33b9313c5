"""Shared memory on one machine: an allreduce with no messages at all (algo="shm").

When every rank of a group runs on one machine, MPI-3 can map a piece of memory into all of
their address spaces (MPI_Win_allocate_shared). A rank then reads another rank's array with
ordinary NumPy loads, and the allreduce is the ring's two halves done by reading:

    reduce-scatter by loads   rank r sums chunk r of every rank's array into its own chunk r
    allgather by loads        rank r copies chunk q out of rank q's array, for every q != r

    rank 0's array  [ c0 | c1 ]      step 1: rank 0 adds rank 1's c0 into its c0,
    rank 1's array  [ c0 | c1 ]              rank 1 adds rank 0's c1 into its c1
                                     step 2: rank 0 copies rank 1's c1, rank 1 rank 0's c0

A message between processes on one machine is itself two copies (the sender's into a shared
cell, the receiver's out of it); here each byte is read once, where it lies. Each chunk is
reduced by one owner, in the ring's order, and then copied, so every rank ends with the same
bits, and with the ring's bits. Three synchronizations order the steps: inputs ready (the
allgather below), chunks reduced, and everyone done reading before anyone writes its array
again (barriers; a fourth for a plain array, once it is copied in). Intra-node collectives
in MPICH, NCCL and DeepSpeed's CPU allreduce use shared memory the same way.

Zero copies need the array itself in shared memory: `shared_zeros(n, dtype, group)` makes
one (collective; DDP's buckets are made this way when they are reduced with "shm" or
"auto"), `in_shared_memory(x, group)` tells whether x lies in one, and
`peer_arrays(x, group)` gives every rank's array at x's place (tutorial 04 does the
allreduce by hand with it). algo="auto" picks "shm" exactly for arrays in shared memory.
Any other array can be reduced with algo="shm" too: it is copied into a shared scratch
segment and back, which costs more than a ring (two extra copies).

Counted as bytes sent: what the other ranks load from this rank's memory, n + (p-2)·c_r for
a chunk c_r of its own, about 2(p-1)/p·n, the ring's (no messages). First every rank tells
the others which segment, offset and size it passed (an allgather of four numbers, which is
also the first barrier); if the ranks disagree (another bucket, a plain array beside a
shared one) every rank raises CollectiveMismatch, having read nothing.

Several arrays at once (`comm.allreduce_coalesced`, DDP's buckets when they all go after
backward): the same three synchronizations serve all of them, each array chunked and
summed as by itself (so with the same bits), and the four numbers are the first array's
segment and offset, the bytes of all of them, and a checksum of every array's place, size
and dtype. The arrays must not overlap (ValueError on every rank). With "auto" the choice
of shm is each rank's own (its array is in shared memory or not): ranks that mix the two
run different algorithms, which the default checks catch (the fingerprint names the
algorithm) and which, with MINIDP_CHECKS=0, hangs like any mismatched call. A group spread
over machines cannot use shm: ValueError on every rank.

Segments are never freed: MPI_Win_free waits for every rank, and a DDP closes on error paths
too, where the other ranks may never come. Instead `release_shared` hands an array back to
the pool of its ranks (every group over the same ranks, dup()s included, shares one), and
the next `shared_zeros` of the same size reuses it, so a process that builds many DDPs
holds only as many segments as it uses at once.
"""

import os
import zlib
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from minidp.chunks import chunk_bounds
from minidp.comm.builtin import mpi_allgather, mpi_barrier
from minidp.comm.errors import CollectiveMismatch
from minidp.comm.ops import combine

_SCRATCH = -1  # the segment number that means: a plain array, copied into the scratch


@dataclass
class Segment:
    """One window: this rank's address and size, and every rank's bytes (uint8), by rank."""

    address: int
    nbytes: int
    win: MPI.Win
    per_rank: list
    in_use: bool = True


_POOLS: dict[tuple[int, ...], list[Segment]] = {}  # world ranks -> the segments among them


def _window(group, nbytes: int) -> Segment:
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


class SharedMemory:
    """One group's shared memory: whether its ranks share a machine, the pool of segments
    of those ranks (shared by every group over them), and a scratch for plain arrays."""

    def __init__(self, group):
        node = group.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local = node.Get_size() == group.size  # the same answer on every rank
        node.Free()
        self.group = group
        self.segments = pool(group)
        self.scratch: Segment | None = None
        self.rows = np.zeros(4 * group.size, np.int64)  # each call's (segment, offset, ...)

    def _require_local(self, what: str) -> None:
        if not self.local:
            raise ValueError(
                f"{what}: the group's {self.group.size} ranks are not all on one machine; "
                "shared memory needs one (use another algo)"
            )

    def zeros(self, count: int, dtype, check_room: bool = False) -> np.ndarray | None:
        """A released segment of the same size, or a new one; None if check_room and
        /dev/shm lacks room on some rank. Every rank agrees first (one allgather)."""
        self._require_local("shared_zeros")
        g, dtype = self.group, np.dtype(dtype)
        nbytes = count * dtype.itemsize
        free = [i for i, s in enumerate(self.segments) if not s.in_use and s.nbytes == nbytes]
        reuse = free[0] if free else -1
        room = reuse >= 0 or not check_room or _room() >= 2 * g.size * nbytes
        agreed = g.comm.allgather((nbytes, reuse, room))
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
            segment = self.segments[reuse]
            segment.in_use = True
        elif not all(a[2] for a in agreed):
            return None
        else:
            segment = _window(g, nbytes)
            self.segments.append(segment)
        mine = segment.per_rank[g.rank].view(dtype)
        mine[...] = 0
        return mine

    def _scratch(self, nbytes: int) -> Segment:
        """The scratch segment, at least nbytes (grown collectively: every rank of a call
        passes the same size, which the call's allgather has just checked)."""
        if self.scratch is None or self.scratch.nbytes < nbytes:
            if self.scratch is not None:  # every rank is in this call: safe to free here
                self.scratch.win.Unlock_all()
                self.scratch.win.Free()
            self.scratch = _window(self.group, nbytes)
        return self.scratch

    def _sync(self, wins: list[MPI.Win], step=None) -> None:
        """Every rank's stores to the windows before step (a barrier by default) are seen
        by every rank's loads after it (MPI_Win_sync on each side)."""
        for win in wins:
            win.Sync()
        step() if step else mpi_barrier(self.group)
        for win in wins:
            win.Sync()

    def _agree(self, arrays: list, places: list, wins: list) -> None:
        """Step 1, who passed what: an allgather of four numbers per rank (segment and byte
        offset of the first array, the bytes of all of them, a checksum of every array's
        place, size and dtype), which is also the barrier after which every input is in
        place. If the ranks disagree, every rank raises CollectiveMismatch, having read
        nothing."""
        g, p, r = self.group, self.group.size, self.group.rank
        layout = [(seg, off, x.nbytes, x.dtype.num) for (seg, off), x in zip(places, arrays)]
        rows = self.rows.reshape(p, 4)
        segment, offset = places[0]
        rows[r] = (
            segment,
            offset,
            sum(x.nbytes for x in arrays),
            zlib.crc32(repr(layout).encode()),
        )

        def exchange():
            mpi_allgather(g, self.rows, chunk_bounds(self.rows.size, p))

        self._sync(wins, exchange) if wins else exchange()
        if len({tuple(row) for row in rows.tolist()}) != 1:  # every rank holds the same rows
            raise CollectiveMismatch(
                "allreduce algo='shm': the ranks passed different arrays (segment, byte "
                f"offset, bytes, checksum of every array's place and dtype, by rank: "
                f"{rows.tolist()}; segment -1 is a plain array copied in)"
            )

    def _reduce(self, per_ranks: list[list[np.ndarray]], op: str, wins: list) -> None:
        """Steps 2 and 3 for every array at once: each rank reduces its chunk of each array,
        one barrier, each copies the other chunks of each array, one barrier."""
        g, p, r = self.group, self.group.size, self.group.rank
        moved = 0
        for per_rank in per_ranks:
            mine = per_rank[r]
            lo, hi = chunk_bounds(mine.size, p)[r : r + 2]
            # Chunk r, summed in the ring's order (ring.py: from rank r + 1 around to r
            # itself), so both algorithms give the same bits: ((x[r+1] + x[r+2]) + ...) + x[r].
            if p == 2:
                combine(op, per_rank[(r + 1) % p][lo:hi], mine[lo:hi], mine[lo:hi])
            else:
                partial = g.scratch.get("shm.partial", hi - lo, mine.dtype)
                combine(op, per_rank[(r + 1) % p][lo:hi], per_rank[(r + 2) % p][lo:hi], partial)
                for k in range(3, p):
                    combine(op, partial, per_rank[(r + k) % p][lo:hi], partial)
                combine(op, partial, mine[lo:hi], mine[lo:hi])
            # what the others read of ours: chunk q by each rank q, then our chunk by all
            moved += (mine.size + (p - 2) * (hi - lo)) * mine.itemsize
        self._sync(wins)  # 2: every chunk reduced by its owner
        for per_rank in per_ranks:
            mine = per_rank[r]
            bounds = chunk_bounds(mine.size, p)
            for k in range(1, p):
                q = (r + k) % p
                mine[bounds[q] : bounds[q + 1]] = per_rank[q][bounds[q] : bounds[q + 1]]
        g.traffic(moved, moved, 0)
        self._sync(wins)  # 3: nobody writes its array again while another still reads it

    def allreduce(self, src: np.ndarray, out: np.ndarray, op: str) -> None:
        self._require_local("allreduce algo='shm'")
        where = find(self.segments, out) if src is out else None
        if where is not None:
            self.allreduce_many([out], op)
            return
        # a plain array: agree first (every rank then takes part in a growth of the scratch),
        # copy it into the scratch, and reduce it there
        self._agree([out], [(_SCRATCH, 0)], [])
        self._through_scratch(src, out, op)

    def _through_scratch(self, src: np.ndarray, out: np.ndarray, op: str) -> None:
        scratch = self._scratch(out.nbytes)
        per_rank = [b[: out.nbytes].view(out.dtype) for b in scratch.per_rank]
        np.copyto(per_rank[self.group.rank], src)
        self._sync([scratch.win])  # 1b: the copies in place
        self._reduce([per_rank], op, [scratch.win])
        np.copyto(out, per_rank[self.group.rank])

    def allreduce_many(self, arrays: list[np.ndarray], op: str) -> None:
        """Reduce every array in place, each with the bits of its own allreduce; those in
        shared memory with one set of three synchronizations for all of them, any plain
        one after them through the scratch, one by one (every rank agrees first on which
        is which: a plain array where another rank has a shared one is a mismatch)."""
        self._require_local("allreduce algo='shm'")
        found = [find(self.segments, x) for x in arrays]
        places = [(_SCRATCH, 0) if w is None else w for w in found]
        shared = [i for i, w in enumerate(found) if w is not None]
        wins = [self.segments[s].win for s in sorted({found[i][0] for i in shared})]
        self._agree(arrays, places, wins)
        # every rank passed the same places and sizes: each decides alike from here on
        spans = sorted((found[i][0], found[i][1], found[i][1] + arrays[i].nbytes) for i in shared)
        if any(a[0] == b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:])):
            raise ValueError("allreduce of several arrays with algo='shm': the arrays overlap")
        per_ranks = [peers(self.segments[found[i][0]], found[i][1], arrays[i]) for i in shared]
        if per_ranks:
            self._reduce(per_ranks, op, wins)
        for i, where in enumerate(found):
            if where is None:
                self._through_scratch(arrays[i], arrays[i], op)


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


def of(group) -> SharedMemory:
    """The group's SharedMemory, made on first use (collective: every rank calls it)."""
    if group.shared is None:
        group.shared = SharedMemory(group)
    return group.shared


def shared_zeros(count: int, dtype, group, if_room: bool = False) -> np.ndarray | None:
    """A 1-D array of zeros in memory every rank of `group` can read (collective: every rank
    calls it with the same count and dtype). ValueError unless the group is on one machine.
    if_room: None on every rank instead when /dev/shm could not hold twice the bytes of all
    the ranks' arrays on some rank (DDP then keeps its buckets in plain memory)."""
    return of(group).zeros(count, dtype, check_room=if_room)


def release_shared(x: np.ndarray, group) -> None:
    """Hand a shared_zeros array back to its ranks' pool; the next shared_zeros of its size
    reuses the memory (no MPI call: every rank must release the same arrays). x must not
    be used after."""
    where = find(pool(group), x)
    if where is None or where[1] != 0:
        raise ValueError("release_shared: x is not an array shared_zeros made for these ranks")
    pool(group)[where[0]].in_use = False


def on_one_machine(group) -> bool:
    """Whether every rank of the group shares this machine's memory (collective on first use)."""
    return of(group).local


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


def shm_allreduce(group, src: np.ndarray, out: np.ndarray, op: str) -> None:
    of(group).allreduce(src, out, op)


def shm_allreduce_many(group, arrays: list[np.ndarray], op: str) -> None:
    """Reduce every array in place, as one allreduce per array would, bit for bit, with one
    set of synchronizations for all of those in shared memory (shared_zeros, or slices of
    one; they must not overlap). Collective: every rank passes the same list."""
    of(group).allreduce_many(arrays, op)
