"""Persistent requests: an algorithm's steps as MPI_Send_init / MPI_Recv_init, made once.

    python -m pytest -q tests/test_comm_fast_path.py      # bit-equal to the plain path

A plain step (p2p.sendrecv) makes MPI build and match a fresh request pair every call. A
persistent request (MPI-3.1 §3.9) is the pair built once on fixed buffers, then started
(`MPI_Startall`) and waited on as often as you like: the arguments are checked and the
request objects made once. `Steps` is a schedule of such steps, each a receive and a send
(or only one of them, or one buffer sent to several ranks at once) on fixed views, then
maybe a combine `out = a ⊕ b` on fixed views. The builders below lay out ring.py's,
recursive.py's and tree.py's steps on given buffers (src, the vector read; dst, the vector
written, which may be src; recv, scratch), message for message and operand for operand, so a
run gives the plain algorithm's bits and counts its messages and bytes:

    ring_allreduce_steps       reduce-scatter (p - 1 steps: send, receive, dst[t] = recv ⊕ src[t])
                               then allgather (p - 1 steps on dst), Baidu's table in ring.py
    doubling_allreduce_steps   lg p exchanges of the whole vector, low rank's operand first
                               (p a power of two; the fold is the plain path's)
    ring_reduce_scatter_steps  the first half of the ring, partial sums through one chunk
    halving_reduce_scatter_steps   lg p exchanges of halves (p a power of two)
    ring_allgather_steps       the second half of the ring, in place
    doubling_allgather_steps   lg p exchanges of what a rank holds so far (p a power of two)
    tree_broadcast_steps       a receive from the parent, then one send to each child at once

fast_path.py and fast_collectives.py lay them on a plan's own buffers (staged: the call
copies x in and the result out) or on the caller's arrays themselves (bound: no copies).
"""

from mpi4py import MPI

from minidp.comm.errors import MessageSizeMismatch
from minidp.comm.p2p import BYTE, DATA_TAG, truncates
from minidp.comm.reduce_ops import _UFUNC
from minidp.comm.tree import _below, _parent_mask
from minidp.tools.chunks import chunk_bounds

_startall, _waitall = MPI.Prequest.Startall, MPI.Request.Waitall  # looked up once


class Steps:
    """A schedule of steps on persistent requests over fixed buffers; `run` runs them all."""

    def __init__(self, group) -> None:
        self.comm = group.comm
        self.steps: list[tuple] = []
        self.statuses = [MPI.Status(), MPI.Status()]
        self.sent = self.received = self.messages = 0

    def add(self, send, dest, got=None, source=None, combine=None) -> None:
        """One step: send `send` to dest (a rank, or a list of ranks: to each at once, as
        tree.py's Isends; send None: no send) while receiving `got` from source (got None:
        no receive); then combine, (ufunc, a, b, out), if given."""
        comm = self.comm
        dests = [] if send is None else dest if isinstance(dest, list) else [dest]
        requests = [] if got is None else [comm.Recv_init([got, BYTE], source, DATA_TAG)]
        requests += [comm.Send_init([send, BYTE], d, DATA_TAG) for d in dests]
        nbytes = None if got is None else got.nbytes  # the receive, first of the requests
        self.steps.append((requests, nbytes, dests if got is None else source, combine))
        self.sent += 0 if send is None else send.nbytes * len(dests)
        self.received += 0 if got is None else got.nbytes
        self.messages += len(dests)

    def run(self, group) -> None:
        """Every step, in order: the messages of the plain algorithm, counted as p2p counts,
        each receive's size checked as p2p checks it."""
        counts, statuses = group.current, self.statuses
        counts[1] += self.sent
        counts[2] += self.received
        counts[3] += self.messages
        received = statuses[0]
        for requests, nbytes, peer, combine in self.steps:
            group.waiting_on = peer  # for the watchdog (watchdog.py)
            _startall(requests)
            try:
                _waitall(requests, statuses)  # statuses grows to the step's requests
            except MPI.Exception as error:  # MPI truncated the receive, or another error
                if nbytes is not None and truncates(error, received):
                    raise MessageSizeMismatch(group.size_message(peer, nbytes, None)) from error
                raise
            if nbytes is not None and received.Get_count(BYTE) != nbytes:
                got = received.Get_count(BYTE)
                raise MessageSizeMismatch(group.size_message(peer, nbytes, got))
            if combine is not None:
                ufunc, a, b, out = combine
                ufunc(a, b, out)  # out=out, passed by position (a keyword costs a lookup)

    def free(self) -> None:
        for requests, *_ in self.steps:
            for request in requests:
                request.Free()
        self.steps = []


