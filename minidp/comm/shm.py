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
one (collective; DDP's arena, parallel/data_parallel/shm_arena.py), in a segment of shm_memory.py,
which also tells where an array lies and gives every rank's array at its place.
algo="auto" picks "shm" exactly for arrays in shared memory.
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
"""

import zlib

import numpy as np
from mpi4py import MPI

from minidp.comm.builtin import mpi_allgather, mpi_barrier
from minidp.comm.errors import CollectiveMismatch
from minidp.comm.reduce_ops import combine
from minidp.comm.shm_memory import (  # noqa: F401 (shm.pool: the tests count segments)
    Segment,
    find,
    in_shared_memory,
    new_window,
    peer_arrays,
    peers,
    pool,
    release_shared,
    take_segment,
)
from minidp.tools.chunks import chunk_bounds

_SCRATCH = -1  # the segment number that means: a plain array, copied into the scratch


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
        """Zeros in a segment of the pool (shm_memory.take_segment; collective), or None
        if check_room and /dev/shm lacks room on some rank."""
        self._require_local("shared_zeros")
        dtype = np.dtype(dtype)
        segment = take_segment(self.group, count * dtype.itemsize, check_room)
        if segment is None:
            return None
        mine = segment.per_rank[self.group.rank].view(dtype)
        mine[...] = 0
        return mine

    def _scratch(self, nbytes: int) -> Segment:
        """The scratch segment, at least nbytes (grown collectively: every rank of a call
        passes the same size, which the call's allgather has just checked)."""
        if self.scratch is None or self.scratch.nbytes < nbytes:
            if self.scratch is not None:  # every rank is in this call: safe to free here
                self.scratch.win.Unlock_all()
                self.scratch.win.Free()
            self.scratch = new_window(self.group, nbytes)
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


def on_one_machine(group) -> bool:
    """Whether every rank of the group shares this machine's memory (collective on first use)."""
    return of(group).local


def shm_allreduce(group, src: np.ndarray, out: np.ndarray, op: str) -> None:
    of(group).allreduce(src, out, op)


def shm_allreduce_many(group, arrays: list[np.ndarray], op: str) -> None:
    """Reduce every array in place, as one allreduce per array would, bit for bit, with one
    set of synchronizations for all of those in shared memory (shared_zeros, or slices of
    one; they must not overlap). Collective: every rank passes the same list."""
    of(group).allreduce_many(arrays, op)
