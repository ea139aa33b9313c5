"""The pipeline's step: the skeleton (step.py) with its forward and backward replaced by a
schedule, and the checks of the mesh a pipeline runs on (pp.py builds the recipe).

Step.__call__ is the skeleton every recipe runs; `PipelineStep` overrides one method,
`forward_backward`, the K micro-batches' loop, with this rank's schedule:

    sync.zero_grad(); sync.set_batch_share(n_r, B)      the skeleton's, as ever
    forward_backward(local):                            this class
        split this replica's batch into m micro-batches, shares B_j / n_r
        with sync.no_sync():                            gradients add up over the m
            run this rank's schedule.actions()[rank]    executor.run_schedule
        before-sync hooks                               sequence parallelism's TP sums
        local loss = broadcast(sum of the last stage's losses) over pp
        bubble = idle / (pp x window) of the step's F/B/W spans
    sync.finish_gradient_sync(); after-sync hooks       the DP axis: once per step, after
                                                        the last micro-batch (DDP or ZeRO-1)
    global loss = allreduce_dp(n_r / B x local loss); clip; optimizer.step(); after-step

With dp = 1 the synchronizer is DDP over a group of one: its "reduction" is a no-op, and
the step is the plain pipeline's.
"""

import numpy as np

from minidp import comm
from minidp.parallel.pipeline.executor import measured_bubble, run_schedule, split_batch
from minidp.strategies.step import Step
from minidp.trace import Timeline
from minidp.training.config import BadConfig
from minidp.training.scheme_checks import check_pipeline


class PipelineStep(Step):
    """The skeleton over a pipeline `recipe` (pp.py): its schedule, stages and mesh."""

    def __init__(
        self, recipe, sync, optimizer, *, clip, before_sync=(), after_sync=(), after_step=()
    ):
        config = recipe.config
        super().__init__(
            *(None, sync, optimizer),  # no loss(indices): the stages compute it
            batch_size=config.batch_size,
            grad_accum=1,  # the schedule's micro-batches are the accumulation
            dp_group=recipe.mesh.dp_group,
            timeline=recipe.timeline,
            clip=clip if config.grad_clip else None,
            after_sync=after_sync,
            after_step=after_step,
        )
        self.recipe, self.before_sync = recipe, before_sync
        self.bubbles: list[float] = []  # measured, per step
        # the bubble is measured from spans: the run's timeline, or a private one
        self.spans = recipe.timeline if recipe.timeline.enabled else Timeline()

    def forward_backward(self, local: np.ndarray) -> float:
        """This rank's schedule over the m micro-batches of its replica's examples; returns
        the replica's mean loss (from the last stage, the same on every rank of the pipe)."""
        r = self.recipe
        schedule, stages, pp_group = r.schedule, r.stages, r.mesh.pp_group
        for stage in stages.values():
            stage.reset_peaks()
        inputs, targets = r.task.batch(local)
        micro_in, micro_t, shares = split_batch(inputs, targets, schedule.micro_batches)
        if self.spans is not r.timeline:
            self.spans.events.clear()  # a private timeline keeps one step's spans
        first = len(self.spans.events)
        with self.sync.no_sync():
            mine = run_schedule(schedule, stages, micro_in, micro_t, shares, self.spans)
        for hook in self.before_sync:  # sequence parallelism's sums over TP
            hook()
        self.activations_peak = max(self.activations_peak, mine.peak_bytes)
        last_rank = schedule.stage_rank(schedule.num_stages - 1)
        loss = comm.broadcast(np.array([sum(mine)], np.float64), root=last_rank, group=pp_group)
        self.bubbles.append(measured_bubble(self.spans, pp_group, first))
        return float(loss[0])


def pipeline_mesh(config, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, pp) of the mesh `--strategy pp` or `--strategy hybrid --pp P` asks for;
    BadConfig (one line, alike on every rank) when the flags cannot work."""
    from minidp.strategies.tp import mesh_sizes  # the hybrid's dp x tp, over world / pp
    from minidp.strategies.zero import check_zero

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
    dp, tp = mesh_sizes(config, world_size // pp)
    if dp * tp * pp != world_size:
        raise BadConfig(
            f"mesh: dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp}, but the world has "
            f"{world_size} ranks; choose --dp, --tp and --pp whose product is {world_size}"
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
