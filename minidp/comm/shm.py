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
bits, and with the ring's bits. Three barriers order the steps: inputs ready, chunks
reduced, and everyone done reading before anyone writes its array again (a fourth for a
plain array, once it is copied in). Intra-node collectives in MPICH, NCCL and DeepSpeed's
CPU allreduce use shared memory the same way.

Zero copies need the array itself in shared memory: `shared_zeros(n, dtype, group)` makes
one (collective; DDP's buckets are made this way when they are reduced with "shm" or
"auto"), `in_shared_memory(x, group)` tells whether x lies in one, and
`peer_arrays(x, group)` gives every rank's array at x's place (tutorial 04 does the
allreduce by hand with it). algo="auto" picks "shm" exactly for arrays in shared memory.
Any other array can be reduced with algo="shm" too: it is copied into a shared scratch
segment and back, which costs more than a ring (two extra copies).

Counted as bytes sent: what the other ranks load from this rank's memory, 2(p-1)/p·n, the
same bytes the ring sends (no messages). Before reading, every rank posts which segment,
offset and size it passed in a small shared table; after the first barrier each rank reads
the table, and if the ranks disagree (another bucket, a plain array beside a shared one)
every rank raises CollectiveMismatch, having read nothing. A group spread over machines
cannot use it: ValueError on every rank.
"""

import numpy as np
from mpi4py import MPI

from minidp.chunks import chunk_bounds
from minidp.comm.builtin import mpi_barrier
from minidp.comm.errors import CollectiveMismatch
from minidp.comm.ops import combine

_SCRATCH = -1  # the table's segment number for the scratch segment (a plain array's copy)


class SharedMemory:
    """A group's shared segments: one window per `shared_zeros` call, a scratch and a table.

    Made on first use by `of(group)`. The windows live until the process ends: freeing one
    (MPI_Win_free) waits for every rank, and a DDP closes on error paths too, where the
    other ranks may never come; so allocate few (DDP makes one for all its buckets)."""

    def __init__(self, group):
        node = group.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local = node.Get_size() == group.size  # the same answer on every rank
        node.Free()
        self.group = group
        # (address, bytes, window, every rank's bytes) of each shared_zeros array
        self.segments: list[tuple[int, int, MPI.Win, list[np.ndarray]]] = []
        self.scratch: tuple[MPI.Win, list[np.ndarray]] | None = None
        self.table: tuple[MPI.Win, list[np.ndarray]] | None = None  # (segment, offset, ...)

    def _require_local(self, what: str) -> None:
        if not self.local:
            raise ValueError(
                f"{what}: the group's {self.group.size} ranks are not all on one machine; "
                "shared memory needs one (use another algo)"
            )

    def _allocate(self, nbytes: int) -> tuple[MPI.Win, list[np.ndarray]]:
        """A window of nbytes on every rank (collective), and every rank's bytes, as uint8."""
        sizes = self.group.comm.allgather(nbytes)
        if len(set(sizes)) != 1:
            raise CollectiveMismatch(
                f"shared memory: the ranks asked for different sizes {sizes} (bytes, by rank)"
            )
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each rank's segment page-aligned
        win = MPI.Win.Allocate_shared(max(nbytes, 1), 1, info, comm=self.group.comm)
        info.Free()
        win.Lock_all(MPI.MODE_NOCHECK)  # passive target for the whole life: Sync() orders
        per_rank = []
        for q in range(self.group.size):
            buf, _ = win.Shared_query(q)
            per_rank.append(np.frombuffer(buf, dtype=np.uint8, count=nbytes))
        return win, per_rank

    def zeros(self, count: int, dtype) -> np.ndarray:
        self._require_local("shared_zeros")
        dtype = np.dtype(dtype)
        win, per_rank = self._allocate(count * dtype.itemsize)
        address = per_rank[self.group.rank].__array_interface__["data"][0]
        self.segments.append((address, count * dtype.itemsize, win, per_rank))
        mine = per_rank[self.group.rank].view(dtype)
        mine[...] = 0
        return mine

    def find(self, x: np.ndarray) -> tuple[int, int] | None:
        """(segment number, byte offset) of x inside one of this rank's segments, or None."""
        start = x.__array_interface__["data"][0]
        for i, (address, nbytes, _, _) in enumerate(self.segments):
            if address <= start and start + x.nbytes <= address + nbytes:
                return i, start - address
        return None

    def peers(self, segment: int, offset: int, x: np.ndarray) -> list[np.ndarray]:
        """Every rank's array at x's place (segment, byte offset), shaped like x."""
        return [
            b[offset : offset + x.nbytes].view(x.dtype).reshape(x.shape)
            for b in self.segments[segment][3]
        ]

    def _scratch(self, nbytes: int) -> tuple[MPI.Win, list[np.ndarray]]:
        """The scratch window and every rank's bytes, at least nbytes (grown collectively:
        every rank of a call passes the same size, which the fingerprint checks)."""
        if self.scratch is None or self.scratch[1][0].size < nbytes:
            if self.scratch is not None:  # every rank is in this call: safe to free here
                self.scratch[0].Unlock_all()
                self.scratch[0].Free()
            self.scratch = self._allocate(nbytes)
        return self.scratch

    def _table(self) -> tuple[MPI.Win, list[np.ndarray]]:
        if self.table is None:
            win, per_rank = self._allocate(4 * 8)
            self.table = win, [row.view(np.int64) for row in per_rank]
        return self.table

    def _sync(self, *windows: MPI.Win) -> None:
        """Every rank's stores to `windows` before the barrier are seen by every rank's
        loads after it (MPI_Win_sync on each side of the barrier)."""
        for win in windows:
            win.Sync()
        mpi_barrier(self.group)
        for win in windows:
            win.Sync()

    def allreduce(self, src: np.ndarray, out: np.ndarray, op: str) -> None:
        self._require_local("allreduce algo='shm'")
        g, p, r = self.group, self.group.size, self.group.rank
        where = self.find(out) if src is out else None
        where = (_SCRATCH, 0) if where is None else where  # a plain array: via the scratch
        table_win, table = self._table()
        segment, offset = where
        win = None if segment == _SCRATCH else self.segments[segment][2]
        table[r][:] = (segment, offset, out.nbytes, out.dtype.num)
        self._sync(table_win, *([win] if win else []))  # 1: table rows (and inputs) written
        rows = [tuple(int(v) for v in row) for row in table]
        if len(set(rows)) != 1:
            self._sync(table_win)  # every rank has read the table before any raises
            raise CollectiveMismatch(
                "allreduce algo='shm': the ranks passed different arrays "
                f"(segment, byte offset, bytes, dtype by rank: {rows}; segment -1 is a plain "
                "array copied in)"
            )
        if segment == _SCRATCH:  # every rank agrees, so every rank takes part in a growth
            win, scratch = self._scratch(out.nbytes)
            per_rank = [b[: out.nbytes].view(out.dtype) for b in scratch]
            np.copyto(per_rank[r], src)
            self._sync(win)  # 1b: the copies in place
        else:
            per_rank = self.peers(segment, offset, out)
        bounds = chunk_bounds(out.size, p)
        lo, hi = bounds[r], bounds[r + 1]
        mine = per_rank[r]
        # Chunk r, summed in the ring's order (ring.py: from rank r + 1 around to r itself),
        # so that both algorithms give the same bits: ((x[r+1] + x[r+2]) + ...) + x[r].
        if p == 2:
            combine(op, per_rank[(r + 1) % p][lo:hi], mine[lo:hi], mine[lo:hi])
        else:
            partial = g.scratch.get("shm.partial", hi - lo, out.dtype)
            combine(op, per_rank[(r + 1) % p][lo:hi], per_rank[(r + 2) % p][lo:hi], partial)
            for k in range(3, p):
                combine(op, partial, per_rank[(r + k) % p][lo:hi], partial)
            combine(op, partial, mine[lo:hi], mine[lo:hi])
        self._sync(win)  # 2: every chunk reduced by its owner
        for k in range(1, p):
            q = (r + k) % p
            mine[bounds[q] : bounds[q + 1]] = per_rank[q][bounds[q] : bounds[q + 1]]
        moved = 2 * (out.nbytes - (hi - lo) * out.itemsize)  # what the others read of ours
        g.traffic(moved, moved, 0)
        self._sync(win)  # 3: nobody writes its array again while another still reads it
        if mine is not out:
            np.copyto(out, mine)


