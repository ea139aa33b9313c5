"""Ring attention: the keys and values travel around the ring, the queries stay at home.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context". Each of the C ranks of a context-parallel group holds T/C positions of q, k and v
(layout.py: contiguous or zig-zag). Attention needs every query against every earlier key,
so the K/V blocks go round: at step s rank r computes with the block that started on rank
r - s, while it passes that block on to rank r + 1 and receives the next from rank r - 1.
The receive and the send are posted before the compute (`isend` / `irecv`), so the message
travels while the block is computed. C = 4, contiguous (K/V_j: rank j's block):

    step   rank 0    rank 1    rank 2    rank 3      rank r holds block (r - s) mod C
      0    KV0 d     KV1 d     KV2 d     KV3 d       d: the diagonal block, masked by position
      1    KV3 -     KV0       KV1       KV2         -: wholly in the future, skipped
      2    KV2 -     KV3 -     KV0       KV1
      3    KV1 -     KV2 -     KV3 -     KV0         (no step 4: C - 1 hops)

      rank 0 --KV--> rank 1 --KV--> rank 2 --KV--> rank 3 --KV--> rank 0

The partial results of the blocks merge with the online softmax (online_softmax.py). A
block wholly in the future is still passed on (a later rank needs it) but not computed:
contiguous, rank 0 computes 1 block and rank C-1 all C; zig-zag evens that out (layout.py).

Backward (FlashAttention-2 style, chosen over keeping every block's probabilities, which
would keep T/C x T scores per rank): forward keeps only y and each query's log-sum-exp L, and
backward sends the K/V blocks round the ring again, each with its gradient accumulator
dK/dV beside it. At step s rank r recomputes the block's P from L, adds its dq to its own
and the block's dK, dV to the accumulator, and passes the accumulator on after computing
(the K/V block, as in forward, before). After C steps (one hop more than the K/V) each
accumulator is back with the rank that owns the block, holding every rank's share.

Cost per call and rank in the α-β model, with m = 2 B (T/C) C' w the bytes of a K/V block
(C' = n_embd, w bytes a number): forward (C-1)(α + m β); backward (C-1) K/V blocks and C
dK/dV accumulators, (2C-1)(α + m β); each hop hidden behind a block's compute when the
compute is the longer. `ring_bytes` says it; the tests check it against the group's counters
(the messages are point-to-point, outside any collective: the counters' "p2p").
"""

import math
from dataclasses import dataclass

import numpy as np

from minidp.comm import Group
from minidp.comm.p2p import irecv, isend, waitall, waitall_within
from minidp.engine.tensor import Tensor, op
from minidp.parallel.context_parallel.layout import SequenceLayout
from minidp.parallel.context_parallel.online_softmax import (
    OnlineSoftmax,
    block_backward,
    future_mask,
    scores,
)

KV_TAG, GRAD_TAG = 7201, 7202  # the K/V blocks and the dK/dV accumulators, apart


@dataclass
class RingWork:
    """Score elements (one per query-key pair computed, over batch and heads) on this rank."""

    forward: int = 0
    backward: int = 0


