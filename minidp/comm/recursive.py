"""Butterflies: recursive doubling, recursive halving, and Rabenseifner's allreduce.

After Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 2005). Ranks pair up across a distance that doubles (or halves) each step,
so log2(p) steps replace the ring's p - 1.

Recursive doubling allreduce, p = 8: partners differ in one bit of the rank; each sends its
whole vector and combines it with the partner's, both computing lower ⊕ higher (the same
operands in the same order, so partners hold the same bits; see reduce_ops.py):

    step 0 (mask 1)  0↔1  2↔3  4↔5  6↔7       lg(p)·(α + nβ + nγ)
    step 1 (mask 2)  0↔2  1↔3  4↔6  5↔7       latency-optimal: for short messages
    step 2 (mask 4)  0↔4  1↔5  2↔6  3↔7

Recursive halving reduce-scatter, p = 4, blocks B0..B3: each step a rank keeps the half of
its range that holds its own block, sends the other half, adds the half it receives:

    step 0 (mask 2)  0↔2, 1↔3   0,1 keep B0B1, 2,3 keep B2B3     lg(p)α + (p-1)/p·n(β + γ)
    step 1 (mask 1)  0↔1, 2↔3   rank r keeps Br

Recursive doubling allgather runs the halving backwards (mask 1, 2, ...), each rank sending
everything it has so far: lg(p)α + (p-1)/p·nβ. Rabenseifner's allreduce is halving then
doubling: 2lg(p)α + 2(p-1)/p·nβ + (p-1)/p·nγ, the ring's bandwidth with lg(p) latency.

Groups that are not a power of two are folded first (the standard trick of the paper):
with p' the largest power of two <= p and rem = p - p', ranks 0..2rem-1 pair up; each even
one hands its data to the odd one above it and sits out, so p' "virtual" ranks remain:

    p = 6, p' = 4, rem = 2     real rank   0  1  2  3  4  5
                               virtual     -  0  -  1  2  3
    fold costs α + nβ (+ nγ) before, and α + nβ after to return the result
"""

import numpy as np

from minidp.comm.p2p import recv, send, sendrecv
from minidp.comm.reduce_ops import combine
from minidp.tools.chunks import Bounds, chunk_bounds


class Fold:
    """The fold of p ranks onto p' = 2^floor(lg p) virtual ranks (see the module doc)."""

    def __init__(self, p: int, rank: int) -> None:
        self.pof2 = 1 << (p.bit_length() - 1)
        self.rem = p - self.pof2
        self.sits_out = rank < 2 * self.rem and rank % 2 == 0  # hands its data to rank + 1
        self.takes_in = rank < 2 * self.rem and rank % 2 == 1  # also serves rank - 1
        self.virtual = rank // 2 if rank < 2 * self.rem else rank - self.rem

    def real(self, v: int) -> int:
        """Real rank of virtual rank v."""
        return 2 * v + 1 if v < self.rem else v + self.rem

    def first_chunk(self, v: int) -> int:
        """First of the real ranks' chunks that virtual rank v answers for (v <= p')."""
        return 2 * v if v < self.rem else v + self.rem


def halving_reduce_scatter(
    group, fold: Fold, src: np.ndarray, acc: np.ndarray, vbounds: Bounds, op: str
) -> None:
    """Recursive halving over the virtual ranks: acc[vb[v]:vb[v+1]] ends reduced.

    src is this rank's (folded) vector, only read; acc is a whole vector (it may be src).
    """
    v, lo, hi = fold.virtual, 0, fold.pof2
    received_all = group.scratch.get("rec.recv", src.size, src.dtype)
    current, mask = src, fold.pof2 // 2
    while mask:
        partner = v ^ mask
        keep, give = (
            ((lo, lo + mask), (lo + mask, hi))
            if v < partner
            else ((lo + mask, hi), (lo, lo + mask))
        )
        k0, k1, g0, g1 = vbounds[keep[0]], vbounds[keep[1]], vbounds[give[0]], vbounds[give[1]]
        received = received_all[: k1 - k0]
        sendrecv(group, current[g0:g1], fold.real(partner), received, fold.real(partner))
        combine(op, received, current[k0:k1], out=acc[k0:k1])
        current, (lo, hi), mask = acc, keep, mask // 2


