"""Point-to-point messages: the only place in minidp that calls mpi4py's send and receive.

Every algorithm in minidp.comm is written with these calls on NumPy arrays:

    sendrecv(group, send_buf, dest, recv_buf, source)    one step of a ring or a butterfly
    send(group, buf, dest)          recv(group, buf, source)
    isend / irecv  ->  request      waitall(group, requests, peers)

They use mpi4py's buffer (uppercase) API and ship every array as raw bytes (`MPI.BYTE`):
the reduction happens in NumPy on the receiving side, so MPI never needs to know the dtype
(float16 has no standard MPI datatype). Each call adds its bytes to the group's counters under
the collective in progress.

Waiting: with no deadline (checks off) a wait is MPI's own blocking call, which spins on
the core. A *patient* group (`group.patient = True`, what data parallelism's communication
thread uses) polls `Testall`, briefly, then naps between polls, so the thread computing
beside it keeps the core and the GIL (the first polls catch quick handshakes). With a
deadline, the wait polls `Testall`, yielding the core between polls (ranks often outnumber
cores), and at the deadline raises `CollectiveTimeout` naming the peers it never heard from.

Any error inside a collective leaves the group broken (group.py): it cancels the receives
still pending, which is best effort (a message MPI has already matched still lands, so the
call's `out` is undefined after an error), and keeps every pending request referenced by
the group, so MPI never touches freed memory.
"""

import os
import time

import numpy as np
from mpi4py import MPI

from minidp.comm.errors import CollectiveTimeout

DATA_TAG = 7001  # data of every algorithm; messages between one pair never overtake
CHECK_TAG = 7002  # fingerprints (checks.py), kept apart from the data
_SPIN = 64  # polls before the waiting loop starts to yield the core
_NAP_S = 50e-6  # a patient group's nap between polls


BYTE = MPI.BYTE  # every message is raw bytes


def _msg(buf: np.ndarray) -> list:
    return [buf, BYTE]


def isend(group, buf: np.ndarray, dest: int, tag: int = DATA_TAG) -> MPI.Request:
    group.traffic(buf.nbytes, 0, 1)
    return group.comm.Isend(_msg(buf), dest, tag)


def irecv(group, buf: np.ndarray, source: int, tag: int = DATA_TAG) -> MPI.Request:
    group.traffic(0, buf.nbytes, 0)
    request = group.comm.Irecv(_msg(buf), source, tag)
    group.receiving.append(request)  # cancellable after an error (sends are not, safely)
    return request


def waitall(group, requests: list, peers: list[int]) -> None:
    """Wait for every request; peers[i] is the rank at the other end of requests[i]."""
    deadline = group.deadline
    if deadline is None and not group.patient:
        MPI.Request.Waitall(requests)
        return
    polls = 0
    while not MPI.Request.Testall(requests):
        polls += 1
        if polls > _SPIN:
            if group.patient:
                time.sleep(_NAP_S)  # frees the core and the GIL for the compute thread
            else:
                os.sched_yield()
        if deadline is not None and polls % _SPIN == 0 and time.monotonic() > deadline:
            _give_up(group, requests, peers)


def _give_up(group, requests: list, peers: list[int]) -> None:
    missing = sorted({peer for req, peer in zip(requests, peers) if not req.Test()})
    # Sends still pending stay referenced: MPI may still read their buffers. (Receives are
    # in group.receiving; the collective's exit cancels them, see group.py.)
    group.abandoned += [
        req
        for req in requests
        if req != MPI.REQUEST_NULL and not any(req == r for r in group.receiving)
    ]
    raise CollectiveTimeout(group.timeout_message(missing))


def sendrecv(group, send_buf: np.ndarray, dest: int, recv_buf: np.ndarray, source: int) -> None:
    """Send send_buf to dest while receiving recv_buf from source (no send/send deadlock)."""
    if group.deadline is None and not group.patient:
        counts = group.current  # the fast path: MPI's blocking call, counted inline
        counts[1] += send_buf.nbytes
        counts[2] += recv_buf.nbytes
        counts[3] += 1
        group.comm.Sendrecv([send_buf, BYTE], dest, DATA_TAG, [recv_buf, BYTE], source, DATA_TAG)
    else:
        reqs = [irecv(group, recv_buf, source), isend(group, send_buf, dest)]
        waitall(group, reqs, [source, dest])


def send(group, buf: np.ndarray, dest: int) -> None:
    waitall(group, [isend(group, buf, dest)], [dest])


def recv(group, buf: np.ndarray, source: int) -> None:
    waitall(group, [irecv(group, buf, source)], [source])
