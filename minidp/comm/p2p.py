"""Point-to-point messages: the only place in minidp that calls mpi4py's send and receive.

Every algorithm in minidp.comm is written with these calls on NumPy arrays:

    sendrecv(group, send_buf, dest, recv_buf, source)    one step of a ring or a butterfly
    send(group, buf, dest)          recv(group, buf, source)
    isend / irecv  ->  request      waitall(group, requests, peers)
    probe(group, source, tag, timeout) -> Arrival     recv_any(group, buf, source, tag)
    waitall_within(group, requests, peers, seconds)   a deadline of its own

The last three serve a protocol where a rank does not know who speaks next (a parameter
server): `probe` waits for any message without receiving it and says who sent it, with
which tag and how many bytes (an `Arrival`); `recv_any` receives from any source or tag and
says which; `waitall_within` waits outside any collective with a deadline of its own.

They use mpi4py's buffer (uppercase) API and ship every array as raw bytes (`MPI.BYTE`):
the reduction happens in NumPy on the receiving side, so MPI never needs to know the dtype
(float16 has no standard MPI datatype). Each call adds its bytes to the group's counters under
the collective in progress. Data is sent through `group.wire`: the communicator itself, or a
netem.Link that makes each send wait α + n·β first when MINIDP_NET_* emulates a network.

Sizes: every receive checks the bytes that arrived (its MPI status, `Get_count`, a few
hundred nanoseconds) against the bytes it posted. Fewer is an error on the receiving rank,
never a silently short buffer; more is MPI's truncation error (ERR_TRUNCATE), turned into the
same `MessageSizeMismatch` (a CollectiveMismatch) naming the peer, the sizes and the
collective. Ranks that pass different shapes without the fingerprint check (checks.py) still
get an error where a message of the wrong size lands, instead of a wrong answer.

Waiting: with no deadline (`group.timeout` None) a wait is MPI's own blocking call, which
spins on the core (the fast path). A *patient* group (`group.patient = True`, what data
parallelism's communication thread uses) polls `Testall`, briefly, then naps between polls,
so the thread computing beside it keeps the core and the GIL (the first polls catch quick
handshakes). With a deadline (the default, checks.py), the wait polls `Testall`, yielding
the core between polls (ranks often outnumber cores), and past the deadline raises
`CollectiveTimeout` naming the peers it never heard from.

Any error inside a collective leaves the group broken (group.py): it cancels the receives
still pending, which is best effort (a message MPI has already matched still lands, so the
call's `out` is undefined after an error), and keeps every pending request referenced by
the group, so MPI never touches freed memory.
"""

import os
import time
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from minidp.comm.errors import CollectiveTimeout, MessageSizeMismatch

DATA_TAG = 7001  # data of every algorithm; messages between one pair never overtake
CHECK_TAG = 7002  # fingerprints (checks.py), kept apart from the data
_SPIN = 64  # polls before the waiting loop starts to yield the core
_NAP_S = 50e-6  # a patient group's nap between polls
_MAX_NAP_S = 1e-3  # probe's longest nap: an idle probe leaves the core (docs/parameter_server.md)


BYTE = MPI.BYTE  # every message is raw bytes
ANY_SOURCE, ANY_TAG = MPI.ANY_SOURCE, MPI.ANY_TAG


def _msg(buf: np.ndarray) -> list:
    return [buf, BYTE]


def isend(group, buf: np.ndarray, dest: int, tag: int = DATA_TAG) -> MPI.Request:
    group.traffic(buf.nbytes, 0, 1)
    return group.wire.Isend(_msg(buf), dest, tag)


def irecv(group, buf: np.ndarray, source: int, tag: int = DATA_TAG) -> MPI.Request:
    group.traffic(0, buf.nbytes, 0)
    request = group.comm.Irecv(_msg(buf), source, tag)
    # waitall checks the size that arrives; after an error the receive is cancelled (sends
    # are not, safely). The dict keeps the request alive, so its id() stays unique.
    group.receiving[id(request)] = (request, buf.nbytes)
    return request


def waitall(group, requests: list, peers: list[int]) -> None:
    """Wait for every request; peers[i] is the rank at the other end of requests[i]."""
    statuses = statuses_for(group, len(requests))
    try:
        if group.deadline is None and not group.patient:
            group.waiting_on = peers  # for the watchdog (watchdog.py)
            MPI.Request.Waitall(requests, statuses)
        else:
            poll(group, requests, peers, statuses)
    except MPI.Exception as error:
        _truncated(group, error, requests, peers, statuses)
        raise
    receiving = group.receiving
    for request, peer, status in zip(requests, peers, statuses):
        posted = receiving.pop(id(request), None)  # done: nothing left to cancel
        if posted is not None and status.Get_count(BYTE) != posted[1]:
            raise MessageSizeMismatch(group.size_message(peer, posted[1], status.Get_count(BYTE)))


def statuses_for(group, n: int) -> list:
    """The group's reusable MPI.Status objects, at least n of them."""
    statuses = group.statuses
    if len(statuses) < n:
        statuses += [MPI.Status() for _ in range(n - len(statuses))]
    return statuses


def poll(group, requests: list, peers: list[int], statuses: list) -> None:
    """Test the requests until all are done: napping (patient) or yielding the core, and
    raising CollectiveTimeout past the group's deadline, naming the peers not heard from."""
    deadline, polls = group.deadline, 0
    while not MPI.Request.Testall(requests, statuses):
        polls += 1
        if polls > _SPIN:
            if group.patient:
                time.sleep(_NAP_S)  # frees the core and the GIL for the compute thread
            else:
                os.sched_yield()
        if deadline is not None and polls % _SPIN == 0 and time.monotonic() > deadline:
            missing = sorted({peer for req, peer in zip(requests, peers) if not req.Test()})
            _abandon(group, requests)
            raise CollectiveTimeout(group.timeout_message(missing))


