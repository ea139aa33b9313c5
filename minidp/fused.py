"""Fused ops: LayerNorm (alone, or with the Linear after it), GELU, causal self-attention and
the embedding, each one graph node with its derivative written out beside its forward
(micrograd's way, on whole arrays).

The speed trick of docs/memory.md. Each op computes what a composed graph of small ops
computes, and is checked against it (tests/test_autograd.py: the composed graph, central
differences in float64, PyTorch). The composed versions stay where a reader meets them first
(`nn.LayerNorm(fused=False)` then `nn.linear`, `functional.gelu`, `gpt.composed_attention`,
indexing `weight[idx]`); `nn` and `gpt` call these by default, on NumPy data. What fusing
saves:

    op              composed                                  fused
    LayerNorm       11 nodes, 5 full-size arrays forward      1 node, the standard backward
    LayerNorm       2 ops; u = x̂ w + b made (2 passes),       1 node; w and b folded into
      + Linear      then u W; dx̂ = du w (1 more pass)         the (C, D) weight: no u
    GELU            9 temporaries forward, 13 backward        2 each way, 8 and 10 passes
    attention       split, 3 zeroed (B, T, 3C) in backward,   1 node; dq, dk, dv written into
                    mask + softmax 4 arrays each way          one (B, T, 3C) array; softmax
                                                              down S^T's columns (fast axis)
    embedding bwd   np.add.at (one row at a time)             sort the ids, np.add.reduceat

Fewer arrays means fewer bytes for the allocator to find and fewer pages to fault in
(allocator.py); fewer passes means less memory traffic; fewer nodes, less Python.
Where an op keeps the composed graph's exact order of operations it says so: then its bits
are the composed graph's (the tests check which).
"""

import math

import numpy as np

from minidp.autograd import Tensor, op

__all__ = [
    "fusable",
    "row_sums",
    "row_dots",
    "column_sums",
    "layer_norm",
    "layer_norm_linear",
    "gelu",
    "causal_self_attention",
    "embedding",
]


def fusable(*tensors: Tensor) -> bool:
    """The fused ops are written for NumPy arrays; on torch data (--backend torch) the
    composed graph runs instead."""
    return all(type(t.data) is np.ndarray for t in tensors)


def row_sums(a: np.ndarray) -> np.ndarray:
    """a.sum(axis=-1), as a matrix-vector product: BLAS sums short rows ~5x faster than
    NumPy's reduction (the same sum to rounding; a different order of additions)."""
    return a @ np.ones(a.shape[-1], dtype=a.dtype)


