"""`--strategy dp`: data parallelism as the training loop drives it (protocol.py).

    mpiexec -n 4 python -m minidp --strategy dp

Every rank holds the whole model and an optimizer of its own (--optimizer: AdamW by
default), and reads its slice of the global batch (its data-parallel coordinate is its
rank). The recipe: DistributedDataParallel over the group with what the flags plug into it
(ddp_axis.py: --compress, --prune, --compress-on), the optimizer, and the one step skeleton
(step.py): micro-batches under no_sync, buckets reduced as they fill, the global loss,
clip, step.

Replicas stay identical bit for bit, so the norm of the gradient and of the parameters are
the same on every rank: each computes them alone, with nothing to gather.
"""

from minidp import comm
from minidp.cli.strategies.ddp_axis import DDPAxis
from minidp.cli.strategies.protocol import Recipe
from minidp.cli.strategies.step import check_micro_batches
from minidp.parallel.across_ranks import global_l2, replica_spread
from minidp.parallel.structured_pruning import StructuredPruning


class DataParallel(Recipe):
    """DistributedDataParallel and an optimizer over `group` (the optimizer is the config's
    unless `optimizer` is given), with gradient accumulation."""

    name = "dp"

    def __init__(self, task, config, group: comm.Group, timeline=None, optimizer=None):
        super().__init__(task, config, group, timeline)
        check_micro_batches(config, group.size)  # alike on every rank, before any message
        self.model, self.dp_group = task.model, group
        self.axes, self.clocks = {"dp": [group]}, []  # each DDP built adds its own
        at = config.resolved().prune_structured_at  # --prune-structured's one step, or None
        self.structured = None  # or --prune-structured's pruning at its step
        if config.prune_structured:
            self.structured = StructuredPruning(task.model, config.prune_structured, at, group)
        self.build(optimizer)
        self.data_shard = (group.rank, group.size)

    def build(self, optimizer) -> None:
        """DDP around the model as it is now, the optimizer, the step skeleton."""
        dp = DDPAxis(self.model, self.group, self.config, self.timeline, optimizer)
        self.dp = self.axis = dp
        self.ddp, self.optimizer = dp.ddp, dp.optimizer
        self.compressor, self.pruning = dp.compressor, dp.pruning
        self.axes["dp"].insert(0, dp.ddp.comm_group)  # what the DDPs before it sent stays
        self.clocks.append(dp.clock)
        self.clip_params = dp.ddp.parameters()
        self.run = dp.make_step(self.loss, self.clip, self.timeline, self.group)

    def step(self, local, lr):
        if self.structured and self.structured.begin_step():  # --prune-structured: the step
            self.dp.close()  # DDP's buckets hold the old shapes: sliced, it is built again
            self.structured.prune(self.optimizer)  # AdamW's m and v sliced with the weights
            from_config = self.dp.optimizer_from_config
            self.build(self.optimizer)
            self.dp.optimizer_from_config = from_config
        return self.run(local, lr)

    def describe(self) -> str:
        return super().describe() + (f" | {self.structured.describe()}" if self.structured else "")

    def record(self) -> dict:
        return {**super().record(), **(self.structured.record() if self.structured else {})}

    def norm(self, kind: str) -> float:
        """Replicas: the local norm is the global one."""
        return global_l2([getattr(p, kind) for p in self.ddp.parameters()])

    def max_param_diff(self) -> float:
        return replica_spread([p.data for p in self.ddp.parameters()], self.group)

    def replicas(self) -> list:
        """Every rank a whole replica."""
        return [(self.group, [(n, p.data) for n, p in self.model.named_parameters()])]