def _abandon(group, requests: list) -> None:
    """Keep the sends still pending referenced: MPI may still read their buffers. (Receives
    are in group.receiving; the collective's exit cancels them, see group.py.)"""
    group.abandoned += [
        req for req in requests if req != MPI.REQUEST_NULL and id(req) not in group.receiving
    ]


def _truncated(group, error: MPI.Exception, requests: list, peers: list[int], statuses) -> None:
    """Raise MessageSizeMismatch if error is MPI truncating one of the receives."""
    for i, (request, status) in enumerate(zip(requests, statuses)):
        if truncates(error, status) and id(request) in group.receiving:
            _abandon(group, requests)
            posted = group.receiving[id(request)][1]
            raise MessageSizeMismatch(group.size_message(peers[i], posted, None)) from error


def truncates(error: MPI.Exception, status: MPI.Status) -> bool:
    """Whether error, raised by a wait on several requests, is MPI truncating the receive
    whose status this is (ERR_IN_STATUS: each status has its own error; else: one for all)."""
    in_status = error.Get_error_class() == MPI.ERR_IN_STATUS
    code = status.Get_error() if in_status else error.Get_error_code()
    return MPI.Get_error_class(code) == MPI.ERR_TRUNCATE


def sendrecv(group, send_buf: np.ndarray, dest: int, recv_buf: np.ndarray, source: int) -> None:
    """Send send_buf to dest while receiving recv_buf from source (no send/send deadlock)."""
    if group.deadline is None and not group.patient:
        counts = group.current  # the fast path: MPI's blocking call, counted inline
        counts[1] += send_buf.nbytes
        counts[2] += recv_buf.nbytes
        counts[3] += 1
        status = group.statuses[0]
        group.waiting_on = source  # for the watchdog (watchdog.py)
        try:
            group.wire.Sendrecv(
                [send_buf, BYTE], dest, DATA_TAG, [recv_buf, BYTE], source, DATA_TAG, status
            )
        except MPI.Exception as error:
            if error.Get_error_class() == MPI.ERR_TRUNCATE:
                message = group.size_message(source, recv_buf.nbytes, None)
                raise MessageSizeMismatch(message) from error
            raise
        if status.Get_count(BYTE) != recv_buf.nbytes:
            got = status.Get_count(BYTE)
            raise MessageSizeMismatch(group.size_message(source, recv_buf.nbytes, got))
    else:
        reqs = [irecv(group, recv_buf, source), isend(group, send_buf, dest)]
        waitall(group, reqs, [source, dest])


def send(group, buf: np.ndarray, dest: int) -> None:
    waitall(group, [isend(group, buf, dest)], [dest])


def recv(group, buf: np.ndarray, source: int) -> None:
    waitall(group, [irecv(group, buf, source)], [source])


# ---- receiving from whoever speaks next ----------------------------------------------------
class Arrival(NamedTuple):
    """A message that has arrived (probe) or been received (recv_any): who, tag, bytes."""

    source: int
    tag: int
    nbytes: int


def max_tag(group) -> int | None:
    """The largest tag a message on `group` may carry (MPI's TAG_UB, at least 32767), or
    None where the MPI does not say."""
    upper = group.comm.Get_attr(MPI.TAG_UB)
    return None if upper is None else int(upper)


def probe(group, source: int = ANY_SOURCE, tag: int = ANY_TAG, timeout: float | None = None):
    """Wait until a message from `source` with `tag` can be received, without receiving it;
    return its Arrival, or None when `timeout` seconds pass first (None: wait forever).

    `Iprobe`, a few quick polls, then, as `poll` waits: a patient group (`group.patient`)
    naps, doubling from 50 us to 1 ms, so a rank that waits for long (a parameter server
    between pushes) leaves the core to the ranks that compute, yet answers a message within
    about a millisecond; any other group yields the core between polls and answers at once
    (a pipeline stage waiting for its neighbour, where the naps made every hop late:
    docs/pipeline.md)."""
    status, nap, polls = group.statuses[0], _NAP_S, 0
    start = time.monotonic()
    while not group.comm.Iprobe(source, tag, status):
        polls += 1
        if polls > _SPIN:
            if group.patient:
                time.sleep(nap)
                nap = min(2 * nap, _MAX_NAP_S)
            else:
                os.sched_yield()
            if timeout is not None and time.monotonic() - start > timeout:
                return None
    return Arrival(status.Get_source(), status.Get_tag(), status.Get_count(BYTE))


def recv_any(group, buf: np.ndarray, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Arrival:
    """Receive one message into buf from `source` (or any) with `tag` (or any): who sent it.

    The size check of every receive holds: fewer or more bytes than buf is MessageSizeMismatch."""
    request = irecv(group, buf, source, tag)
    waitall(group, [request], [source if source >= 0 else None])
    status = group.statuses[0]
    return Arrival(status.Get_source(), status.Get_tag(), status.Get_count(BYTE))


def waitall_within(group, requests: list, peers: list[int], seconds: float) -> None:
    """waitall, outside any collective, with a deadline `seconds` from now: past it,
    CollectiveTimeout naming the peers not heard from (the group's state is not touched)."""
    group.deadline = time.monotonic() + seconds
    try:
        waitall(group, requests, peers)
    finally:
        group.deadline = None