def row_dots(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a * b).sum(axis=-1) without the array a * b: np.vecdot (NumPy 2), else einsum."""
    return np.vecdot(a, b) if hasattr(np, "vecdot") else np.einsum("...i,...i->...", a, b)


def column_sums(a: np.ndarray) -> np.ndarray:
    """a.sum(axis=0) of a 2-D array, as a vector-matrix product (~3x faster here, the same
    sum to rounding)."""
    return np.ones(len(a), dtype=a.dtype) @ a


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """y = x̂ w + b, x̂ = (x - μ) / σ over the last axis (C), σ = sqrt(var + eps).

    Forward as the composed graph computes it, the mean as a matrix-vector product
    (`row_sums`), the sum of squares as `row_dots` (one pass, no array of squares).
    Backward, the standard formula (x̂ depends on x through μ and σ too):
        dx̂ = g w
        dx  = (dx̂ - mean(dx̂) - x̂ mean(dx̂ x̂)) / σ
        dw  = sum over rows of g x̂,   db = sum over rows of g
    where mean(dx̂) = (g · w) / C and mean(dx̂ x̂) = ((g x̂) · w) / C are matrix-vector
    products with w (g x̂ is dw's array already). Two full-size arrays forward (x̂, y), two
    backward (dx, one scratch); six passes over them backward."""
    C = x.shape[-1]
    X = x.data.reshape(-1, C)  # rows of C
    xhat = X - (row_sums(X) * (1.0 / C))[:, None]  # x - μ
    sigma = np.sqrt(row_dots(xhat, xhat) * (1.0 / C) + eps)[:, None]  # no array of squares
    xhat /= sigma  # in place: x - μ is needed no more
    y = xhat * weight.data
    y += bias.data

    def backward(g):
        G = g.reshape(-1, C)
        scratch = G * xhat
        dw = column_sums(scratch) if weight.requires_grad else None
        db = column_sums(G) if bias.requires_grad else None
        if not x.requires_grad:
            return None, dw, db
        # the row means of dx̂ = g w and of dx̂ x̂ as products with w: no pass to make them
        mean_dxhat = ((G @ weight.data) * (1.0 / C))[:, None]
        mean_dxhat_xhat = ((scratch @ weight.data) * (1.0 / C))[:, None]
        dx = G * weight.data  # dx̂
        dx -= mean_dxhat
        np.multiply(xhat, mean_dxhat_xhat, out=scratch)
        dx -= scratch
        dx /= sigma
        return dx.reshape(x.shape), dw, db

    return op(y.reshape(x.shape), (x, weight, bias), backward)


def layer_norm_linear(
    x: Tensor, norm_weight: Tensor, norm_bias: Tensor, eps: float, weight: Tensor, bias=None
) -> Tensor:
    """linear(layer_norm(x, w_n, b_n, eps), W, b) as one op: LayerNorm's scale and shift
    folded into the Linear that follows it (each LayerNorm of the GPT feeds one Linear).

        u = x̂ w_n + b_n,   y = u W + b = x̂ (w_n ⊙ W) + (b_n W + b)
    (w_n ⊙ W scales row c of W by w_n[c]: a (C, D) array, not an (N, C) pass). Backward,
    with P = x̂ᵀ g (the product the Linear's dW = uᵀ g would take anyway):
        db  = sum over rows of g,       dW = w_n ⊙ P + b_n ⊗ db
        dw_n = rowsum(W ⊙ P),           db_n = W db
        dx̂  = g (w_n ⊙ W)ᵀ,  then dx as in `layer_norm`, its means as row sums
    Two passes forward and three backward fewer than the two ops (no u, no g w). Backward
    reads W and w_n again rather than keeping w_n ⊙ W: nothing the size of W is held from
    forward to backward beyond what a Linear holds (ZeRO-3's slots stay the only copies)."""
    C = x.shape[-1]
    X = x.data.reshape(-1, C)
    xhat = X - (row_sums(X) * (1.0 / C))[:, None]
    sigma = np.sqrt(row_dots(xhat, xhat) * (1.0 / C) + eps)[:, None]
    xhat /= sigma
    w_n, b_n, W = norm_weight.data, norm_bias.data, weight.data
    scaled = w_n[:, None] * W  # w_n ⊙ W
    y = xhat @ scaled
    y += b_n @ W if bias is None else b_n @ W + bias.data

    def backward(g):
        G = g.reshape(-1, W.shape[1])
        db = column_sums(G)
        P = xhat.T @ G if weight.requires_grad or norm_weight.requires_grad else None
        dW = None
        if weight.requires_grad:
            dW = w_n[:, None] * P
            dW += np.outer(b_n, db)
        dw_n = row_dots(W, P) if norm_weight.requires_grad else None
        db_n = W @ db if norm_bias.requires_grad else None
        dx = None
        if x.requires_grad:  # dx̂ = g (w_n ⊙ W)ᵀ = (g Wᵀ) ⊙ w_n: from W itself, not `scaled`
            dx = G @ W.T  # (kept, `scaled` would hold a fresh (C, D) array per layer until
            dx *= w_n  # backward: under ZeRO-3 W is a reused slot, gathered again)
            mean_dxhat = (row_sums(dx) * (1.0 / C))[:, None]
            mean_dxhat_xhat = (row_dots(dx, xhat) * (1.0 / C))[:, None]
            dx -= mean_dxhat
            dx -= xhat * mean_dxhat_xhat
            dx /= sigma
            dx = dx.reshape(x.shape)
        grads = (dx, dw_n, db_n, dW)
        if bias is None:
            return grads
        return grads + (db if bias.requires_grad else None,)

    parents = (x, norm_weight, norm_bias, weight) + (() if bias is None else (bias,))
    return op(y.reshape(*x.shape[:-1], W.shape[1]), parents, backward)


_GELU_C = math.sqrt(2 / math.pi)  # Python floats: keep float32 arrays float32
_GELU_A = 0.044715


def gelu(x: Tensor) -> Tensor:
    """GELU (tanh approximation): functional.gelu's formula, in fewer passes over the data.

        y = 0.5 x (1 + t),  t = tanh(u),  u = c (x + a x^3) = x (c + a c x^2)
        dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)       (a = 0.044715)
              = (1 + t) (0.5 + k (1 - t)),   k = 0.5 c x (1 + 3 a x^2)

    (1 - t^2) = (1 - t)(1 + t) takes the factor (1 + t) out: no difference of two nearly
    equal numbers where t is near ±1. Each line below is one pass over the (B, T, 4C)
    array, and a pass costs about what tanh does here: 8 forward (9 composed as written),
    10 backward (13), two arrays each way. The same function as functional.gelu, its
    constants grouped otherwise: equal to rounding, not bit for bit."""
    v = x.data.reshape(-1)  # flat: a 0-d input too is an array to write into
    t = v * v
    t *= _GELU_A * _GELU_C
    t += _GELU_C
    t *= v  # u = x (c + a c x^2)
    np.tanh(t, out=t)  # t = tanh(u), kept for backward
    y = t + 1
    y *= v
    y *= 0.5

    def backward(g):
        k = v * v
        k *= 1.5 * _GELU_A * _GELU_C
        k += 0.5 * _GELU_C
        k *= v  # k = 0.5 c x (1 + 3 a x^2)
        one_minus_t = np.subtract(1, t)
        k *= one_minus_t
        k += 0.5  # 0.5 + k (1 - t)
        np.add(t, 1, out=one_minus_t)  # its array reused: 1 + t
        k *= one_minus_t
        k *= g.reshape(-1)
        return (k.reshape(x.shape),)

    return op(y.reshape(x.shape), (x,), backward)


def causal_self_attention(qkv: Tensor, n_head: int, future: np.ndarray) -> Tensor:
    """Multi-head causal attention from the packed projections: (B, T, 3C) -> (B, T, C).

    Per head (q, k, v: (T, hs) each, views into qkv; s = 1/sqrt(hs); M the future):
        S = q k^T s,  S[M] = -inf,  P = softmax(S) (over each row),  y = P v
    backward, with dy from the head-merged g:
        dP = dy v^T,  dv = P^T dy
        dS = P (dP - rowsum(dP P)) s             (softmax's Jacobian; 0 where masked)
        dq = dS k,    dk = dS^T q
    and dq, dk, dv are written into one (B, T, 3C) array: the gradient of the packed
    projections, where the composed split made a zeroed (B, T, 3C) array for each part and
    added them. Only P is kept for backward (the composed graph keeps S, P, the masked copy).
    The scale s is applied to q (and to dq), a quarter of S's size at the default shapes,
    not to S and dS: for hs = 16, s = 1/4, exact, so the same bits as scaling S.

    One layout trick: S is held transposed, S^T = k q^T s (a matrix product computes either
    at the same cost), so softmax's max and sums run down the columns of S^T, along
    NumPy's fast axis (a max along the last axis is ~3x slower). The same numbers to
    rounding as the composed graph (sums in another order)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    heads = qkv.data.reshape(B, T, 3, n_head, hs)  # a view
    q, k, v = (heads[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (B, H, T, hs)
    scale = 1.0 / math.sqrt(hs)
    qs = q * scale  # s folded into q: a pass over (B, T, C), not over S's (B, H, T, T)
    Pt = k @ qs.swapaxes(-1, -2)  # S^T, then P^T in place: (B, H, T keys, T queries)
    np.copyto(Pt, -np.inf, where=future[:T, :T].T)  # key after query: masked
    Pt -= Pt.max(axis=-2, keepdims=True)  # shift: no overflow
    np.exp(Pt, out=Pt)
    Pt /= (np.ones(T, dtype=Pt.dtype) @ Pt)[..., None, :]  # each query's sum over keys
    y = (Pt.swapaxes(-1, -2) @ v).transpose(0, 2, 1, 3).reshape(B, T, C)  # heads merged

    def backward(g):
        dy = g.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)  # a view
        dPt = v @ dy.swapaxes(-1, -2)  # (dy v^T)^T
        dv = Pt @ dy
        dSt = dPt  # in place from here
        dSt -= np.einsum("...kq,...kq->...q", dPt, Pt)[..., None, :]  # rowsum(dP P)
        dSt *= Pt  # 0 where masked: P is 0 there; dS / s: s goes on dq and dk below
        dqkv = np.empty(qkv.shape, dtype=g.dtype)
        parts = dqkv.reshape(B, T, 3, n_head, hs)
        dq = (dSt.swapaxes(-1, -2) @ k).transpose(0, 2, 1, 3)
        np.multiply(dq, scale, out=parts[:, :, 0])  # s dS k, written into its place
        parts[:, :, 1] = (dSt @ qs).transpose(0, 2, 1, 3)  # dS^T q s
        parts[:, :, 2] = dv.transpose(0, 2, 1, 3)
        return (dqkv,)

    return op(y, (qkv,), backward)


def embedding(weight: Tensor, idx: np.ndarray) -> Tensor:
    """weight[idx]: rows of the table, its backward without np.add.at.

    The gradient of row i is the sum of g over the positions where idx == i. np.add.at adds
    one row at a time (the lookup with it: 2.7x torch's time here); instead: sort the ids,
    find where each run of equal ids starts, and sum each run with np.add.reduceat. The same
    sums to rounding (reduceat may add a run pairwise, np.add.at one row after another)."""
    idx = np.asarray(idx)
    shape, dtype = weight.shape, weight.dtype

    def backward(g):
        full = np.zeros(shape, dtype=dtype)
        ids = idx.reshape(-1)
        ids = np.where(ids < 0, ids + shape[0], ids)  # -1 is row V - 1, as the lookup reads it
        if ids.size == 0:
            return (full,)
        order = np.argsort(ids, kind="stable")  # equal ids keep their order
        sorted_ids = ids[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
        rows = g.reshape(ids.size, -1)[order]
        full[sorted_ids[starts]] = np.add.reduceat(rows, starts, axis=0).reshape(-1, *shape[1:])
        return (full,)

    return op(weight.data[idx], (weight,), backward)
