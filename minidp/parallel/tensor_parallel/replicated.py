"""What a TP model does not split (LayerNorms, the position table, row-parallel biases) is
held whole on every rank of the TP group. Two things follow, for any TP model a recipe
wraps (its `sharded` and `replicated` parameters, gpt.sharded_and_replicated):

- their gradients must be alike on every TP rank before the optimizer (`make_alike`):
  summed over the group where each rank saw only its T/p positions (sequence
  parallelism), or TP rank 0's where the data-parallel sums that follow may differ by
  rank (in order, from 3 DP ranks, or in what a compressor chose from each rank's bucket);
- the norm of the whole model counts each element once (`sum_of_squares`): the shards
  summed over the group, the replicated taken once.
"""

import numpy as np

from minidp import comm
from minidp.engine import optim


def make_alike(replicated: list, tp_group: comm.Group, partial: bool, take_rank0: bool) -> None:
    """The `replicated` parameters' gradients alike on every rank of `tp_group`: summed
    (`partial`), broadcast from TP rank 0 (`take_rank0`), or left as they are."""
    if tp_group.size == 1 or not replicated or not (partial or take_rank0):
        return
    grads = [p.grad for p in replicated]
    flat = np.concatenate([g.ravel() for g in grads])
    if partial:
        comm.allreduce(flat, out=flat, group=tp_group)
    else:
        comm.broadcast(flat, root=0, group=tp_group)
    offset = 0
    for g in grads:
        g[...] = flat[offset : offset + g.size].reshape(g.shape)
        offset += g.size


def sum_of_squares(sharded: list, replicated: list, kind: str, tp_group: comm.Group) -> float:
    """Σ over the TP group of the shards' squares, plus the replicated squares once: the
    squared norm of the whole model's "grad" or "data" (collective over `tp_group`)."""
    total = np.array([optim.sum_of_squares(getattr(p, kind) for p in sharded)], float)
    if tp_group.size > 1:
        comm.allreduce(total, out=total, group=tp_group)
    return float(total[0]) + optim.sum_of_squares(getattr(p, kind) for p in replicated)
