"""Fused ops: LayerNorm (alone, or with the Linear after it), a Linear with the residual add
after it, GELU, causal self-attention and the embedding, each one graph node with its
derivative written out beside its forward (micrograd's way, on arrays, not scalars).

The speed trick of docs/memory.md. Each op computes what a composed graph of small ops
computes, and is checked against it (tests/test_autograd.py: the composed graph, central
differences in float64, PyTorch). The composed versions stay where a reader meets them first
(`nn.LayerNorm(fused=False)` then `nn.linear`, `functional.gelu`, `gpt.composed_attention`,
indexing `weight[idx]`); `nn` and `gpt` take these by default, on NumPy data, through the
engine's table (engine/registry.py, filled in by fast/__init__.py). What fusing saves:

    op              composed                                  fused
    LayerNorm       11 nodes, 5 full-size arrays forward      1 node, the standard backward
    LayerNorm       2 ops; u = x̂ w + b made (2 passes),       1 node; w, b and the bias
      + Linear      then u W, + b; dx̂ = du w (1 more pass)    folded into a (C + 1, D)
                                                              weight: no u, no bias pass
    Linear + the    2 ops: x W + b, then a second (N, D)      1 node; the residual added
      residual add  array for r + (x W + b)                   into the product's array
    GELU            9 temporaries forward, 13 backward        2 each way, 8 and 10 passes,
                                                              in cache-sized blocks
    attention       split, 3 zeroed (B, T, 3C) in backward,   1 node (in fused_attention.py);
                    mask + softmax 4 arrays each way          dq, dk, dv written into one
                                                              (B, T, 3C) array; softmax down
                                                              S^T's columns; blocks of rows
    embedding bwd   np.add.at (one row at a time)             sort the ids, np.add.reduceat

Fewer arrays means fewer bytes for the allocator to find and fewer pages to fault in
(allocator.py); fewer passes means less memory traffic, and passes run on cache-sized
blocks (`blocks`) traffic with the cache instead of memory; fewer nodes, less Python.
Where an op keeps the composed graph's exact order of operations it says so: then its bits
are the composed graph's (the tests check which).
"""

import math

import numpy as np

from minidp.engine.tensor import Tensor, op
from minidp.fast.weight_grads import weight_gradient

__all__ = [
    "row_sums",
    "row_dots",
    "column_sums",
    "layer_norm",
    "layer_norm_linear",
    "linear_residual",
    "gelu",
    "embedding",
]


def row_sums(a: np.ndarray) -> np.ndarray:
    """a.sum(axis=-1), as a matrix-vector product: BLAS sums short rows faster than
    NumPy's reduction (docs/memory.md; the same sum to rounding, a different order of
    additions)."""
    return a @ np.ones(a.shape[-1], dtype=a.dtype)


def row_dots(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a * b).sum(axis=-1) without the array a * b: np.vecdot (NumPy 2), else einsum."""
    return np.vecdot(a, b) if hasattr(np, "vecdot") else np.einsum("...i,...i->...", a, b)


def column_sums(a: np.ndarray) -> np.ndarray:
    """a.sum(axis=0) of a 2-D array, as a vector-matrix product (faster than NumPy's
    reduction, docs/memory.md; the same sum to rounding)."""
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

        u = x̂ w_n + b_n,   y = u W + b = x̂ (w_n ⊙ W) + (b_n W + b) = [x̂ 1] W⁺
    where W⁺ is w_n ⊙ W (row c of W scaled by w_n[c]) with one more row, b_n W + b: x̂ is
    written with a column of ones after it, so the product adds the bias (no pass over the
    (N, D) output to add it; a (C + 1, D) array, not an (N, C) pass, to fold w_n and b_n).
    Backward, with P = x̂ᵀ g (the product the Linear's dW = uᵀ g would take anyway):
        db  = sum over rows of g,       dW = w_n ⊙ P + b_n ⊗ db
        dw_n = rowsum(W ⊙ P),           db_n = W db
        dx̂  = g (w_n ⊙ W)ᵀ,  then dx as in `layer_norm`, its means as row sums
    Three passes forward and three backward fewer than the two ops (no u, no g w, no bias
    pass). ([x̂ 1]ᵀ g would give db as its last row, but a product with 65 rows costs more
    than one with 64 and a row sum: measured, so not taken.) Backward reads W and w_n again
    rather than keeping W⁺: nothing the size of W is held from forward to backward beyond
    what a Linear holds (ZeRO-3's slots stay the only copies)."""
    C = x.shape[-1]
    X = x.data.reshape(-1, C)
    w_n, b_n, W = norm_weight.data, norm_bias.data, weight.data
    linear_bias = () if bias is None else (bias.data,)
    dtype = np.result_type(X, w_n, b_n, W, *linear_bias)  # what the two ops would give
    xhat1 = np.empty((len(X), C + 1), dtype=dtype)  # [x̂ 1]
    xhat1[:, C] = 1
    xhat = xhat1[:, :C]  # a view: rows of C, one apart
    np.subtract(X, (row_sums(X) * (1.0 / C))[:, None], out=xhat)  # x - μ
    sigma = np.sqrt(row_dots(xhat, xhat) * (1.0 / C) + eps)[:, None]
    xhat /= sigma
    W_plus = np.empty((C + 1, W.shape[1]), dtype=xhat1.dtype)
    np.multiply(w_n[:, None], W, out=W_plus[:C])  # w_n ⊙ W
    np.matmul(b_n, W, out=W_plus[C])  # b_n W (+ b)
    if bias is not None:
        W_plus[C] += bias.data
    y = xhat1 @ W_plus

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
        if x.requires_grad:  # dx̂ = g (w_n ⊙ W)ᵀ = (g Wᵀ) ⊙ w_n: from W itself, not W⁺
            dx = G @ W.T  # (kept, W⁺ would hold a fresh (C + 1, D) array per layer until
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


