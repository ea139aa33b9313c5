"""MPI's own collectives (algo="mpi"), for comparison with the hand-written ones.

These are the only calls in minidp.comm to MPI collectives. With a deadline set (the
default, checks.py), the non-blocking variant (MPI_Iallreduce, ...) is polled instead, so a
missing rank raises CollectiveTimeout here too. A message MPI truncates (a rank passed more
than its peer expected) raises MessageSizeMismatch; MPI's own collectives give no count to
check a short one against, so there only the fingerprint catches it. Data-movement
collectives ship raw bytes; reductions use MPI's datatype for the dtype (float16 too, where
the MPI has one, as MPICH does; otherwise it is reduced in float32 and rounded once).
"""

import numpy as np
from mpi4py import MPI

from minidp.comm.errors import MessageSizeMismatch
from minidp.comm.p2p import waitall
from minidp.tools.chunks import Bounds

_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


def _native(dtype: np.dtype) -> bool:
    try:
        return MPI.Datatype.fromcode(dtype.char) != MPI.DATATYPE_NULL
    except (KeyError, ValueError):
        return False


def _run(group, name: str, *args) -> None:
    """comm.<name>(*args), or its non-blocking twin polled against the deadline."""
    if group.deadline is None and not group.patient:
        group.waiting_on = None  # every other rank (watchdog.py)
        try:
            getattr(group.comm, name)(*args)
        except MPI.Exception as error:
            if error.Get_error_class() == MPI.ERR_TRUNCATE:  # a rank passed a longer message
                raise MessageSizeMismatch(group.size_message(None, None, None)) from error
            raise
        return
    request = getattr(group.comm, "I" + name[0].lower() + name[1:])(*args)
    waitall(group, [request], [i for i in range(group.size) if i != group.rank])


def _reduction(src: np.ndarray, out: np.ndarray | None, call) -> None:
    """call(src, out) in the array's own MPI datatype, or in float32 where MPI has none."""
    if _native(src.dtype):
        call(src, out)
        return
    wide_out = None if out is None else np.empty(out.shape, np.float32)
    call(src.astype(np.float32), wide_out)
    if out is not None:
        np.copyto(out, wide_out, casting="unsafe")


def _bytes(buf: np.ndarray) -> list:
    return [buf, MPI.BYTE]


def mpi_allreduce(group, src: np.ndarray, out: np.ndarray, op: str) -> None:
    _reduction(
        src, out, lambda s, o: _run(group, "Allreduce", MPI.IN_PLACE if s is o else s, o, _OPS[op])
    )


def mpi_reduce_scatter(group, src: np.ndarray, bounds: Bounds, op: str, out: np.ndarray) -> None:
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    _reduction(src, out, lambda s, o: _run(group, "Reduce_scatter", s, o, counts, _OPS[op]))


def mpi_reduce(group, src: np.ndarray, out: np.ndarray | None, root: int, op: str) -> None:
    _reduction(
        src,
        out,
        lambda s, o: _run(group, "Reduce", MPI.IN_PLACE if s is o else s, o, _OPS[op], root),
    )


def mpi_allgather(group, buf: np.ndarray, bounds: Bounds) -> None:
    """In place: rank r's chunk of buf is filled; everyone gets all chunks."""
    size = buf.itemsize
    counts = [(b - a) * size for a, b in zip(bounds, bounds[1:])]
    displs = [a * size for a in bounds[:-1]]
    _run(group, "Allgatherv", MPI.IN_PLACE, [buf, counts, displs, MPI.BYTE])


def mpi_broadcast(group, buf: np.ndarray, root: int) -> None:
    _run(group, "Bcast", _bytes(buf), root)


def mpi_gather(group, row: np.ndarray, rows: np.ndarray | None, root: int) -> None:
    _run(group, "Gather", _bytes(row), None if rows is None else _bytes(rows), root)


def mpi_scatter(group, rows: np.ndarray | None, row: np.ndarray, root: int) -> None:
    _run(group, "Scatter", None if rows is None else _bytes(rows), _bytes(row), root)


def mpi_alltoall(group, rows: np.ndarray, out: np.ndarray) -> None:
    _run(group, "Alltoall", _bytes(rows), _bytes(out))


def mpi_barrier(group) -> None:
    _run(group, "Barrier")
