"""`--strategy pp` and `--strategy hybrid --pp P`: the GPT's blocks cut into pipeline stages
over the PP axis of a mesh, TP inside each stage, DDP or ZeRO-1 over the DP axis.

    mpiexec -n 2 python -m minidp --strategy pp --n-layer 4 --micro-batches 4 --schedule 1f1b
    mpiexec -n 2 python -m minidp --strategy pp --n-layer 4 --schedule interleaved --virtual 2
    mpiexec -n 8 python -m minidp --strategy hybrid --dp 2 --tp 2 --pp 2 --n-layer 4
    mpiexec -n 8 python -m minidp --strategy hybrid --dp 2 --cp 2 --pp 2 --n-layer 2

Every rank builds the whole nn.GPT from the seed (the task's model). The recipe, pieces
composed (Megatron-LM's 3-D mesh, Narayanan et al. 2021):

    Mesh(dp, tp, pp, cp)             rank (d, p, c, t); one group per axis (mesh.py)
    TensorParallelGPT on tp_group    each rank's TP slice of every layer (tp > 1 only)
    split_model(..., pp x V)         the parts; stage s on pp rank s % pp, the others'
                                     parameters released (parallel/pipeline/split.py)
    StagesOverCP on cp_group         each rank's T/C positions (cp > 1 only)
    PipelineStage per stage          its messages on pp_group
    DDP (or ZeRO-1) over dp_group    this rank's stages' parameters, reduced once per step
    PipelineStep                     the skeleton with the schedule inside
                                     (parallel/pipeline/step.py)

`--strategy pp` is the mesh (1, 1, world): one pipeline, dp = tp = 1. Ranks of one
pipeline read the same examples (the data shard is the DP coordinate, (d, dp)): stage 0
needs the inputs, the last stage the targets. The gradient norm for clipping:
||g||^2 = allreduce_pp(allreduce_tp(sharded^2) + replicated^2), each shard counted once.
"""

from dataclasses import replace

import numpy as np

from minidp import comm
from minidp.cli.strategies.ddp_axis import DDPAxis
from minidp.cli.strategies.protocol import Exposed, Recipe
from minidp.cli.strategies.step import scaler_from
from minidp.cli.strategies.tp import Hybrid, MeshRecipe, check_drift, hybrid_sizes
from minidp.cli.strategies.zero import check_zero, zero_options
from minidp.cli.training.config import BadConfig
from minidp.cli.training.scheme_checks import check_pipeline, cp_zigzag
from minidp.parallel.mesh import Mesh
from minidp.parallel.pipeline.mesh_stages import MeshStages
from minidp.parallel.pipeline.schedules import build_schedule
from minidp.parallel.pipeline.simulate import formula_bubble
from minidp.parallel.pipeline.step import PipelineStep
from minidp.parallel.zero.over_tp import ZeROOverTP


