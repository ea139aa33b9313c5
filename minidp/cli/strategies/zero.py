"""`--strategy zero --zero-stage 1|2|3`: data parallelism without every rank holding every
model state (ZeRO, SC 2020): parallel/zero/stages.py over the whole group, the paper's Ψ
table and what each stage sends there.

    mpiexec -n 4 python -m minidp --strategy zero --zero-stage 3

The recipe checks the flags and hands the step skeleton (step.py) the piece's synchronizer,
optimizer and hooks; over a mesh's DP axis, with a TP model inside, the hybrid recipe
(tp.py) builds parallel/zero/over_tp.py instead.
"""

from minidp import comm
from minidp.cli.strategies.protocol import Recipe
from minidp.cli.strategies.step import OVERLAP, check_micro_batches, step_from
from minidp.cli.training.config import BadConfig
from minidp.engine import optim
from minidp.parallel.across_ranks import global_l2
from minidp.parallel.zero.sharded import ALGOS
from minidp.parallel.zero.stages import ZeROStages


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


def zero_options(config, timeline, make_optimizer=None) -> dict:
    """ZeROStages's arguments from the flags: --optimizer over the pieces (AdamW unless set)
    unless `make_optimizer` is given, --bucket-mb, --allreduce, --overlap."""
    c = config
    return {
        "stage": c.zero_stage,
        "make_optimizer": make_optimizer
        or (lambda ps: optim.make_optimizer(c.optimizer, ps, c.lr, c.weight_decay)),
        "bucket_mb": c.bucket_mb,
        "algo": c.allreduce,
        "overlap": OVERLAP[c.overlap],
        "timeline": timeline,
    }


class ZeRO(Recipe):
    """ZeRO stage 1, 2 or 3 (config.zero_stage) over the whole `group`."""

    name = "zero"

    def __init__(self, task, config, group: comm.Group, timeline=None, make_optimizer=None):
        super().__init__(task, config, group, timeline)
        check_zero(config, group.size)  # alike on every rank, before any message
        self.model, self.dp_group = task.model, group
        options = zero_options(config, self.timeline, make_optimizer)
        z = ZeROStages(task.model, group, **options, offload=config.offload)
        self.zero = self.axis = z
        self.stage, self.layout, self.pieces, self.shard = z.stage, z.layout, z.pieces, z.shard
        self.optimizer, self.comm_group, self.gathered = z.optimizer, z.comm_group, z.gathered
        self.units = getattr(z, "units", None)
        self.axes, self.clocks, self.clip_params = {"dp": [z.comm_group, group]}, [z], z.pieces
        self.run = step_from(
            *(config, self.loss, z.sync, z.optimizer, group, self.timeline, self.clip),
            job=group,
            after_sync=z.after_sync,
            after_step=z.after_step,
        )
        self.data_shard = (group.rank, group.size)

    def norm(self, kind: str) -> float:
        """Each rank's chunks, their squares summed over the data-parallel group."""
        return global_l2([getattr(p, kind) for p in self.pieces], shard_group=self.dp_group)

    @staticmethod
    def builds_deferred(config) -> bool:
        """Stage 3: the model is built deferred, each rank drawing only its shard's values."""
        return config.zero_stage == 3

    @property
    def sharded_forward(self) -> bool:
        """Stage 3: the model stays in shards after training, its forward gathering each
        layer (validation and sampling on every rank together, never the whole model)."""
        return self.stage == 3

    def max_param_diff(self) -> float:
        """Spread among the ranks of the whole model (stages 1 and 2: every rank holds it);
        0.0 at stage 3, where no two ranks hold the same parameters (as `replicas`)."""
        return 0.0 if self.stage == 3 else super().max_param_diff()

    def replicas(self) -> list:
        """Stages 1 and 2: every rank the whole model, updated by allgather; stage 3: shards."""
        if self.stage == 3:
            return []
        return [(self.group, [(n, p.data) for n, p in self.model.named_parameters()])]

    def gather_model(self) -> None:
        self.zero.gather_model()
