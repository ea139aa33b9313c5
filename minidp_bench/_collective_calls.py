"""The calls `bench collectives` times: ours and MPI's own on buffers allocated once."""

import numpy as np
from mpi4py import MPI

from minidp import comm
from minidp.comm import p2p


def contenders(op: str, algo: str, nbytes: int, dtype: np.dtype, group: comm.Group):
    """(ours, builtin, output): zero-argument callables on buffers allocated once, here;
    output() is what the last call wrote (None where this rank gets nothing)."""
    p, r, mpi = group.size, group.rank, group.comm
    n = max(nbytes // dtype.itemsize, 1)
    rng = np.random.default_rng(r)
    x = rng.standard_normal(n).astype(dtype)
    out = np.empty_like(x)
    if op == "allreduce" and algo == "shm":  # in place on shared memory, as DDP's buckets
        return _in_place_shm(x, group)
    if op == "allreduce":
        return (
            lambda: comm.allreduce(x, algo=algo, group=group, out=out),
            lambda: mpi.Allreduce(x, out, op=MPI.SUM),
            out.copy,
        )
    if op == "reduce_scatter":
        bounds = comm.chunk_bounds(n, p)
        mine = np.empty(bounds[r + 1] - bounds[r], dtype)
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        return (
            lambda: comm.reduce_scatter(x, algo=algo, group=group, out=mine),
            lambda: mpi.Reduce_scatter(x, mine, counts, op=MPI.SUM),
            mine.copy,
        )
    if op == "allgather":
        bounds = comm.chunk_bounds(n, p)
        mine = x[bounds[r] : bounds[r + 1]].copy()
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        return (
            lambda: comm.allgather(mine, algo=algo, group=group, out=out),
            lambda: mpi.Allgatherv(
                mine, [out, counts, bounds[:-1], MPI.Datatype.fromcode(dtype.char)]
            ),
            out.copy,
        )
    if op == "broadcast":
        return (
            lambda: comm.broadcast(x, root=0, algo=algo, group=group),
            lambda: mpi.Bcast(x, root=0),
            x.copy,  # in place: ours runs first, on the ranks' own data
        )
    if op == "reduce":
        return (
            lambda: comm.reduce(x, root=0, algo=algo, group=group, out=out),
            lambda: mpi.Reduce(x, out if r == 0 else None, op=MPI.SUM, root=0),
            lambda: out.copy() if r == 0 else None,
        )
    if op == "p2p":  # ranks in pairs (0 -> 1, 2 -> 3, ...): the even one sends
        peer = r ^ 1 if r ^ 1 < p else None
        sends = r % 2 == 0
        return (
            lambda: _pair(
                peer, sends, lambda: p2p.send(group, x, peer), lambda: p2p.recv(group, out, peer)
            ),
            lambda: _pair(peer, sends, lambda: mpi.Send(x, peer), lambda: mpi.Recv(out, peer)),
            lambda: out.copy() if peer is not None and not sends else None,
        )
    if op == "alltoall":
        rows = x[: n // p * p].reshape(p, -1)
        got = np.empty_like(rows)
        return (
            lambda: comm.alltoall(rows, algo=algo, group=group, out=got),
            lambda: mpi.Alltoall(rows, got),
            got.copy,
        )
    raise AssertionError(op)


def _in_place_shm(x: np.ndarray, group: comm.Group):
    """contenders() for allreduce "shm": ours in place on a copy of x in shared memory, MPI's
    in place (MPI_IN_PLACE) on a plain copy; output() is what the last call reduced. Both
    start from x and sum in place every call, so their values grow alike."""
    shared, plain = comm.shared_zeros(x.size, x.dtype, group), x.copy()
    shared[...] = x
    last = [shared]

    def ours():
        comm.allreduce(shared, algo="shm", group=group, out=shared)
        last[0] = shared

    def builtin():
        group.comm.Allreduce(MPI.IN_PLACE, plain, op=MPI.SUM)
        last[0] = plain

    return ours, builtin, lambda: last[0].copy()


def _pair(peer, sends: bool, send, recv) -> None:
    if peer is not None:
        send() if sends else recv()
