"""The vocabulary split across the TP group: the embedding's rows, the head's columns, and a
cross-entropy that never gathers the logits (Megatron's `vocab_parallel_cross_entropy`).

Rank i holds the token range [v_i, v_{i+1}) = chunk_range(V, p, i) (sizes may differ by one).

Embedding (E: V x C, rank i holds rows v_i..v_{i+1}):

    partial_i[n] = E_i[token_n - v_i]  if v_i <= token_n < v_{i+1}  else 0     (masked lookup)
    X = g(partial)                       exactly one rank contributes each row: the sum is E[token]

Cross-entropy over logits split by columns, z_i = the rank's (N, V_i) block:

    M_n   = allreduce_max( max_j z_i[n, j] )           the row's global maximum
    S_n   = allreduce_sum( sum_j exp(z_i[n, j] - M_n) )
    z_t   = allreduce_sum( z_i[n, t_n - v_i] - M_n  on the rank that owns t_n, else 0 )
    loss  = mean_n ( log S_n - z_t )
    dL/dz_i = ( exp(z_i - M) / S  -  onehot_i(t) ) / N      no communication in backward

Each allreduce moves N numbers (S and z_t travel together), not the N x V logits.
"""

import numpy as np

from minidp import comm
from minidp.engine import nn
from minidp.engine.tensor import Tensor, op
from minidp.parallel.tensor_parallel.communications import (
    reduce_from_tensor_parallel,
    reduce_scatter_sequence,
)
from minidp.parallel.tensor_parallel.layers import my_range, shard


def vocab_range(V: int, group: comm.Group) -> tuple[int, int]:
    """[v_i, v_{i+1}): the token ids this rank's shard of the vocabulary covers."""
    index = my_range(V, group)
    return (int(index[0]), int(index[-1]) + 1) if index.size else (0, 0)


def masked_lookup(weight: Tensor, idx: np.ndarray, start: int) -> Tensor:
    """Rows `idx - start` of this rank's table, zeros for tokens outside its range."""
    local = idx - start
    outside = (local < 0) | (local >= weight.shape[0])
    local = np.where(outside, 0, local)
    out = weight.data[local]
    out[outside] = 0

    def backward(g):  # each used row gathers the gradients of its tokens (repeats add up)
        dw = np.zeros_like(weight.data)
        np.add.at(dw, local[~outside], g[~outside])
        return (dw,)

    return op(out, (weight,), backward)


class VocabParallelEmbedding(nn.Module):
    """The token embedding with this rank's rows of `full` (an nn.Embedding): masked lookup,
    then g (or, with sequence parallelism, a reduce-scatter along T: this rank's positions)."""

    def __init__(
        self,
        full: nn.Embedding,
        group: comm.Group,
        *,
        name: str = "",
        sequence_parallel: bool = False,
    ):
        V = full.weight.shape[0]
        self.group, self.sequence_parallel = group, sequence_parallel
        self.start, self.stop = vocab_range(V, group)
        self.weight = shard(full.weight, name + "weight", 0, my_range(V, group))

    def forward(self, idx: np.ndarray) -> Tensor:
        partial = masked_lookup(nn.computed(self.weight), np.asarray(idx), self.start)
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, self.group)
        return reduce_from_tensor_parallel(partial, self.group)


def vocab_parallel_cross_entropy(
    logits: Tensor, targets: np.ndarray, start: int, group: comm.Group
) -> Tensor:
    """Mean cross-entropy of logits split by columns over `group`; see the module docstring.

    logits: this rank's (..., V_i) columns, those of tokens [start, start + V_i); targets:
    (...) whole token ids. The loss is the same on every rank; the gradient is this rank's
    columns of the one-process gradient."""
    targets = np.asarray(targets)
    Vi = logits.shape[-1]
    z = logits.data.reshape(-1, Vi)
    t = targets.reshape(-1)
    N = len(t)
    rows = np.arange(N)
    local_max = z.max(axis=1) if Vi else np.full(N, -np.inf, z.dtype)
    M = comm.allreduce(np.ascontiguousarray(local_max), op="max", group=group)
    shifted = z - M[:, None]
    e = np.exp(shifted)
    mine = (t >= start) & (t < start + Vi)
    local_t = np.where(mine, t - start, 0)
    picked = np.where(mine, shifted[rows, local_t] if Vi else 0.0, 0.0)
    S, z_t = comm.allreduce(np.stack([e.sum(axis=1), picked]), group=group)
    loss = np.log(S) - z_t

    def backward(g):
        d = e / S[:, None]
        d[rows[mine], local_t[mine]] -= 1
        d *= g / N
        return (d.reshape(logits.shape),)

    return op(np.asarray(loss.sum() / N, dtype=logits.dtype), (logits,), backward)