def pipeline_mesh(config, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, pp) of the mesh `--strategy pp` or `--strategy hybrid --pp P` asks for;
    BadConfig (one line, alike on every rank) when the flags cannot work."""
    if config.strategy == "pp":
        pp = config.pp or world_size
        check_pipeline(config, pp)
        if pp != world_size:
            raise BadConfig(
                f"--pp {pp} must be the world's {world_size} ranks for --strategy pp; "
                "--strategy hybrid --dp D --tp T --pp P builds the whole mesh"
            )
        return 1, 1, pp
    pp = config.pp
    check_pipeline(config, pp)
    if config.zero_stage not in (0, 1):
        raise BadConfig(
            f"--zero-stage {config.zero_stage} with --pp: the pipeline runs ZeRO stage 1 "
            "only (as Megatron-LM's and DeepSpeed's pipelines do); use --zero-stage 1"
        )
    for flag, given, why in (
        ("--compress", config.compress != "none", "its hooks are DDP's over --strategy dp"),
        ("--prune", bool(config.prune), "its hooks are DDP's over --strategy dp"),
        ("--grad-accum", config.grad_accum != 1, "the pipeline's --micro-batches accumulate"),
    ):
        if given:
            raise BadConfig(f"{flag} does not run with --pp ({why})")
    if world_size % pp:
        raise BadConfig(f"--pp {pp} does not divide the world's {world_size} ranks")
    if config.dp == config.tp == 0:  # --pp alone: the rest of the world is data parallel
        config = replace(config, tp=1)
    dp, tp, cp = hybrid_sizes(config, world_size // pp)  # cp: --cp's (1 without it)
    if (n := dp * tp * pp * cp) != world_size:
        raise BadConfig(
            f"mesh: dp x tp x pp = {dp} x {tp} x {pp}{f' (x cp {cp})' * (cp > 1)} = {n}, but the"
            f" world has {world_size} ranks; choose --dp, --tp, --pp whose product is {world_size}"
        )
    if config.zero_stage:
        check_zero(config, dp, "hybrid")  # --allreduce: one of reduce-scatter's
    if config.batch_size // dp < config.micro_batches:
        raise BadConfig(
            f"--batch-size {config.batch_size} over {dp} data-parallel ranks leaves "
            f"{config.batch_size // dp} examples per replica, fewer than --micro-batches "
            f"{config.micro_batches}"
        )
    return dp, tp, pp


class Pipeline(MeshRecipe):
    """`--strategy pp`, the mesh (dp, tp, pp) = (1, 1, world), or `--strategy hybrid --dp D
    --tp T --pp P [--zero-stage 1]`; see the module doc."""

    name = "pp"

    def __init__(self, task, config, group: comm.Group, timeline=None, optimizer=None):
        super().__init__(task, config, group, timeline)
        self.name = config.strategy
        dp, tp, pp = pipeline_mesh(config, group.size)  # alike on every rank, before messages
        try:
            self.schedule = build_schedule(
                config.schedule, pp, config.micro_batches, config.virtual
            )
        except ValueError as error:  # the piece names its argument; say the flag
            raise BadConfig(f"--schedule {config.schedule}: {error}") from None
        self.mesh = mesh = Mesh(dp=dp, tp=tp, pp=pp, group=group, cp=config.cp)
        self.dp, self.zero = None, None
        try:
            self._build(task, config)
            sync, stepper, after_sync, after_step = self._data_parallel_axis(config, optimizer)
        except BaseException:
            mesh.close()
            raise
        reducer = self.dp.ddp if self.dp else self.zero  # whose comm group carries the DP bytes
        self.axes = {"dp": [reducer.comm_group, mesh.dp_group], "tp": [mesh.tp_group],
                     "pp": [mesh.pp_group], "cp": [mesh.cp_group]}  # fmt: skip
        self.clocks = [reducer, *map(Exposed, (mesh.tp_group, mesh.pp_group, mesh.cp_group))]
        self.data_shard = (mesh.dp_group.rank, dp)
        self.run = PipelineStep(
            *(self.schedule, self.stages, mesh.pp_group, self.net.batch(task.batch), sync, stepper),
            batch_size=config.batch_size,
            dp_group=mesh.dp_group,
            timeline=self.timeline,
            clip=self.clip if config.grad_clip else None,
            scaler=scaler_from(config, group),
            before_sync=self.net.before_sync,  # SP's sums over TP, CP's over CP
            after_sync=after_sync,
            after_step=after_step,
        )
        self.axis.run = self.run  # DDP's record counts the steps run

    def _data_parallel_axis(self, config, optimizer) -> tuple:
        """DDP over the mesh's DP axis, or ZeRO-1 on the TP shards (parallel/zero/over_tp.py): the
        step's (synchronizer, optimizer, after-sync hooks, after-step hooks)."""
        if config.zero_stage:
            mesh = self.mesh
            self.drifts = check_drift(config, mesh.dp, mesh.tp, self.task.model.config.vocab_size)
            z = self.zero = self.axis = ZeROOverTP(  # sum_partial sums what SP leaves partial
                self.model, mesh, self.sharded, self.replicated, sum_in_hooks=False,
                **zero_options(config, self.timeline),
            )  # fmt: skip
            self.optimizer, self.clip_params = z.optimizer, z.pieces
            return z.sync, z.optimizer, z.after_sync, [*z.after_step, self.broadcast_drift]
        d = self.dp = self.axis = DDPAxis(
            self.model, self.mesh.dp_group, config, self.timeline, optimizer
        )
        self.optimizer, self.clip_params = d.optimizer, self.params
        return d.sync, d.stepper, [self.sync_replicated], []

    def _build(self, task, config) -> None:
        """This rank's stages of the task's GPT (its TP slices when tp > 1), the others'
        parameters released (parallel/pipeline/mesh_stages.py)."""
        self.net = net = MeshStages(task.model, self.mesh, self.schedule, zigzag=cp_zigzag(config),
                                    recompute=config.recompute, cp_algo=config.cp_algo,
                                    sequence_parallel=config.sequence_parallel)  # fmt: skip
        self.stages, self.model, self.params = net.stages, net.model, net.params
        self.sharded, self.replicated = net.sharded, net.replicated

    def broadcast_drift(self) -> None:
        """After ZeRO's step: TP rank 0's replicated parameters, where they may drift (tp.py)."""
        if self.drifts:
            self.zero.broadcast_replicated()

    def sync_replicated(self) -> None:
        self.net.sync_replicated(take_rank0=self.mesh.dp > 2)

    def norm(self, kind: str) -> float:
        """Each shard once (mesh_stages.py); ZeRO-1: its chunks' sum over DP and TP."""
        return self.net.norm(kind, self.zero.sum_of_squares(kind) if self.zero else None)

    def gather_model(self) -> None:
        self.net.gather_into(self.task.model)

    def describe(self) -> str:
        s, c = self.schedule, self.config
        return (
            f"{self.mesh.describe()} | schedule {s.name} | micro-batches {s.micro_batches} | "
            f"stages {s.num_stages} (V {s.virtual}) | recompute {'on' if c.recompute else 'off'}"
            f" | {self.axis.describe()}"
        )

    def record(self) -> dict:
        s, bubbles = self.schedule, self.run.bubbles
        return {
            **super().record(),
            "schedule": s.name,
            "micro_batches": s.micro_batches,
            "virtual": s.virtual,
            "recompute": self.config.recompute,
            "bubble_fraction": float(np.mean(bubbles)) if bubbles else None,
            "bubble_fraction_formula": formula_bubble(s.name, s.pp, s.micro_batches, s.virtual),
        }

    def state_layout(self) -> dict:
        """{}: each rank's stages are its own, loaded only in the layout they were saved in."""
        return {}

    def summary(self) -> str:
        record = self.record()
        if record["bubble_fraction"] is None:
            return ""
        return (
            f"pipeline bubble: measured {record['bubble_fraction']:.3f}, "
            f"formula {record['bubble_fraction_formula']:.3f}"
        )


def hybrid(task, config, group: comm.Group, timeline=None, optimizer=None) -> Recipe:
    """`--strategy hybrid`: the 3-D mesh (Pipeline) when --pp > 1, else dp x tp (Hybrid)."""
    return picked(config)(task, config, group, timeline, optimizer)


def picked(config) -> type[Recipe]:
    return Pipeline if config.pp > 1 else Hybrid


hybrid.name = "hybrid"
hybrid.builds_deferred = lambda config: picked(config).builds_deferred(config)
