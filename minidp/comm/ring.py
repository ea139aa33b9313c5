"""The ring: reduce-scatter, then allgather, each in p - 1 steps around the ring.

Baidu's ring allreduce (Gibiansky, "Bringing HPC techniques to deep learning", 2017; the
same algorithm as Patarasuk & Yuan 2009). The vector is cut into p chunks (chunks.py);
at every step each rank sends one chunk to its right neighbour and receives one from its
left, so every link carries n/p elements per step, whatever p is.

    rank 0 ──► rank 1 ──► rank 2 ──► rank 3 ──┐
      ▲                                       │
      └───────────────────────────────────────┘

Reduce-scatter, p = 4 (chunk sent by each rank at step k; the receiver adds it to its own):

    step k   rank 0   rank 1   rank 2   rank 3      rank r sends chunk (r - k - 1) mod p
      0        3        0        1        2         and receives chunk (r - k - 2) mod p
      1        2        3        0        1
      2        1        2        3        0         after p - 1 steps rank r holds
                                                    chunk r summed over all p ranks
Allgather, p = 4 (chunk sent at step k; the receiver stores it):

    step k   rank 0   rank 1   rank 2   rank 3      rank r sends chunk (r - k) mod p
      0        0        1        2        3
      1        3        0        1        2         after p - 1 steps every rank
      2        2        3        0        1         holds every chunk

Each chunk is summed by exactly one owner and then copied, so every rank ends with the same
bits. Cost in the α-β-γ model of Thakur, Rabenseifner & Gropp (2005), n bytes:

    reduce-scatter   (p-1)α + (p-1)/p·nβ + (p-1)/p·nγ
    allgather        (p-1)α + (p-1)/p·nβ
    allreduce       2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ     bandwidth-optimal; latency grows
                                                          with p, so short messages lose
"""

import numpy as np

from minidp.comm.p2p import sendrecv
from minidp.comm.reduce_ops import combine
from minidp.tools.chunks import Bounds, chunk_bounds


def ring_reduce_scatter(
    group, src: np.ndarray, bounds: Bounds, op: str, out: np.ndarray, full: bool
) -> None:
    """Ring reduce-scatter of flat src; rank r's reduced chunk r lands in out.

    full=True: out is a whole vector like src (it may be src) and partial sums are kept in
    place in it, as allreduce wants. full=False: out is just chunk r; partial sums pass
    through one scratch chunk, so src is only read.
    """
    p, r = group.size, group.rank
    recv_all = group.scratch.get("ring.recv", bounds[1] - bounds[0], src.dtype)
    partial = None if full else group.scratch.get("ring.partial", bounds[1] - bounds[0], src.dtype)
    s = (r - 1) % p
    sending = src[bounds[s] : bounds[s + 1]]
    for k in range(p - 1):
        t = (r - k - 2) % p  # the chunk arriving from the left at this step
        lo, hi = bounds[t], bounds[t + 1]
        received = recv_all[: hi - lo]
        sendrecv(group, sending, group.right, received, group.left)
        if full:
            target = out[lo:hi]
        else:
            target = out if k == p - 2 else partial[: hi - lo]
        combine(op, received, src[lo:hi], out=target)
        sending = target  # what we add now is what we pass on next step


def ring_allgather(group, buf: np.ndarray, bounds: Bounds, shift: int = 0) -> None:
    """Ring allgather in place: rank r starts with chunk (r - shift) mod p of buf filled."""
    p, r = group.size, group.rank
    for k in range(p - 1):
        s, t = (r - shift - k) % p, (r - shift - k - 1) % p
        sendrecv(
            group,
            buf[bounds[s] : bounds[s + 1]],
            group.right,
            buf[bounds[t] : bounds[t + 1]],
            group.left,
        )


def ring_allreduce(group, src: np.ndarray, out: np.ndarray, op: str) -> None:
    """Baidu's ring: ring_reduce_scatter into out, then ring_allgather of out."""
    bounds = chunk_bounds(src.size, group.size)
    ring_reduce_scatter(group, src, bounds, op, out, full=True)
    ring_allgather(group, out, bounds)
