"""The messages of tensor parallelism, as autograd ops: Megatron's f and g and their kin.

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", section 3) splits a layer's weight across the p ranks of a
tensor-parallel group and needs two operators around each split pair of matmuls:

    f: forward identity,   backward allreduce       (enters a parallel region: every rank
    g: forward allreduce,  backward identity         uses all of X; each sends back the part
                                                     of dL/dX its own shard produced)

They are conjugate: each one's backward is the other's forward. The MLP block, Y = GeLU(X A),
Z = Y B, with A split by columns and B by rows, is then

    X --f--> X A_i --GeLU--> Y_i --> Y_i B_i --g--> Z = sum_i Y_i B_i

one allreduce forward (g), one backward (f), per block. Splitting along the last axis:

    gather_last: forward allgather of the last axis, backward keep my slice  (even splits)
    split_last:  forward keep my slice, backward allgather                   (its conjugate)

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models") keeps the regions between the parallel blocks (LayerNorm, dropout, the
residual) split along the sequence: each rank holds T/p positions. An allreduce is a
reduce-scatter followed by an allgather, so g and f become

    reduce_scatter_sequence (g-bar's place after a row-parallel layer):
        forward reduce-scatter along T, backward allgather along T
    gather_sequence (f's place before a column-parallel layer):
        forward allgather along T, backward reduce-scatter along T
    split_sequence: forward keep my positions, backward allgather (replicated -> split)

The same bytes move as with f and g, and the LayerNorm and dropout activations shrink by p.

Layout: activations are (B, T, C). The collectives cut flat vectors into chunk_bounds
chunks, so the sequence ops move a (T, B, C) copy, whose chunk r is positions
[r T/p, (r+1) T/p) when p divides T (checked). Every rank of the group must call each op
in the same order with the same shapes: they are collectives.
"""

import numpy as np

from minidp import comm
from minidp.engine.tensor import Tensor, op
from minidp.tools.chunks import chunk_range


# ---- f and g -------------------------------------------------------------------------------
def copy_to_tensor_parallel(x: Tensor, group: comm.Group) -> Tensor:
    """Megatron's f: identity forward; backward allreduce(sum) of dL/dX over the TP group."""
    return op(x.data, (x,), lambda g: (comm.allreduce(np.ascontiguousarray(g), group=group),))


def reduce_from_tensor_parallel(x: Tensor, group: comm.Group) -> Tensor:
    """Megatron's g: forward allreduce(sum) of the partial results; backward identity."""
    return op(comm.allreduce(np.ascontiguousarray(x.data), group=group), (x,), lambda g: (g,))


# ---- the last axis -------------------------------------------------------------------------
def _last_slice(n: int, group: comm.Group) -> slice:
    lo, hi = chunk_range(n, group.size, group.rank)
    return slice(lo, hi)


def _allgather_last(x: np.ndarray, group: comm.Group) -> np.ndarray:
    """(..., n) on each rank -> (..., p n): rank i's block is columns [i n, (i+1) n)."""
    rows = comm.allgather(np.ascontiguousarray(x), group=group)  # (p, ..., n)
    return np.concatenate(list(rows), axis=-1)


def gather_last(x: Tensor, group: comm.Group) -> Tensor:
    """Forward: allgather along the last axis (every rank's slice the same size); backward:
    this rank's slice of the gradient (the conjugate of split_last)."""
    n = x.shape[-1]
    mine = slice(group.rank * n, (group.rank + 1) * n)
    return op(_allgather_last(x.data, group), (x,), lambda g: (g[..., mine],))


def split_last(x: Tensor, group: comm.Group) -> Tensor:
    """Forward: this rank's chunk of the last axis (which must divide by p); backward:
    allgather of the gradients along it."""
    n, p = x.shape[-1], group.size
    if n % p:
        raise ValueError(f"split_last: last axis {n} does not divide by {p} ranks")
    mine = _last_slice(n, group)
    return op(x.data[..., mine], (x,), lambda g: (_allgather_last(g, group),))


# ---- the sequence axis (sequence parallelism) ----------------------------------------------
def _time_major(x: np.ndarray) -> np.ndarray:
    """(B, T, C) -> a contiguous (T, B, C) copy: chunk r of it is a range of positions."""
    return np.ascontiguousarray(x.transpose(1, 0, 2))


def _check_sequence(T: int, p: int) -> None:
    if T % p:
        raise ValueError(f"sequence parallelism: {T} positions do not divide by {p} ranks")


def _allgather_sequence(x: np.ndarray, group: comm.Group) -> np.ndarray:
    """(B, T/p, C) shards -> (B, T, C), rank r's shard at positions [r T/p, (r+1) T/p)."""
    B, t, C = x.shape
    whole = comm.allgather(_time_major(x), group=group)  # (p, T/p, B, C)
    return whole.reshape(group.size * t, B, C).transpose(1, 0, 2)


def _reduce_scatter_sequence(x: np.ndarray, group: comm.Group) -> np.ndarray:
    """(B, T, C) partial sums -> (B, T/p, C): the sum over ranks of my positions."""
    B, T, C = x.shape
    _check_sequence(T, group.size)
    mine = comm.reduce_scatter(_time_major(x), group=group)  # flat: T/p x B x C
    return mine.reshape(T // group.size, B, C).transpose(1, 0, 2)


def gather_sequence(x: Tensor, group: comm.Group) -> Tensor:
    """Forward: allgather the sequence shards (B, T/p, C) -> (B, T, C); backward:
    reduce-scatter along T (each rank used all T positions; each keeps its own)."""
    return op(
        _allgather_sequence(x.data, group),
        (x,),
        lambda g: (_reduce_scatter_sequence(g, group),),
    )


def reduce_scatter_sequence(x: Tensor, group: comm.Group) -> Tensor:
    """Forward: reduce-scatter partial sums (B, T, C) -> my positions (B, T/p, C), summed;
    backward: allgather along T."""
    return op(
        _reduce_scatter_sequence(x.data, group),
        (x,),
        lambda g: (_allgather_sequence(g, group),),
    )


def split_sequence(x: Tensor, group: comm.Group) -> Tensor:
    """Forward: this rank's positions of a replicated (B, T, C); backward: allgather."""
    T, p = x.shape[1], group.size
    _check_sequence(T, p)
    lo, hi = sequence_range(T, group)
    return op(x.data[:, lo:hi], (x,), lambda g: (_allgather_sequence(g, group),))


def sequence_range(T: int, group: comm.Group) -> tuple[int, int]:
    """The positions [lo, hi) this rank holds under sequence parallelism."""
    return chunk_range(T, group.size, group.rank)