def of(group) -> SharedMemory:
    """The group's SharedMemory, made on first use (collective: every rank calls it)."""
    if group.shared is None:
        group.shared = SharedMemory(group)
    return group.shared


def shared_zeros(count: int, dtype, group) -> np.ndarray:
    """A 1-D array of zeros in memory every rank of `group` can read (collective: every rank
    calls it with the same count and dtype). ValueError unless the group is on one machine."""
    return of(group).zeros(count, dtype)


def on_one_machine(group) -> bool:
    """Whether every rank of the group shares this machine's memory (collective on first use)."""
    return of(group).local


def in_shared_memory(x: np.ndarray, group) -> bool:
    """Whether x lies in a segment made by shared_zeros for this group (local: no message)."""
    return group.shared is not None and group.shared.find(x) is not None


def peer_arrays(x: np.ndarray, group) -> list[np.ndarray]:
    """Every rank's array at x's place in shared memory, element q rank q's (x: made by
    shared_zeros, or a contiguous slice of one). Reading another rank's element is a load
    from its memory: order it with a barrier after the writes (shm.py also calls
    MPI_Win_sync around its barriers, as the MPI standard asks)."""
    where = group.shared.find(x) if group.shared is not None else None
    if where is None or not x.flags.c_contiguous:
        raise ValueError("peer_arrays: x is not in this group's shared memory (shared_zeros)")
    return group.shared.peers(*where, x)


def shm_allreduce(group, src: np.ndarray, out: np.ndarray, op: str) -> None:
    of(group).allreduce(src, out, op)
