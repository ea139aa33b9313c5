"""MeshStages: a GPT cut into pipeline stages over a mesh's PP axis, TP inside each stage
and its sequence split over the CP axis, what a data-parallel axis (DDP, or ZeRO-1 over TP
shards) then wraps (Megatron-LM's 3-D placement, Narayanan et al. 2021, as one piece):

    mesh = Mesh(dp=2, tp=2, pp=2)
    schedule = build_schedule("1f1b", pp=2, micro_batches=4)
    net = MeshStages(gpt, mesh, schedule)     # net.stages: this rank's PipelineStages
    ddp = DistributedDataParallel(net.model, mesh.dp_group)   # net.model: their parameters

    TensorParallelGPT on tp_group    each rank's TP slice of every layer (tp > 1 only)
    split_model(..., pp x V)         the parts; stage s on pp rank s % pp, the others'
                                     parameters released (split.py)
    StagesOverCP on cp_group         each rank's T/C positions: its attention, embedded
                                     positions, batch and loss (cp > 1 only;
                                     parallel/context_parallel/stages.py)
    PipelineStage per stage          its messages on pp_group (stage.py)

Then `batch(whole_batch)` (what the pipeline's step reads: this rank's positions of the
examples), and around the data-parallel sync: `before_sync` (the hooks the step runs
before it: `sum_partial()` under sequence parallelism, each TP rank's replicated
gradients covering its T/tp positions; the CP group's sum of every gradient, each CP
rank's covering its T/C positions), `sync_replicated(take_rank0)` (TP's
replicated gradients alike), `norm(kind)` (each shard counted once: the square sums over TP,
then over PP), and `gather_into(gpt)`, the whole model back on every rank (its attention
whole-sequence again).
"""

import math

import numpy as np

from minidp import comm
from minidp.engine import functional
from minidp.parallel.across_ranks import stand_in
from minidp.parallel.context_parallel.stages import StagesOverCP
from minidp.parallel.pipeline.split import RankStages, gather_stages, split_model
from minidp.parallel.pipeline.stage import PipelineStage
from minidp.parallel.tensor_parallel.gpt import TensorParallelGPT, whole_arrays
from minidp.parallel.tensor_parallel.replicated import make_alike, sum_of_squares


class MeshStages:
    """This rank's stages of `gpt` under `schedule` on `mesh` (see the module docstring).
    Attributes: `stages` {stage index: PipelineStage}, `model` (a RankStages of their
    parts: what DDP or ZeRO wraps), `params`, `sharded` and `replicated` (TP-split or
    whole), `tp_model` (None at tp = 1), `cp` (the StagesOverCP, None at cp = 1),
    `before_sync` (hooks). `cp_algo`, `zigzag`: ContextParallelAttention's."""

    def __init__(self, gpt, mesh, schedule, *, recompute=False, sequence_parallel=False,
                 cp_algo="ring", zigzag=False):  # fmt: skip
        self.mesh, self.schedule = mesh, schedule
        S, rank = schedule.num_stages, mesh.pp_group.rank
        self.tp_model, model = None, gpt
        if mesh.tp > 1:
            self.tp_model = model = TensorParallelGPT(
                gpt, mesh.tp_group, sequence_parallel=sequence_parallel
            )
        self.parts = split_model(model, S, recompute=recompute)
        loss_fn = self.tp_model.criterion if self.tp_model else functional.cross_entropy
        self.cp = None
        if mesh.cp > 1:
            self.cp = StagesOverCP(self.parts, mesh.cp_group, cp_algo, zigzag)
            loss_fn = self.cp.loss(loss_fn)
        self.stages = {
            s: PipelineStage(self.parts[s], s, S, mesh.pp_group, loss_fn=loss_fn)
            for s in schedule.stages_of(rank)
        }
        self.model = RankStages([self.parts[s] for s in self.stages])
        self.params = self.model.parameters()
        mine = {id(p) for p in self.params}
        others = gpt.parameters() + (self.tp_model.parameters() if self.tp_model else [])
        for p in others:  # the whole model's and the other stages': released
            if id(p) not in mine:
                p.data = stand_in(p)
        split = [p.placement.axis is not None if self.tp_model else False for p in self.params]
        self.sharded = [p for p, s in zip(self.params, split) if s]
        self.replicated = [p for p, s in zip(self.params, split) if not s]
        self.before_sync = [self.sum_partial] if self.tp_model and sequence_parallel else []
        if self.cp:
            self.before_sync.append(lambda: self.cp.finish_gradient_sync(self.params))

    def batch(self, whole_batch):
        """What the step reads, `whole_batch(indices) -> (inputs, targets)`: whole
        sequences, or with cp > 1 this rank's positions of them."""
        return self.cp.batch(whole_batch) if self.cp else whole_batch

    def sum_partial(self) -> None:
        """Sequence parallelism, after the schedule and before the DP sync: each TP rank's
        replicated gradients cover its T/tp positions; the group sums them."""
        make_alike(self.replicated, self.mesh.tp_group, partial=True, take_rank0=False)

    def sync_replicated(self, take_rank0: bool) -> None:
        """After the DP sync: TP's replicated gradients alike on every TP rank (TP rank 0's
        where the DP sums may differ by rank)."""
        make_alike(self.replicated, self.mesh.tp_group, False, take_rank0=take_rank0)

    def norm(self, kind: str, tp_sum_of_squares: float | None = None) -> float:
        """Collective over TP and PP: sqrt(Σ_pp (Σ_tp sharded² + replicated²)) of "data" or
        "grad"; `tp_sum_of_squares`: this stage's sum when a sharded optimizer has it."""
        total = tp_sum_of_squares
        if total is None:
            total = sum_of_squares(self.sharded, self.replicated, kind, self.mesh.tp_group)
        return math.sqrt(float(comm.allreduce(np.array([total]), group=self.mesh.pp_group)[0]))

    def gather_into(self, gpt) -> None:
        """Collective: each stage's parameters whole over TP, then broadcast from its pp
        rank into `gpt`, on every rank; its attention layers whole-sequence again (at
        tp = 1 the stages' layers are gpt's own)."""
        if self.cp:
            self.cp.restore_attention()
        if self.tp_model:
            whole = whole_arrays(self.params, self.mesh.tp_group)
        else:
            whole = {name: p.data for name, p in self.model.named_parameters()}
        s = self.schedule
        gather_stages(gpt, s.num_stages, whole, s.stage_rank, self.mesh.pp_group)