def doubling_allgather(group, fold: Fold, buf: np.ndarray, vbounds: Bounds) -> None:
    """Recursive doubling over the virtual ranks, in place: v starts with buf[vb[v]:vb[v+1]]."""
    v, mask = fold.virtual, 1
    while mask < fold.pof2:
        partner = v ^ mask
        mine, theirs = v // mask * mask, partner // mask * mask  # aligned blocks of `mask`
        sendrecv(
            group,
            buf[vbounds[mine] : vbounds[mine + mask]],
            fold.real(partner),
            buf[vbounds[theirs] : vbounds[theirs + mask]],
            fold.real(partner),
        )
        mask *= 2


def _fold_in(group, fold: Fold, src: np.ndarray, out: np.ndarray, op: str) -> np.ndarray:
    """Odd ranks below 2rem add their even neighbour's vector into out; returns the vector
    this rank brings to the butterfly (src itself when nothing was folded in)."""
    if not fold.takes_in:
        return src
    received = group.scratch.get("rec.recv", src.size, src.dtype)
    recv(group, received, group.rank - 1)
    combine(op, received, src, out=out)
    return out


def _folded(group, src: np.ndarray, out: np.ndarray, op: str, butterfly) -> None:
    """Fold in, run butterfly(fold, vector) on the p' virtual ranks, hand the result back."""
    fold = Fold(group.size, group.rank)
    if fold.sits_out:
        send(group, src, group.rank + 1)
        recv(group, out, group.rank + 1)
        return
    butterfly(fold, _fold_in(group, fold, src, out, op))
    if fold.takes_in:
        send(group, out, group.rank - 1)


def recursive_doubling_allreduce(group, src: np.ndarray, out: np.ndarray, op: str) -> None:
    """Fold, lg(p') full-vector exchanges, unfold. See the module doc for the picture."""
    received = group.scratch.get("rec.recv", src.size, src.dtype)

    def butterfly(fold: Fold, current: np.ndarray) -> None:
        mask = 1
        while mask < fold.pof2:
            partner = fold.real(fold.virtual ^ mask)
            sendrecv(group, current, partner, received, partner)
            # both partners compute (lower rank's vector) op (higher rank's): the same bits
            # on both sides, even where a op b and b op a differ in bits (max of -0.0 and 0.0)
            low, high = (current, received) if fold.virtual & mask == 0 else (received, current)
            combine(op, low, high, out=out)
            current, mask = out, mask * 2

    _folded(group, src, out, op, butterfly)


def rabenseifner_allreduce(group, src: np.ndarray, out: np.ndarray, op: str) -> None:
    """Fold, recursive halving reduce-scatter, recursive doubling allgather, unfold."""

    def butterfly(fold: Fold, current: np.ndarray) -> None:
        vbounds = chunk_bounds(src.size, fold.pof2)
        halving_reduce_scatter(group, fold, current, out, vbounds, op)
        doubling_allgather(group, fold, out, vbounds)

    _folded(group, src, out, op, butterfly)


def halving_reduce_scatter_chunks(
    group, src: np.ndarray, bounds: Bounds, op: str, out: np.ndarray
) -> None:
    """reduce_scatter by recursive halving: this rank's chunk of chunk_bounds lands in out.

    Virtual rank v answers for the real chunks [first_chunk(v), first_chunk(v + 1)), so an
    odd rank below 2rem reduces its even neighbour's chunk too and sends it back.
    """
    fold, r = Fold(group.size, group.rank), group.rank
    if fold.sits_out:
        send(group, src, r + 1)
        recv(group, out, r + 1)
        return
    acc = group.scratch.get("rec.acc", src.size, src.dtype)
    current = _fold_in(group, fold, src, acc, op)
    vbounds = [bounds[fold.first_chunk(v)] for v in range(fold.pof2 + 1)]
    halving_reduce_scatter(group, fold, current, acc, vbounds, op)
    if fold.takes_in:
        send(group, acc[bounds[r - 1] : bounds[r]], r - 1)
    np.copyto(out, acc[bounds[r] : bounds[r + 1]])


def doubling_allgather_chunks(group, buf: np.ndarray, bounds: Bounds) -> None:
    """allgather by recursive doubling, in place: rank r starts with chunk r of buf."""
    fold, r = Fold(group.size, group.rank), group.rank
    if fold.sits_out:
        send(group, buf[bounds[r] : bounds[r + 1]], r + 1)
        recv(group, buf, r + 1)
        return
    if fold.takes_in:
        recv(group, buf[bounds[r - 1] : bounds[r]], r - 1)
    vbounds = [bounds[fold.first_chunk(v)] for v in range(fold.pof2 + 1)]
    doubling_allgather(group, fold, buf, vbounds)
    if fold.takes_in:
        send(group, buf, r - 1)
