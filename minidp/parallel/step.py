"""One training step over any gradient synchronizer, written once: what the command line's
recipes run (cli/strategies/: dp, zero, tp, hybrid; the pipeline's overrides its forward
and backward), and what a script may run over its own pieces. Given them, `Step` does:

    optimizer.lr = lr; before-step hooks            # --prune: new masks on schedule steps
    sync.zero_grad(); sync.set_batch_share(n_r, B)  # weight n_r / B
    for each of the K micro-batches:                # all but the last under sync.no_sync()
        loss_k = mean loss of micro-batch k * (m_k / n_r)     # the K sum to the local mean
        backward of loss_k (x the scaler's scale)   # the synchronizer's hooks reduce
    sync.finish_gradient_sync(); after-sync hooks   # "gradient sync wait"
    global loss = allreduce_dp(n_r / B * local loss)
    if finite:  scaler.unscale_(optimizer)          # "optimizer"; fp16: an overflow anywhere
                norm = clip()                       #   skips the step on every rank
                if finite norm: optimizer.step(); after-step hooks  # ZeRO's allgather, ...
                scaler.update()

The pieces, each anything with the methods named:
- `loss(indices)`: the mean loss over these examples of the global dataset (a Tensor).
- `sync`, the gradient synchronizer: `zero_grad()`, `no_sync()` (a context: accumulate
  locally), `set_batch_share(n, B)`, `finish_gradient_sync()`. DistributedDataParallel is
  one; ZeRO's ShardedGradients (parallel/zero/grads.py) another; update.LocalGradients,
  whose backwards never reduce (`reduces_in_backward = False`), a third.
- `optimizer`: `lr` and `step()`; minidp.optim's, or a wrapper that syncs inside its step
  (parallel/compression/update.py, parallel/compression/velocity.py).
- `clip()`: scale the gradients by the global norm, each shard counted once, and return
  that norm (the same on every rank), or None where the norm is each rank's own (None: no
  clipping).
- hooks: `before` the step, `after_sync` (TP's replicated gradients), `after_step` (ZeRO's
  parameter allgather, the hybrid's drift broadcast): plain callables.
- `scaler`: float16's loss scaler (parallel/amp.py's GradScaler, agreeing over the job),
  or None.

Where the synchronizer never reduces in backward and an optimizer wrapper syncs inside its
step (compression/update.py), the trace shows an empty "gradient sync wait" here and the
real one inside "optimizer".

Replicas stay identical, so the global loss (one scalar allreduce over the data-parallel
group) and the global gradient norm are the same on every rank, and every rank skips a step
where either is not finite alike (a NaN in one rank's gradient that its loss does not show
spreads through the sync, and the global norm sees it): no message is left unmatched, and
the parameters stay as they were and identical.
"""

import contextlib
from typing import NamedTuple

import numpy as np

from minidp import comm
from minidp.comm.trace import Timeline
from minidp.engine import recompute
from minidp.parallel.across_ranks import global_loss
from minidp.tools.chunks import chunk_range
from minidp.tools.memory import activation_bytes


class StepResult(NamedTuple):
    """The global batch's loss, this rank's own part of it, and whether the optimizer
    stepped (False: the loss or the global gradient norm was not finite, on every rank;
    `overflow`: a loss scaler found inf or NaN in the scaled gradients, and lowers its scale:
    mixed precision's normal skip, not a divergence)."""

    loss: float
    local_loss: float
    stepped: bool = True
    overflow: bool = False


class Step:
    """`step(local, lr)` for the pieces given (the module docstring): `batch_size` is the
    global B, `grad_accum` K, `dp_group` the group whose ranks share the global batch."""

    def __init__(
        self,
        loss,
        sync,
        optimizer,
        *,
        batch_size: int,
        grad_accum: int,
        dp_group: comm.Group,
        timeline: Timeline,
        clip=None,
        before=(),
        after_sync=(),
        after_step=(),
        scaler=None,
    ):
        self.loss, self.sync, self.optimizer, self.clip = loss, sync, optimizer, clip
        self.batch_size, self.grad_accum, self.dp_group = batch_size, grad_accum, dp_group
        self.timeline = timeline
        self.before, self.after_sync, self.after_step = before, after_sync, after_step
        self.steps_done = 0  # backwards run (the compression record counts them)
        self.activations_peak = 0  # measured on the first step (every step is alike)
        self.scaler = scaler  # float16's loss scaler (parallel/amp.py), or None

    @property
    def loss_scale(self) -> float:
        """What backward's loss is multiplied by: the scaler's scale, or 1."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def __call__(self, local: np.ndarray, lr: float) -> StepResult:
        span, sync = self.timeline.span, self.sync
        self.optimizer.lr = lr
        for hook in self.before:
            hook()
        sync.zero_grad()
        sync.set_batch_share(len(local), self.batch_size)
        local_loss = self.forward_backward(local)
        self.steps_done += 1
        with span("gradient sync wait"):
            sync.finish_gradient_sync()
            for hook in self.after_sync:
                hook()
        step_loss = global_loss(local_loss, len(local) / self.batch_size, self.dp_group)
        stepped = bool(np.isfinite(step_loss))  # alike on every rank: no step, no message
        overflow = False
        if stepped:
            with span("optimizer"):
                if self.scaler is not None:  # an inf or NaN on any rank: every rank skips
                    overflow = self.scaler.unscale_(self.optimizer)
                norm = self.clip() if self.clip is not None and not overflow else None
                stepped = not overflow and (norm is None or bool(np.isfinite(norm)))
                if stepped:  # norm: global, alike too
                    self.optimizer.step()
                if self.scaler is not None:
                    self.scaler.update()
            if stepped:
                for hook in self.after_step:
                    hook()
        return StepResult(step_loss, local_loss, stepped, overflow)

    def forward_backward(self, local: np.ndarray) -> float:
        """Forward and backward of each of the K micro-batches of this rank's examples, all
        but the last under `sync.no_sync()` (the last too when the synchronizer never
        reduces in backward); returns this rank's mean loss."""
        span, K, local_loss = self.timeline.span, self.grad_accum, 0.0
        reduce_last = getattr(self.sync, "reduces_in_backward", True)
        for k in range(K):
            lo, hi = chunk_range(len(local), K, k)
            last = k == K - 1 and reduce_last
            first = self.steps_done == 0  # measure the activations: every step is alike
            measure = recompute.measuring(activation_bytes) if first else contextlib.nullcontext([])
            with contextlib.nullcontext() if last else self.sync.no_sync(), measure as again:
                with span("forward"):  # weight m_k / n_r: the K losses sum to the local mean
                    loss = self.loss(local[lo:hi]) * ((hi - lo) / len(local))
                held = activation_bytes(loss) if first else 0
                with span("backward"):
                    (loss * self.loss_scale if self.scaler is not None else loss).backward()
            # recomputed blocks: the graph kept, and one block's again during backward
            self.activations_peak = max(self.activations_peak, held + max(again, default=0))
            local_loss += loss.item()
        return local_loss
