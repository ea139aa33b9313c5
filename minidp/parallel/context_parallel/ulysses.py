"""DeepSpeed-Ulysses: trade the sequence split for a head split, attend, and trade back.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models". Each of the C ranks holds T/C positions of all H
heads' q, k, v (layout.py). One all-to-all gives each rank all T positions of H/C heads;
attention is then the plain one, on whole sequences (each head is independent of the
others); a second all-to-all gives each rank its positions of every head back. C = 2, H = 4:

    before (sequence split)        after the all-to-all (head split)
    rank 0: positions 0..T/2,      rank 0: heads 0-1, positions 0..T
            heads 0-3                      (its own half + rank 1's half of heads 0-1)
    rank 1: positions T/2..T,      rank 1: heads 2-3, positions 0..T
            heads 0-3

Row j of what a rank sends is its positions of head group j (heads j H/C .. (j+1) H/C);
row i of what it receives is rank i's positions of its own head group, placed at rank i's
global positions (any layout, zig-zag too). The two exchanges are each other's conjugate
(an all-to-all is a permutation: its adjoint is its inverse), so, as Megatron's f and g:

    sequence_to_heads:  forward all-to-all sequence -> heads,  backward heads -> sequence
    heads_to_sequence:  forward all-to-all heads -> sequence,  backward sequence -> heads

Needs H divisible by C: at most H ranks (a head is never split). Cost per call and rank,
w bytes per number, the all-to-all sending (C-1)/C of what it holds (comm/alltoall.py):
forward 3 B T C' w (C-1)/C^2 for q, k, v and B T C' w (C-1)/C^2 for y back; backward the
same for dy and dq, dk, dv: 4 B T C' w (C-1)/C^2 each way, where ring attention sends
2 B T C' w (C-1)/C (ring.py). `ulysses_bytes` says it; the tests check the counters.
Every rank computes all T x T scores of H/C heads (all of them, the causal half wasted as
in one process's attention): balanced without zig-zag; it keeps 1/C of the probabilities.
"""

import numpy as np

from minidp import comm
from minidp.engine.nn import Dropout
from minidp.engine.tensor import Tensor, op
from minidp.models.gpt import attention
from minidp.parallel.context_parallel.layout import SequenceLayout


def ulysses_bytes(qkv_shape: tuple, itemsize: int, ranks: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per ulysses_attention call on a (B, T/C, 3C')
    qkv: (C-1)/C of its q, k, v and of its y, each way."""
    B, t, C3 = qkv_shape
    both = B * t * (C3 + C3 // 3) * itemsize  # q, k, v and y, this rank's rows
    return both * (ranks - 1) // ranks, both * (ranks - 1) // ranks


def _to_heads(x: np.ndarray, group: comm.Group, layout: SequenceLayout) -> np.ndarray:
    """(B, T/C, K, H, hs) my positions of every head -> (B, T, K, H/C, hs) every position
    of my head group."""
    p = group.size
    B, t, K, H, hs = x.shape
    rows = np.ascontiguousarray(x.reshape(B, t, K, p, H // p, hs).transpose(3, 0, 1, 2, 4, 5))
    got = comm.alltoall(rows, group=group)  # row i: rank i's positions, my heads
    whole = np.empty((B, p * t, K, H // p, hs), dtype=x.dtype)
    order = np.concatenate([layout.positions(i) for i in range(p)])
    whole[:, order] = got.transpose(1, 0, 2, 3, 4, 5).reshape(B, p * t, K, H // p, hs)
    return whole


def _to_sequence(x: np.ndarray, group: comm.Group, layout: SequenceLayout) -> np.ndarray:
    """(B, T, K, H/C, hs) every position of my head group -> (B, T/C, K, H, hs) my
    positions of every head: _to_heads undone."""
    p = group.size
    rows = np.stack([x[:, layout.positions(i)] for i in range(p)])  # row j: rank j's rows
    rows = np.ascontiguousarray(rows)
    got = comm.alltoall(rows, group=group)  # row i: head group i, my positions
    _, B, t, K, h, hs = got.shape
    return got.transpose(1, 2, 3, 0, 4, 5).reshape(B, t, K, p * h, hs)


def sequence_to_heads(qkv: Tensor, n_head: int, group: comm.Group, layout) -> Tensor:
    """(B, T/C, 3C') packed q, k, v of my positions -> (B, T, 3C'/C) packed q, k, v of my
    H/C heads at every position. Backward: the exchange the other way."""
    B, t, C3 = qkv.shape
    hs = C3 // 3 // n_head
    whole = _to_heads(qkv.data.reshape(B, t, 3, n_head, hs), group, layout)

    def backward(g):
        g = g.reshape(B, layout.T, 3, n_head // group.size, hs)
        return (_to_sequence(g, group, layout).reshape(B, t, C3),)

    return op(whole.reshape(B, layout.T, -1), (qkv,), backward)


def heads_to_sequence(y: Tensor, n_head: int, group: comm.Group, layout) -> Tensor:
    """(B, T, C'/C) my heads' outputs at every position -> (B, T/C, C') my positions,
    every head. Backward: the exchange the other way."""
    B, T, c = y.shape
    h = n_head // group.size
    mine = _to_sequence(y.data.reshape(B, T, 1, h, c // h), group, layout)
    t = layout.local_T

    def backward(g):
        return (_to_heads(g.reshape(B, t, 1, n_head, c // h), group, layout).reshape(B, T, c),)

    return op(mine.reshape(B, t, c * group.size), (y,), backward)


def ulysses_attention(
    qkv: Tensor,
    n_head: int,
    group: comm.Group,
    layout: SequenceLayout,
    attn_drop: Dropout | None = None,
    fused: bool = True,
) -> Tensor:
    """Causal attention of this rank's positions (B, T/C, 3C') -> (B, T/C, C'), as
    ring_attention, by two all-to-alls around gpt.attention on H/C heads of the whole
    sequence. Every rank of `group` calls it together (collectives)."""
    p = group.size
    if n_head % p:
        raise ValueError(f"Ulysses: {n_head} heads do not divide by {p} ranks (heads >= ranks)")
    if layout.ranks != p or qkv.shape[1] != layout.local_T:
        raise ValueError(
            f"ulysses_attention: layout of {layout.ranks} ranks x {layout.local_T} positions, "
            f"group of {p}, qkv {qkv.shape}"
        )
    whole = sequence_to_heads(qkv, n_head, group, layout)
    T = layout.T
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    drop = attn_drop if attn_drop is not None else Dropout(0.0, rng=np.random.default_rng(0))
    y = attention(whole, n_head // p, future, drop, fused)
    return heads_to_sequence(y, n_head, group, layout)
