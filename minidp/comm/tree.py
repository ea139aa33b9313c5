"""Binomial trees: broadcast, reduce, scatter and gather in ceil(lg p) rounds.

Ranks are numbered relative to the root, v = (rank - root) mod p. In a binomial tree the
parent of v is v with its lowest set bit cleared, and v's subtree is [v, v + lowbit(v)):

    p = 8, root 0        round 0: 0→4        broadcast: a rank receives from its parent,
         0                round 1: 0→2, 4→6   then sends to children v + 4, v + 2, v + 1
       / | \\             round 2: 0→1, 2→3,  (those below p). reduce runs the same tree
      4  2  1                     4→5, 6→7    upwards, each parent adding its children.
     / \\  \\
    6   5  3                                   Thakur, Rabenseifner & Gropp (2005):
    |                                          broadcast, reduce  ceil(lg p)·(α + nβ) (+ nγ)
    7                                          scatter, gather    ceil(lg p)α + (p-1)/p·nβ

Scatter and gather move subtrees: v receives (or sends) the chunks [v, v + lowbit(v)) in one
message, so the root sends half the data first, then a quarter, and so on. Chunks are in
relative order here (chunk v belongs to relative rank v); callers with real-rank order and a
root other than 0 rotate first.

`tree_allreduce` is a binomial reduce to rank 0 followed by a binomial broadcast:
2ceil(lg p)·(α + nβ) + ceil(lg p)·nγ, simple and bitwise-identical (one rank computes).
"""

import numpy as np

from minidp.comm.p2p import isend, recv, send, waitall
from minidp.comm.reduce_ops import combine
from minidp.tools.chunks import Bounds


def _relative(group, root: int) -> tuple[int, int]:
    return group.size, (group.rank - root) % group.size


def _parent_mask(v: int, p: int) -> int:
    """lowbit(v) for v > 0; for the root, the first power of two >= p."""
    mask = 1
    while mask < p and not v & mask:
        mask <<= 1
    return mask


def binomial_broadcast(group, buf: np.ndarray, root: int) -> None:
    """buf of the root reaches every rank; children are served with concurrent Isends."""
    p, v = _relative(group, root)
    mask = _parent_mask(v, p)
    if v:
        recv(group, buf, (v - mask + root) % p)
    children = [(v + m + root) % p for m in _below(mask) if v + m < p]
    waitall(group, [isend(group, buf, c) for c in children], children)


def _below(mask: int):
    """mask/2, mask/4, ..., 1."""
    mask >>= 1
    while mask:
        yield mask
        mask >>= 1


def binomial_reduce(group, src: np.ndarray, acc: np.ndarray, root: int, op: str) -> None:
    """Reduce to the root. acc is a whole vector (it may be src): the result on the root,
    a partial sum elsewhere. Children are added in a fixed order, so runs are repeatable."""
    p, v = _relative(group, root)
    received = group.scratch.get("tree.recv", src.size, src.dtype)
    current, mask = src, 1
    while mask < p:
        if v & mask:
            send(group, current, (v - mask + root) % p)
            return
        if v + mask < p:
            recv(group, received, (v + mask + root) % p)
            combine(op, received, current, out=acc)
            current = acc
        mask <<= 1


def binomial_scatter(group, buf: np.ndarray, bounds: Bounds, root: int, offset: int = 0) -> None:
    """The root's chunks (relative order) reach their ranks; buf[i] is element offset + i.

    On the root buf holds every chunk; on rank v it must hold at least v's subtree,
    chunks [v, v + lowbit(v)), which it receives in one message and partly passes on.
    """
    p, v = _relative(group, root)
    mask = _parent_mask(v, p)
    if v:
        recv(
            group,
            buf[bounds[v] - offset : bounds[min(v + mask, p)] - offset],
            (v - mask + root) % p,
        )
    requests, peers = [], []
    for m in _below(mask):
        if v + m < p:
            piece = buf[bounds[v + m] - offset : bounds[min(v + 2 * m, p)] - offset]
            requests.append(isend(group, piece, (v + m + root) % p))
            peers.append((v + m + root) % p)
    waitall(group, requests, peers)


def binomial_gather(group, buf: np.ndarray, bounds: Bounds, root: int, offset: int = 0) -> None:
    """Every rank's chunk (relative order) reaches the root; the reverse of the scatter."""
    p, v = _relative(group, root)
    mask = 1
    while mask < p:
        if v & mask:
            send(
                group,
                buf[bounds[v] - offset : bounds[min(v + mask, p)] - offset],
                (v - mask + root) % p,
            )
            return
        if v + mask < p:
            recv(
                group,
                buf[bounds[v + mask] - offset : bounds[min(v + 2 * mask, p)] - offset],
                (v + mask + root) % p,
            )
        mask <<= 1


def subtree_chunks(p: int, v: int) -> tuple[int, int]:
    """[first, last) relative chunks that relative rank v holds during a binomial scatter."""
    return v, (min(v + _parent_mask(v, p), p) if v else p)


def tree_allreduce(group, src: np.ndarray, out: np.ndarray, op: str) -> None:
    """Binomial reduce to rank 0 (partial sums in out), then binomial broadcast of out."""
    binomial_reduce(group, src, out, 0, op)
    binomial_broadcast(group, out, 0)
