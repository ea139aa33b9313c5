"""Persistent requests: an algorithm's steps as MPI_Send_init / MPI_Recv_init, made once.

    python -m pytest -q tests/test_comm_fast_path.py      # bit-equal to the plain path

A plain step (p2p.sendrecv) makes MPI build and match a fresh request pair every call. A
persistent request (MPI-3.1 §3.9) is the pair built once on fixed buffers, then started
(`MPI_Startall`) and waited on as often as you like: the arguments are checked and the
request objects made once. `Steps` is a schedule of such steps, each a receive and a send
on fixed views, then maybe a combine `out = a ⊕ b` on fixed views. The builders below lay
out ring.py's and recursive.py's steps on given buffers (src, the vector read; dst, the
vector written, which may be src; recv, one chunk of scratch), message for message and
operand for operand, so a run gives the plain algorithm's bits:

    ring_allreduce_steps       reduce-scatter (p - 1 steps: send, receive, dst[t] = recv ⊕ src[t])
                               then allgather (p - 1 steps on dst), Baidu's table in ring.py
    doubling_allreduce_steps   lg p exchanges of the whole vector, low rank's operand first
                               (p a power of two; the fold is the plain path's)

fast_path.py lays them on a plan's own buffers (staged: the call copies x in and the result
out) or on the caller's x and out themselves (bound: no copies).
"""

import numpy as np
from mpi4py import MPI

from minidp.comm.errors import MessageSizeMismatch
from minidp.comm.p2p import BYTE, DATA_TAG, truncates
from minidp.comm.reduce_ops import _UFUNC
from minidp.tools.chunks import chunk_bounds

_startall, _waitall = MPI.Prequest.Startall, MPI.Request.Waitall  # looked up once


class Steps:
    """A schedule of steps on persistent requests over fixed buffers; `run` runs them all."""

    def __init__(self, group) -> None:
        self.comm = group.comm
        self.steps: list[tuple] = []
        self.statuses = [MPI.Status(), MPI.Status()]
        self.sent = self.received = 0

    def add(self, send: np.ndarray, dest: int, got: np.ndarray, source: int, combine=None):
        """One step: send `send` to dest while receiving `got` from source; then combine,
        (ufunc, a, b, out), if given."""
        comm = self.comm
        requests = [
            comm.Recv_init([got, BYTE], source, DATA_TAG),
            comm.Send_init([send, BYTE], dest, DATA_TAG),
        ]
        self.steps.append((requests, got.nbytes, source, combine))
        self.sent += send.nbytes
        self.received += got.nbytes

    def run(self, group) -> None:
        """Every step, in order: the messages of the plain algorithm, counted as p2p counts,
        each receive's size checked as p2p checks it."""
        counts, statuses = group.current, self.statuses
        counts[1] += self.sent
        counts[2] += self.received
        counts[3] += len(self.steps)
        received = statuses[0]
        for requests, nbytes, source, combine in self.steps:
            group.waiting_on = source  # for the watchdog (watchdog.py)
            _startall(requests)
            try:
                _waitall(requests, statuses)
            except MPI.Exception as error:  # MPI truncated the receive, or another error
                if truncates(error, received):
                    message = group.size_message(source, nbytes, None)
                    raise MessageSizeMismatch(message) from error
                raise
            if received.Get_count(BYTE) != nbytes:
                got = received.Get_count(BYTE)
                raise MessageSizeMismatch(group.size_message(source, nbytes, got))
            if combine is not None:
                ufunc, a, b, out = combine
                ufunc(a, b, out)  # out=out, passed by position (a keyword costs a lookup)

    def free(self) -> None:
        for requests, *_ in self.steps:
            for request in requests:
                request.Free()
        self.steps = []


def ring_allreduce_steps(group, src, dst, recv, op: str) -> Steps:
    """ring.py's ring_allreduce: reduce-scatter into dst, then allgather of dst."""
    p, r, ufunc = group.size, group.rank, _UFUNC[op]
    b = chunk_bounds(src.size, p)
    steps = Steps(group)
    s = (r - 1) % p
    sending = src[b[s] : b[s + 1]]
    for k in range(p - 1):
        t = (r - k - 2) % p  # the chunk arriving from the left at this step
        target = dst[b[t] : b[t + 1]]
        received = recv[: b[t + 1] - b[t]]
        combine = (ufunc, received, src[b[t] : b[t + 1]], target)
        steps.add(sending, group.right, received, group.left, combine)
        sending = target  # what we add now is what we pass on next step
    for k in range(p - 1):
        s, t = (r - k) % p, (r - k - 1) % p
        steps.add(dst[b[s] : b[s + 1]], group.right, dst[b[t] : b[t + 1]], group.left)
    return steps


def doubling_allreduce_steps(group, src, dst, recv, op: str) -> Steps:
    """recursive.py's recursive doubling for p a power of two: the first step sends src, the
    others dst; both partners combine (low rank's, high rank's) into dst."""
    p, r, ufunc = group.size, group.rank, _UFUNC[op]
    steps, current, mask = Steps(group), src, 1
    recv = recv[: src.size]
    while mask < p:
        low, high = (current, recv) if r & mask == 0 else (recv, current)
        steps.add(current, r ^ mask, recv, r ^ mask, (ufunc, low, high, dst))
        current, mask = dst, mask * 2
    return steps


def allreduce_steps(algo: str, n: int, p: int):
    """(builder, elements of scratch `recv` it needs) for allreduce's algo on n elements
    over p ranks, or None where none applies (recursive doubling's fold, p not a power of 2)."""
    if algo == "ring":
        return ring_allreduce_steps, chunk_bounds(n, p)[1]
    if algo == "recursive_doubling" and p & (p - 1) == 0:
        return doubling_allreduce_steps, n
    return None
