"""Causal self-attention as one op, its backward written out: one of the fused ops of
fused.py (whose helpers it uses), in a file of its own for the three ideas it carries.

1. The softmax's backward without a pass over the (T, T) arrays: FlashAttention's
   D = rowsum(dy ∘ y) (Dao et al., 2022) in place of rowsum(dP ∘ P).
2. Products written straight into their places with matmul's `out`: heads merged on the
   way out, dq, dk, dv into one packed array on the way back.
3. Cache blocking over the batch (fused.blocks): the (T, T) scores of a few sequences at a
   time, in cache from their product to the products after them.

The composed version, op by op, is gpt.composed_attention: the reference this one is
checked against (tests/test_autograd.py: the composed graph, float64 differences, PyTorch).
"""

import math

import numpy as np

from minidp.engine.tensor import Tensor, op
from minidp.fast.fused import blocks, row_sums

__all__ = ["causal_self_attention"]


def causal_self_attention(qkv: Tensor, n_head: int, future: np.ndarray) -> Tensor:
    """Multi-head causal attention from the packed projections: (B, T, 3C) -> (B, T, C).

    Per head (q, k, v: (T, hs) each, views into qkv; s = 1/sqrt(hs); M the future):
        S = q k^T s,  S[M] = -inf,  P = softmax(S) (over each row),  y = P v
    backward, with dy from the head-merged g:
        dP = dy v^T,  dv = P^T dy
        dS = P (dP - D) s,  D = rowsum(dP P)     (softmax's Jacobian; 0 where masked)
        dq = dS k,    dk = dS^T q
    D needs no pass over the (T, T) arrays: rowsum(dP P) = sum over keys of P (dy v^T)
    = dy · (P v) = rowsum(dy y), a product of two (T, hs) arrays (FlashAttention's D).
    The products write straight into their places (matmul's `out`): y into its (B, T, C)
    array with heads merged, dq, dk, dv into one (B, T, 3C) array, the gradient of the packed
    projections, where the composed split made a zeroed (B, T, 3C) array for each part and
    added them. P is kept for backward, and y, which the Linear after this op keeps anyway
    (the composed graph keeps S, P, the masked copy).
    The scale s is applied to q (and to dq), a quarter of S's size at the default shapes,
    not to S and dS: for hs = 16, s = 1/4, exact, so the same bits as scaling S.

    One layout trick: S is held transposed, S^T = k q^T s (a matrix product computes either
    at the same cost), so softmax's max and sums run down the columns of S^T, along
    NumPy's fast axis (a max along the last axis is slower: docs/memory.md). The same
    numbers to rounding as the composed graph (sums in another order).

    Cache blocking (fused.blocks): forward and backward run a few sequences at a time,
    each block's (H, T, T) arrays (a quarter MiB at the default shapes) staying in cache
    through the product, mask, softmax and products after it; backward reuses one block's
    scratch for dS. Each sequence's numbers do not depend on the blocks: the same bits."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    heads = qkv.data.reshape(B, T, 3, n_head, hs)  # a view
    q, k, v = (heads[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (B, H, T, hs)
    scale = 1.0 / math.sqrt(hs)
    qs = q * scale  # s folded into q: a pass over (B, T, C), not over S's (B, H, T, T)
    Pt = np.empty((B, n_head, T, T), dtype=qs.dtype)  # S^T, then P^T: (keys, queries)
    y = np.empty((B, T, C), dtype=qs.dtype)
    y_heads = y.reshape(B, T, n_head, hs)  # a view: heads merged as the product writes
    ones = np.ones(T, dtype=qs.dtype)
    # the mask as a cap: -inf where the key comes after the query, +inf elsewhere. fmin
    # (not min) takes the number over a NaN: a NaN score in the future becomes -inf, as
    # masked_fill makes it, and one in the past +inf, whose query softmax makes NaN either
    # way; finite scores keep their bits. (Twice as fast as np.copyto with `where`.)
    cap = np.where(future[:T, :T].T, -np.inf, np.inf).astype(qs.dtype)
    for s in blocks(Pt):  # a few sequences at a time, their (T, T) arrays in cache
        P = np.matmul(k[s], qs[s].swapaxes(-1, -2), out=Pt[s])  # S^T = k q^T s
        np.fmin(P, cap, out=P)  # the future masked
        P -= P.max(axis=-2, keepdims=True)  # shift: no overflow
        np.exp(P, out=P)
        P /= (ones @ P)[..., None, :]  # each query's sum over keys
        np.matmul(P.swapaxes(-1, -2), v[s], out=y_heads[s].transpose(0, 2, 1, 3))

    def backward(g):
        g_heads = g.reshape(B, T, n_head, hs)
        dy = g_heads.transpose(0, 2, 1, 3)  # a view
        D = row_sums(g_heads * y_heads).transpose(0, 2, 1)  # rowsum(dy y): (B, H, T queries)
        dqkv = np.empty(qkv.shape, dtype=g.dtype)
        dq, dk, dv = (dqkv.reshape(B, T, 3, n_head, hs)[:, :, i] for i in range(3))
        dq, dk, dv = (d.transpose(0, 2, 1, 3) for d in (dq, dk, dv))  # (B, H, T, hs) views
        spans = blocks(Pt)
        scratch = np.empty_like(Pt[spans[0]])  # one block's dS^T, reused
        for s in spans:
            P = Pt[s]
            dSt = np.matmul(v[s], dy[s].swapaxes(-1, -2), out=scratch[: len(P)])  # dP^T
            dSt -= D[s][..., None, :]
            dSt *= P  # 0 where masked: P is 0 there; dS / s: s goes on dq and dk below
            np.matmul(P, dy[s], out=dv[s])  # P^T dy
            np.matmul(dSt, qs[s], out=dk[s])  # dS^T q s
            np.matmul(dSt.swapaxes(-1, -2), k[s], out=dq[s])
        dq *= scale  # s dS k
        return (dqkv,)

    return op(y, (qkv,), backward)
