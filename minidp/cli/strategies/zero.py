"""`--strategy zero --zero-stage 1|2|3`: data parallelism without every rank holding every
model state (Rajbhandari, Rasley, Ruwase & He, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020).

    mpiexec -n 4 python -m minidp --strategy zero --zero-stage 3

Ψ parameters, N_d data-parallel ranks, K bytes of optimizer state per parameter. The paper
trains in mixed precision (2 + 2 + K, K = 12); minidp has no mixed precision, so here it is
fp32 weights and gradients and AdamW's two fp32 moments, K = 8. Model states per rank:

    stage           parameters   gradients   optimizer   total             Ψ=7.5B, N_d=64
    DP              4Ψ           4Ψ          KΨ          16Ψ               120 GB
    1: P_os         4Ψ           4Ψ          KΨ/N_d      8Ψ + 8Ψ/N_d       61 GB
    2: P_os+g       4Ψ           4Ψ/N_d      KΨ/N_d      4Ψ + 12Ψ/N_d      31 GB
    3: P_os+g+p     4Ψ/N_d       4Ψ/N_d      KΨ/N_d      16Ψ/N_d           1.9 GB

Besides these (counted in memory_bytes, from the arrays): AdamW's 8-byte step counter per
tensor it steps (DP: per parameter tensor; ZeRO: per segment piece, parallel/zero/flat.py); the
groups' scratch; at stage 3 two gather slots of the largest layer (parallel/zero/stage3.py). Within
a step (not in memory_bytes, read after it; bench memory's tracemalloc peak sees it): one layer's
full gradients until its reduce-scatter (parallel/zero/grads.py). A rank's chunks differ
by at most one element per segment, so "Ψ/N_d" is this rank's count, summing to Ψ exactly.

One step, over the data-parallel `group` (the whole world, or a mesh's DP axis):

    stage 1   forward; backward into DDP's whole-gradient buckets, each bucket reduce-
              scattered (overlapped as DDP's allreduces are); clip by the global norm
              (each rank's squared norm of its chunks, summed); AdamW on my chunks only,
              but the part of a parameter no rank's backward reached (DDP's .grad None)
              put back after it, as DDP's optimizer skips it; allgather every bucket
    stage 2   the same, but a bucket's gradients go to a staging vector when ready and are
              dropped after its reduce-scatter: only my gradient chunks stay
              (parallel/zero/grads.py)
    stage 3   parameters sharded too: each layer is allgathered before its forward and
              again before its backward, released after (parallel/zero/stage3.py); its
              gradients are reduce-scattered when ready; AdamW on my chunks; no allgather

At stages 2 and 3 this recipe steps every chunk: the models of the command line have no
parameter that a step leaves without a gradient. FullyShardedDataParallel, the same stages
as a piece for a user's model, skips such a parameter as DDP does (one small max-allreduce
of its reached flags per step, which this recipe does not pay).

Communication per rank per step (ring algorithms, n elements): DP allreduces 2(N-1)/N·Ψ;
stages 1 and 2 reduce-scatter and allgather (N-1)/N·Ψ each, the same bytes; stage 3 adds the
allgather of backward, 3(N-1)/N·Ψ = 1.5x. Stages 2 and 3 are assembled by parallel/zero/sharded.py,
which FullyShardedDataParallel (parallel/zero/fsdp.py, the same stages as a piece) builds on too.

--grad-accum K: at stages 1 and 2 the first K - 1 backwards sum their gradients locally
(DDP's buckets at stage 1, the parameters' own .grad at stage 2), the last reduce-scatters
the sums once, as DDP does; stage 3 reduce-scatters every micro-batch and adds the chunks
(parallel/zero/grads.py: holding every layer's whole gradient is what it exists to avoid).
The recipe here hands the step skeleton (step.py) `ZeROAxis` (zero_axis.py: the data-
parallel axis as ZeRO, stages 1-3 assembled) over the whole group; over a mesh's DP axis,
with a TP model inside, the hybrid recipe (tp.py) builds the same axis
(zero_over_tp.py).
"""

import numpy as np

from minidp import comm
from minidp.cli.strategies.protocol import Recipe
from minidp.cli.strategies.step import check_micro_batches
from minidp.cli.strategies.zero_axis import ZeROAxis
from minidp.cli.training.config import BadConfig
from minidp.parallel.across_ranks import global_l2, replica_spread
from minidp.parallel.zero.sharded import ALGOS


def model_state_bytes(stage: int, psi: int, n: int, itemsize: int = 4, k: int = 8) -> dict:
    """The paper's formulas (table above) per category, for Ψ parameters on N_d = n ranks;
    stage 0 is plain DP. Exact when n divides psi; otherwise a rank's Ψ/N_d is its count."""
    shard = psi / n
    return {
        "parameters": itemsize * (shard if stage == 3 else psi),
        "gradients": itemsize * (shard if stage >= 2 else psi),
        "optimizer": k * (shard if stage >= 1 else psi),
    }


def check_zero(config, dp_size: int, name: str = "zero") -> None:
    """BadConfig (one line, alike on every rank) unless --zero-stage and --allreduce work."""
    if config.zero_stage not in (1, 2, 3):
        raise BadConfig(f"--strategy {name} needs --zero-stage 1, 2 or 3, got {config.zero_stage}")
    check_micro_batches(config, dp_size)
    if config.allreduce not in ALGOS:
        raise BadConfig(
            f"--strategy zero reduce-scatters and allgathers: --allreduce "
            f"{config.allreduce} is not one of theirs; choose from {', '.join(ALGOS)}"
        )


class ZeRO(Recipe):
    """ZeRO stage 1, 2 or 3 (config.zero_stage) over the whole `group` (ZeROAxis)."""

    name = "zero"

    def __init__(self, task, config, group: comm.Group, timeline=None, make_optimizer=None):
        super().__init__(task, config, group, timeline)
        check_zero(config, group.size)  # alike on every rank, before any message
        self.model, self.dp_group = task.model, group
        z = ZeROAxis(task.model, group, config, self.timeline, make_optimizer)
        self.zero = self.axis = z
        self.stage, self.layout, self.pieces, self.shard = z.stage, z.layout, z.pieces, z.shard
        self.optimizer, self.comm_group, self.gathered = z.optimizer, z.comm_group, z.gathered
        self.units = getattr(z, "units", None)
        self.axes, self.clocks, self.clip_params = (
            {"dp": [z.comm_group, group]},
            [z.clock],
            z.pieces,
        )
        self.run = z.make_step(self.loss, self.clip)
        self.data_shard = (group.rank, group.size)

    def loss(self, indices: np.ndarray):
        """The mean loss over these examples (a Tensor, to backpropagate)."""
        return self.task.loss(*self.task.batch(indices))

    def norm(self, kind: str) -> float:
        """Each rank's chunks, their squares summed over the data-parallel group."""
        return global_l2([getattr(p, kind) for p in self.pieces], shard_group=self.dp_group)

    def max_param_diff(self) -> float:
        """Spread among the ranks of the whole model (after gather_model, at stage 3)."""
        return replica_spread([p.data for p in self.task.model.parameters()], self.group)

    def replicas(self) -> list:
        """Stages 1 and 2: every rank the whole model, updated by allgather; stage 3: shards."""
        if self.stage == 3:
            return []
        return [(self.group, [(n, p.data) for n, p in self.model.named_parameters()])]

    def gather_model(self) -> None:
        if self.gathered is not None:
            self.gathered.materialize()