def ring_bytes(qkv_shape: tuple, itemsize: int, ranks: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per ring_attention call on a (B, T/C, 3C')
    qkv: C-1 K/V blocks forward; C-1 K/V blocks and C dK/dV accumulators backward."""
    B, t, C3 = qkv_shape
    block = 2 * B * t * (C3 // 3) * itemsize
    return (ranks - 1) * block, (2 * ranks - 1) * block if ranks > 1 else 0


def _wait(group: Group, requests: list, peers: list[int]) -> None:
    """Wait for the step's messages, within the group's deadline if it has one (these are
    point-to-point messages outside any collective, as a pipeline stage's are)."""
    if group.timeout is None:
        waitall(group, requests, peers)
    else:
        waitall_within(group, requests, peers, group.timeout)


def _split(qkv: np.ndarray, n_head: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(q s as (B, H, t, hs), K/V as one contiguous (2, B, H, t, hs) block, s)."""
    B, t, C3 = qkv.shape
    hs = C3 // 3 // n_head
    heads = qkv.reshape(B, t, 3, n_head, hs)
    scale = 1.0 / math.sqrt(hs)
    qs = heads[:, :, 0].transpose(0, 2, 1, 3) * scale
    kv = np.ascontiguousarray(heads[:, :, 1:].transpose(2, 0, 3, 1, 4))
    return qs, kv, scale


def _blocks(layout: SequenceLayout, rank: int, source: int, positions: list):
    """(rows, cols, mask or None) of each query x key block rank computes with source's K/V."""
    for rows, cols, masked in layout.causal_blocks(rank, source):
        mask = future_mask(positions[rank][rows], positions[source][cols]) if masked else None
        yield rows, cols, mask


def ring_attention(
    qkv: Tensor, n_head: int, group: Group, layout: SequenceLayout, work: RingWork | None = None
) -> Tensor:
    """Causal attention of this rank's positions against the whole sequence, as one op.

    qkv: (B, T/C, 3C') the packed projections of this rank's rows (layout.positions(rank));
    returns (B, T/C, C'), heads merged, as gpt.attention does for the whole sequence. Every
    rank of `group` calls it together, with the same shapes and layout (a collective).
    `work`, if given, counts the score elements computed (forward and backward)."""
    p, me = group.size, group.rank
    if layout.ranks != p or qkv.shape[1] != layout.local_T:
        raise ValueError(
            f"ring_attention: layout of {layout.ranks} ranks x {layout.local_T} positions, "
            f"group of {p}, qkv {qkv.shape}"
        )
    B, t, C3 = qkv.shape
    qs, kv, _ = _split(qkv.data, n_head)
    positions = [layout.positions(r) for r in range(p)]
    state = OnlineSoftmax(B, n_head, t, C3 // 3 // n_head, qkv.dtype)
    current, arriving = kv, np.empty_like(kv)
    for step in range(p):
        source = (me - step) % p  # whose K/V block this rank holds now
        requests = []
        if step < p - 1:  # the next block on its way while this one is computed
            requests = [
                irecv(group, arriving, group.left, KV_TAG),
                isend(group, current, group.right, KV_TAG),
            ]
        for rows, cols, mask in _blocks(layout, me, source, positions):
            S = scores(qs[..., rows, :], current[0][..., cols, :], mask)
            state.add(rows, S, current[1][..., cols, :])
            if work is not None:
                work.forward += S.size
        if requests:
            _wait(group, requests, [group.left, group.right])
        current, arriving = arriving, current
    a, lse = state.result()
    y = np.ascontiguousarray(a.transpose(0, 2, 1, 3)).reshape(B, t, C3 // 3)

    def backward(g):
        return (_ring_backward(qkv.data, n_head, group, layout, positions, y, lse, g, work),)

    return op(y, (qkv,), backward)


def _ring_backward(qkv, n_head, group, layout, positions, y, lse, g, work) -> np.ndarray:
    """dL/dqkv: the K/V blocks round the ring again, each with its dK/dV accumulator."""
    p, me = group.size, group.rank
    B, t, C3 = qkv.shape
    H, hs = n_head, C3 // 3 // n_head
    qs, kv, scale = _split(qkv, n_head)  # recomputed: forward kept only y and L
    dy = g.reshape(B, t, H, hs).transpose(0, 2, 1, 3)
    D = (g * y).reshape(B, t, H, hs).sum(axis=-1).transpose(0, 2, 1)  # rowsum(dy y)
    dq = np.zeros_like(qs)
    current, arriving = kv, np.empty_like(kv)
    grads, grads_arriving = np.zeros_like(kv), np.empty_like(kv)  # dK/dV of `current`
    for step in range(p):
        source = (me - step) % p
        requests, peers = [], []
        if p > 1:  # the accumulator of the next block (at the last step: my own, home)
            requests.append(irecv(group, grads_arriving, group.left, GRAD_TAG))
            peers.append(group.left)
        if step < p - 1:
            requests += [
                irecv(group, arriving, group.left, KV_TAG),
                isend(group, current, group.right, KV_TAG),
            ]
            peers += [group.left, group.right]
        for rows, cols, mask in _blocks(layout, me, source, positions):
            k, v = current[0][..., cols, :], current[1][..., cols, :]
            S = scores(qs[..., rows, :], k, mask)
            dSk, dk, dv = block_backward(
                S, lse[..., rows], dy[..., rows, :], D[..., rows], qs[..., rows, :], k, v
            )
            dq[..., rows, :] += dSk
            grads[0][..., cols, :] += dk
            grads[1][..., cols, :] += dv
            if work is not None:
                work.backward += S.size
        if p > 1:  # this block's accumulator on to the next rank, now it holds my share
            requests.append(isend(group, grads, group.right, GRAD_TAG))
            peers.append(group.right)
            _wait(group, requests, peers)
            grads, grads_arriving = grads_arriving, grads
        current, arriving = arriving, current
    dqkv = np.empty((B, t, 3, H, hs), dtype=qkv.dtype)
    dqkv[:, :, 0] = (dq * scale).transpose(0, 2, 1, 3)
    dqkv[:, :, 1:] = grads.transpose(1, 3, 0, 2, 4)  # (2, B, H, t, hs) -> (B, t, 2, H, hs)
    return dqkv.reshape(B, t, C3)
