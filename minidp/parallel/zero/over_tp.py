"""ZeRO over the data-parallel axis of a mesh, on a tensor-parallel model (Megatron-LM's
distributed optimizer over TP): what `--strategy hybrid --dp D --tp T --zero-stage S` runs.

What ZeRO flattens is the TP model this rank holds (parallel/tensor_parallel/gpt.py): TP
rank t's shards of the split layers and the replicated parameters (LayerNorms, wpe,
row-parallel biases), Ψ_t elements in all. Its DP group is the D ranks with the same t,
which hold the same TP shard, so ZeROStages (stages.py) runs unchanged on it: rank (d, t)
keeps chunk d of TP shard t's flat vector.

    grid dp 2 x tp 2     tp groups {0,1} {2,3}: f, g inside the model, as without ZeRO
                         dp groups {0,2} {1,3}: reduce-scatter, AdamW on my chunk, allgather
    clip                 ||g||² = Σ_{d,t} (TP-sharded elements of chunk (d, t))²
                                + Σ_d (replicated elements of chunk (d, 0))²
                         the replicated are in every TP rank's vector: TP rank 0's count

The replicated parameters must stay bit for bit the same on every TP rank. Their gradients
are (every TP rank computes them from the same inputs), but the DP reduce-scatter sums each
element in an order set by its chunk, and TP ranks cut different vectors when their shards
differ in size (a vocabulary that does not divide by T). A sum of two is the same in either
order; from D = 3 on, with unequal shards, `broadcast_replicated()` sends TP rank 0's over
the TP group after each step (stages 1, 2; stage 3 holds no whole parameter to send:
`drifts` says when it is needed).

Sequence parallelism: each TP rank saw T/p positions, so a replicated gradient is a partial
sum. A grad-ready hook, registered before ZeRO's own, allreduces it over the TP group (on
the last micro-batch) before its segment is reduced over DP. Stage 3 gathers whole child
modules (stage3.py); TensorParallelGPT's position table is a bare parameter, so it is put
in a child module of its own first (`Positions`).
"""

import math

import numpy as np

from minidp import comm
from minidp.engine import optim
from minidp.engine.nn import Module
from minidp.engine.tensor import Tensor
from minidp.parallel.zero.flat import ShardLayout, chunk_slices
from minidp.parallel.zero.stages import ZeROStages


def drifts(dp: int, tp: int, vocab: int) -> bool:
    """Whether TP rank 0's replicated parameters must be broadcast after each step: TP ranks
    cut unequal shards only where the TP GPT splits the vocabulary unevenly."""
    return dp > 2 and vocab % tp != 0


def split_chunks(layout: ShardLayout, is_sharded) -> list[tuple[list[slice], list[slice]]]:
    """Per segment: (slices of this rank's chunk in TP-sharded parameters, slices in
    replicated ones), from flat.chunk_slices."""
    out = []
    for mine in chunk_slices(layout):
        kinds = ([], [])
        for p, s in mine:
            kinds[0 if is_sharded(p) else 1].append(s)
        out.append(kinds)
    return out


class Positions(Module):
    """TensorParallelGPT's position table as a child module, so that stage 3 can gather it
    around its use (stage3.py wraps child modules' forwards): `positions[index]` calls it."""

    def __init__(self, weight):
        self.weight = weight

    def forward(self, index: np.ndarray) -> Tensor:
        return self.weight[index]

    def __getitem__(self, index: np.ndarray) -> Tensor:
        return self(index)


class ZeROOverTP(ZeROStages):
    """ZeRO `stage` over `mesh.dp_group` on the TP GPT `model`, whose parameters are
    `sharded` (split over `mesh.tp_group`) or `replicated`: the sequence-parallel sums
    hooked ahead of ZeRO's, the norm that counts each element once, and the drift broadcast.
    `sum_in_hooks`: sequence parallelism's partial sums taken in grad-ready hooks, on the
    backward outside no_sync(); False where the caller sums them itself (a pipeline runs
    every backward under no_sync()). The other arguments: ZeROStages's."""

    def __init__(self, model, mesh, sharded, replicated, stage, make_optimizer, *,
                 sum_in_hooks: bool = True, **options):  # fmt: skip
        self.mesh, self.replicated = mesh, replicated
        if stage == 3:  # every parameter in a child module, for stage3.py
            model.wpe = Positions(model.wpe)
        self._unhook = []
        if sum_in_hooks and getattr(model, "replicated_grads_partial", False):
            self._unhook = [p.register_grad_ready_hook(self._sum_over_tp) for p in replicated]
        try:  # hooked before ZeRO's: they read the sums
            super().__init__(model, mesh.dp_group, stage, make_optimizer, **options)
        except BaseException:
            self._remove_hooks()
            raise
        self.part = f"tp {mesh.tp_group.rank} of {mesh.tp_group.size}"  # checkpoints
        ids = {id(p) for p in sharded}
        self.kinds = split_chunks(self.layout, lambda p: id(p) in ids)

    def _sum_over_tp(self, p) -> None:
        if self.sync.sync_enabled:  # accumulating: the last backward sums
            p.grad[...] = comm.allreduce(p.grad, group=self.mesh.tp_group)

    def broadcast_replicated(self) -> None:
        """TP rank 0's replicated parameters to the TP group (see the docstring)."""
        flat = np.concatenate([p.data.ravel() for p in self.replicated])
        comm.broadcast(flat, root=0, group=self.mesh.tp_group)
        offset = 0
        for p in self.replicated:  # in place: p.data is a view of ZeRO's flat vector
            p.data[...] = flat[offset : offset + p.size].reshape(p.shape)
            offset += p.size

    def norm(self, kind: str) -> float:
        """The norm of the whole model from this rank's chunks (their `kind`, "grad" or
        "data"): TP-sharded elements summed over every rank, replicated ones over TP rank
        0's DP group."""
        return math.sqrt(self.sum_of_squares(kind))

    def sum_of_squares(self, kind: str) -> float:
        """The square of `norm(kind)`, collective over the DP and TP groups (a pipeline
        sums its stages' over the PP group)."""
        arrays = [getattr(p, kind) for p in self.pieces]
        parts = [[a[s] for a, kinds in zip(arrays, self.kinds) for s in kinds[k]] for k in (0, 1)]
        total = np.array([optim.sum_of_squares(parts[0]), optim.sum_of_squares(parts[1])])
        comm.allreduce(total, out=total, group=self.dp_group)
        if self.mesh.tp > 1:
            if self.mesh.coords["tp"] != 0:
                total[1] = 0.0  # TP rank 0's replicated sum, once
            comm.allreduce(total, out=total, group=self.mesh.tp_group)
        return float(total.sum())

    def _remove_hooks(self) -> None:
        for unhook in self._unhook:
            unhook()
        self._unhook = []

    def close(self) -> None:
        super().close()
        self._remove_hooks()