def _ring_reduce(steps, group, src, b, recv, targets, op: str) -> None:
    """ring.py's ring_reduce_scatter: at step k the chunk t arriving from the left is added
    to src's chunk t into targets[k] (recv ⊕ src[t]), which is what the rank sends next."""
    p, r, ufunc = group.size, group.rank, _UFUNC[op]
    s = (r - 1) % p
    sending = src[b[s] : b[s + 1]]
    for k, target in enumerate(targets):
        t = (r - k - 2) % p  # the chunk arriving from the left at this step
        received = recv[: b[t + 1] - b[t]]
        combine = (ufunc, received, src[b[t] : b[t + 1]], target)
        steps.add(sending, group.right, received, group.left, combine)
        sending = target  # what we add now is what we pass on next step


def _ring_gather(steps, group, buf, b) -> None:
    """ring.py's ring_allgather (shift 0) on buf: at step k send chunk r - k, receive r - k - 1."""
    p, r = group.size, group.rank
    for k in range(p - 1):
        s, t = (r - k) % p, (r - k - 1) % p
        steps.add(buf[b[s] : b[s + 1]], group.right, buf[b[t] : b[t + 1]], group.left)


def ring_allreduce_steps(group, src, dst, recv, op: str) -> Steps:
    """ring.py's ring_allreduce: reduce-scatter into dst, then allgather of dst."""
    p, r = group.size, group.rank
    b = chunk_bounds(src.size, p)
    steps = Steps(group)
    chunks = [(r - k - 2) % p for k in range(p - 1)]
    _ring_reduce(steps, group, src, b, recv, [dst[b[t] : b[t + 1]] for t in chunks], op)
    _ring_gather(steps, group, dst, b)
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


# ---- reduce_scatter, allgather, broadcast (fast_collectives.py) -----------------------------
def ring_reduce_scatter_steps(group, src, dst, recv, partial, op: str) -> Steps:
    """ring.py's ring_reduce_scatter(full=False): the partial sums pass through `partial`
    (one chunk of scratch), the last one lands in dst, this rank's chunk."""
    p = group.size
    steps, b = Steps(group), chunk_bounds(src.size, p)
    chunks = [(group.rank - k - 2) % p for k in range(p - 1)]
    targets = [partial[: b[t + 1] - b[t]] for t in chunks[:-1]] + [dst]
    _ring_reduce(steps, group, src, b, recv, targets, op)
    return steps


def halving_reduce_scatter_steps(group, src, dst, recv, acc, op: str) -> Steps:
    """recursive.py's halving_reduce_scatter_chunks for p a power of two (no fold): each step
    sends the half of the range that the partner keeps and adds the half received into acc
    (received ⊕ current); the last step's sum, this rank's chunk, lands in dst (the plain
    path sums it into acc and copies it: the same bits)."""
    p, v, ufunc = group.size, group.rank, _UFUNC[op]
    b = chunk_bounds(src.size, p)
    steps, current, lo, hi, mask = Steps(group), src, 0, p, p // 2
    while mask:
        partner = v ^ mask
        low, high = (lo, lo + mask), (lo + mask, hi)
        keep, give = (low, high) if v < partner else (high, low)
        k0, k1, g0, g1 = b[keep[0]], b[keep[1]], b[give[0]], b[give[1]]
        received = recv[: k1 - k0]
        target = dst if mask == 1 else acc[k0:k1]
        combine = (ufunc, received, current[k0:k1], target)
        steps.add(current[g0:g1], partner, received, partner, combine)
        current, (lo, hi), mask = acc, keep, mask // 2
    return steps


def ring_allgather_steps(group, buf) -> Steps:
    """ring.py's ring_allgather in place on buf (rank r's chunk of chunk_bounds filled)."""
    steps = Steps(group)
    _ring_gather(steps, group, buf, chunk_bounds(buf.size, group.size))
    return steps


def doubling_allgather_steps(group, buf) -> Steps:
    """recursive.py's doubling_allgather_chunks for p a power of two (no fold): at mask m,
    exchange the aligned block of m chunks held so far with partner r ^ m."""
    p, v = group.size, group.rank
    b, steps, mask = chunk_bounds(buf.size, p), Steps(group), 1
    while mask < p:
        partner = v ^ mask
        mine, theirs = v // mask * mask, partner // mask * mask
        got = buf[b[theirs] : b[theirs + mask]]
        steps.add(buf[b[mine] : b[mine + mask]], partner, got, partner)
        mask *= 2
    return steps


def tree_broadcast_steps(group, buf, root: int) -> Steps:
    """tree.py's binomial_broadcast: receive buf from the parent (not on the root), then send
    it to every child at once (v + mask/2, v + mask/4, ..., those below p)."""
    p = group.size
    v = (group.rank - root) % p
    mask, steps = _parent_mask(v, p), Steps(group)
    if v:
        steps.add(None, None, buf, (v - mask + root) % p)
    children = [(v + m + root) % p for m in _below(mask) if v + m < p]
    if children:
        steps.add(buf, children)
    return steps