def linear_residual(residual: Tensor, x: Tensor, weight: Tensor, bias=None) -> Tensor:
    """residual + linear(x, W, b) as one op: a block's output projection and the residual
    add after it (Megatron-LM's bias-dropout-add fusion, without the dropout).

        y = x W + b + r:     dr = g,  dx = g Wᵀ,  dW = xᵀ g,  db = sum over rows of g
    The composed two ops make x W + b, then a second (N, D) array for the sum: here the sum
    is added into the product's own array, and backward has one node. The same operations
    in the same order as `r + nn.linear(x, W, b)`: the same bits (tests/test_autograd.py).
    For arrays of one dtype, r shaped as the output (gpt.add_linear checks both)."""
    X = x.data.reshape(-1, x.shape[-1])
    W = weight.data
    if X.shape[-1] != W.shape[0] or residual.shape != (*x.shape[:-1], W.shape[1]):
        raise ValueError(
            f"linear_residual: input {x.shape}, weight {W.shape}, residual {residual.shape}"
        )
    y = X @ W
    if bias is not None:
        y += bias.data
    y += residual.data.reshape(y.shape)

    def backward(g):
        G = g.reshape(y.shape)
        dx = (G @ W.T).reshape(x.shape) if x.requires_grad else None
        dW = weight_gradient(X, G) if weight.requires_grad else None
        grads = (g, dx, dW)
        if bias is None:
            return grads
        return grads + (G.sum(axis=0) if bias.requires_grad else None,)

    parents = (residual, x, weight) + (() if bias is None else (bias,))
    return op(y.reshape(residual.shape), parents, backward)


CHUNK_BYTES = 256 << 10  # a block of rows per pass: well inside a core's L2 cache (0: whole)


def blocks(a: np.ndarray) -> list[slice]:
    """Slices of a's first axis, each about CHUNK_BYTES: cache blocking.

    A chain of element-wise passes over a 1 MiB array streams it from memory once per
    pass: past the L2 cache a write costs several times a write into cache
    (docs/memory.md). Running the whole chain on one block, then the next, keeps each block
    in cache from the first pass to the last. Element-wise, or one sequence at a time: the
    same bits as whole arrays (tests/test_autograd.py sets CHUNK_BYTES = 0 to compare)."""
    n = max(len(a), 1)  # an empty array: one (empty) block
    step = max(1, CHUNK_BYTES // max(1, a[:1].nbytes)) if CHUNK_BYTES else n
    return [slice(i, i + step) for i in range(0, n, step)]


_GELU_C = math.sqrt(2 / math.pi)  # Python floats: keep float32 arrays float32
_GELU_A = 0.044715


def _tanh_u(v, out):
    """out = t = tanh(u), GELU's t, in five passes over one block."""
    np.multiply(v, v, out=out)
    out *= _GELU_A * _GELU_C
    out += _GELU_C
    out *= v  # u = x (c + a c x^2)
    np.tanh(out, out=out)


def gelu(x: Tensor) -> Tensor:
    """GELU (tanh approximation): functional.gelu's formula, in fewer passes over the data.

        y = 0.5 x (1 + t),  t = tanh(u),  u = c (x + a x^3) = x (c + a c x^2)
        dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)       (a = 0.044715)
              = (1 + t) (0.5 + k (1 - t)),   k = 0.5 c x (1 + 3 a x^2)

    (1 - t^2) = (1 - t)(1 + t) takes the factor (1 + t) out: no difference of two nearly
    equal numbers where t is near ±1. Each line below is one pass over the (B, T, 4C)
    array, and a pass costs about what tanh does (docs/memory.md): 8 forward (9 composed as
    written), 10 backward (13), two arrays each way, each chain run on one cache-sized block
    at a time (`blocks`: the backward's 10 passes run faster so in the GPT's step). The same
    function as functional.gelu, its constants grouped otherwise: equal to rounding, not
    bit for bit."""
    v = x.data.reshape(-1)  # flat: a 0-d input too is an array to write into
    y, t = np.empty_like(v), np.empty_like(v)
    for s in blocks(v):
        vs, ys, ts = v[s], y[s], t[s]
        _tanh_u(vs, out=ts)
        np.add(ts, 1, out=ys)
        ys *= vs
        ys *= 0.5

    def backward(g):
        g = g.reshape(-1)
        k, spans = np.empty_like(v), blocks(v)
        other = np.empty_like(v[spans[0]])
        for s in spans:
            vs, ks, ts, os = v[s], k[s], t[s], other[: len(v[s])]
            np.multiply(vs, vs, out=ks)
            ks *= 1.5 * _GELU_A * _GELU_C
            ks += 0.5 * _GELU_C
            ks *= vs  # k = 0.5 c x (1 + 3 a x^2)
            np.subtract(1, ts, out=os)
            ks *= os
            ks += 0.5  # 0.5 + k (1 - t)
            np.add(ts, 1, out=os)  # 1 + t
            ks *= os
            ks *= g[s]
        return (k.reshape(x.shape),)

    return op(y.reshape(x.shape), (x,), backward)


def embedding(weight: Tensor, idx: np.ndarray) -> Tensor:
    """weight[idx]: rows of the table, its backward without np.add.at.

    The gradient of row i is the sum of g over the positions where idx == i. np.add.at adds
    one row at a time (slowly: docs/memory.md times the lookup with it against torch's);
    instead: sort the ids, find where each run of equal ids starts, and sum each run with
    np.add.reduceat. The same sums to rounding (reduceat may add a run pairwise, np.add.at
    one row after another)."""
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
