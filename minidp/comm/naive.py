"""Linear ("naive") algorithms: one rank talks to every other, one message each.

The first thing anyone writes, and the baseline the others beat:

    gather      every rank sends its piece to the root      (p-1)α + (p-1)·nβ at the root
    scatter     the root sends each rank its piece           the same, outwards
    reduce      the root receives p-1 vectors, adds them     (p-1)(α + nβ + nγ)
                one by one in rank order
    broadcast   the root sends the vector p-1 times          (p-1)(α + nβ)
    allreduce   reduce to rank 0, then broadcast             2(p-1)(α + nβ) + (p-1)nγ
    reduce_scatter, allgather: the same through rank 0, plus a scatter or a gather

The root's link carries everything, so time grows linearly with p (here n is a rank's
piece for gather/scatter, the whole vector otherwise). It is correct, easy to check, and
fine for two or three ranks.
"""

import numpy as np

from minidp.comm.args import same_memory
from minidp.comm.p2p import irecv, isend, recv, send, waitall
from minidp.comm.reduce_ops import combine
from minidp.tools.chunks import Bounds


def _others(group, root: int) -> list[int]:
    return [i for i in range(group.size) if i != root]


def linear_broadcast(group, buf: np.ndarray, root: int) -> None:
    if group.rank != root:
        recv(group, buf, root)
        return
    others = _others(group, root)
    waitall(group, [isend(group, buf, i) for i in others], others)


def linear_reduce(group, src: np.ndarray, acc: np.ndarray, root: int, op: str) -> None:
    """acc on the root = x_root ⊕ x_0 ⊕ x_1 ⊕ ... (the others in rank order)."""
    if group.rank != root:
        send(group, src, root)
        return
    received = group.scratch.get("naive.recv", src.size, src.dtype)
    current = src
    for i in range(group.size):
        if i == root:
            continue
        recv(group, received, i)
        combine(op, current, received, out=acc)
        current = acc


def linear_gather(
    group, mine: np.ndarray, buf: np.ndarray | None, bounds: Bounds, root: int
) -> None:
    """Rank i's `mine` lands in buf[bounds[i]:bounds[i+1]] on the root (Irecvs all posted)."""
    if group.rank != root:
        send(group, mine, root)
        return
    others = _others(group, root)
    requests = [irecv(group, buf[bounds[i] : bounds[i + 1]], i) for i in others]
    there = buf[bounds[root] : bounds[root + 1]]
    if not same_memory(mine, there):  # naive_allgather's root: already in place
        np.copyto(there, mine)
    waitall(group, requests, others)


def linear_scatter(
    group, buf: np.ndarray | None, bounds: Bounds, mine: np.ndarray, root: int
) -> None:
    """The root's buf[bounds[i]:bounds[i+1]] lands in rank i's `mine`."""
    if group.rank != root:
        recv(group, mine, root)
        return
    others = _others(group, root)
    requests = [isend(group, buf[bounds[i] : bounds[i + 1]], i) for i in others]
    np.copyto(mine, buf[bounds[root] : bounds[root + 1]])
    waitall(group, requests, others)


def naive_allreduce(group, src: np.ndarray, out: np.ndarray, op: str) -> None:
    """Everything to rank 0, added there in rank order, then sent back to each rank."""
    linear_reduce(group, src, out, 0, op)
    linear_broadcast(group, out, 0)


def naive_reduce_scatter(group, src: np.ndarray, bounds: Bounds, op: str, out: np.ndarray) -> None:
    """Reduce everything to rank 0, which sends each rank its chunk."""
    acc = group.scratch.get("naive.acc", src.size, src.dtype)
    linear_reduce(group, src, acc, 0, op)
    linear_scatter(group, acc, bounds, out, 0)


def naive_allgather(group, buf: np.ndarray, bounds: Bounds) -> None:
    """Every chunk to rank 0 (in place in buf), then rank 0 sends buf to everyone."""
    r = group.rank
    linear_gather(group, buf[bounds[r] : bounds[r + 1]], buf, bounds, 0)
    linear_broadcast(group, buf, 0)
