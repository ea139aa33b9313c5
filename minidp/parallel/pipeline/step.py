"""The pipeline's step: parallel/step.py's skeleton with its forward and backward replaced by
a schedule (the command line's pipeline recipe, cli/strategies/pp.py, builds it).

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
from minidp.comm.trace import Timeline
from minidp.parallel.pipeline.executor import measured_bubble, run_schedule, split_batch
from minidp.parallel.step import Step


class PipelineStep(Step):
    """The skeleton over this rank's `stages` ({index: PipelineStage}) of `schedule`, whose
    ranks are `pp_group`; `batch(indices)` gives (inputs, targets) of those examples. The
    other arguments are Step's (grad_accum is 1: the micro-batches are the accumulation)."""

    def __init__(self, schedule, stages, pp_group, batch, sync, optimizer, *, before_sync=(),
                 **step):  # fmt: skip
        super().__init__(None, sync, optimizer, grad_accum=1, **step)  # the stages: the loss
        self.schedule, self.stages, self.pp_group, self.batch = schedule, stages, pp_group, batch
        self.before_sync = before_sync
        self.bubbles: list[float] = []  # measured, per step
        # the bubble is measured from spans: the run's timeline, or a private one
        self.spans = self.timeline if self.timeline.enabled else Timeline()

    def forward_backward(self, local: np.ndarray) -> float:
        """This rank's schedule over the m micro-batches of its replica's examples; returns
        the replica's mean loss (from the last stage, the same on every rank of the pipe)."""
        schedule, stages, pp_group = self.schedule, self.stages, self.pp_group
        for stage in stages.values():
            stage.reset_peaks()
        inputs, targets = self.batch(local)
        micro_in, micro_t, shares = split_batch(inputs, targets, schedule.micro_batches)
        scale = self.loss_scale  # float16's loss scaler: each micro-batch's loss times it
        shares = [share * scale for share in shares] if scale != 1 else shares
        if self.spans is not self.timeline:
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
        return float(loss[0]) / scale  # the scale a power of 2: exactly the loss
