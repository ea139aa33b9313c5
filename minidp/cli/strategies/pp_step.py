"""The pipeline's step: the skeleton (step.py) with its forward and backward replaced by a
schedule (pp.py builds the recipe).

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
from minidp.cli.strategies.step import Step
from minidp.comm.trace import Timeline
from minidp.parallel.pipeline.executor import measured_bubble, run_schedule, split_batch


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
