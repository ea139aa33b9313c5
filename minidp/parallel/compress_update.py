"""`--compress-on update`: compress each rank's optimizer step, not its gradient.

Karimireddy et al. (2019, "Error Feedback Fixes SignSGD") compress the *scaled step*: with
rank w's step u_w = θ - θ' (lr already in it) and residual e_w,

    p_w = u_w + e_w,   send C(p_w),   e_w = p_w - C(p_w),   θ' = θ - Σ_w (n_w/B)·C(p_w)

Compressing the gradient instead (`--compress-on gradient`, the default) puts the residual
*before* the optimizer. With SGD that is nearly the same thing; with Adam it is not: Adam
divides each coordinate by the root of its second moment, so a coordinate that error
feedback sends once every T steps, as a burst T times its gradient, moves about one lr per
burst instead of one lr per step, and the burst inflates v for ~1/(1-β₂) steps after. The
magnitude that error feedback saved up is normalized away (measured: top-k at density 0.1
is within 0.1% of none with momentum SGD at 40 steps, +11% with AdamW).

Here every rank runs its own optimizer on its own gradient (clipped locally, as Deep
Gradient Compression clips), and the compressor (the same DDP hook) reduces the steps. The
parameters stay bitwise identical on every rank (the same θ, the same summed bits); the
optimizers' moments do not (each saw its own gradients): they are per-rank state.
"""

import numpy as np

from minidp import optim
from minidp.parallel.strategy import StepResult, global_loss


def local_backward(strategy, local: np.ndarray) -> tuple[float, float]:
    """This rank's own mean gradient in the buckets, not reduced yet, and (global loss, local
    loss): the first half of a step whose optimizer runs before the compressed reduction
    (here) or around it (compress_velocity.py). The global loss is one scalar allreduce."""
    ddp = strategy.ddp
    ddp.zero_grad()
    ddp.set_batch_share(len(local), strategy.config.batch_size)
    local_loss = strategy.backward(local, sync=False)
    strategy.steps_done += 1
    return global_loss(local_loss, ddp.share, strategy.dp_group), local_loss


def update_step(strategy, local: np.ndarray, lr: float) -> StepResult:
    """One step of DataParallel with the optimizer before the (compressed) reduction."""
    ddp, config = strategy.ddp, strategy.config
    span = strategy.timeline.span
    strategy.optimizer.lr = lr
    step_loss, local_loss = local_backward(strategy, local)
    if not np.isfinite(step_loss):  # alike on every rank: no step, no message
        return StepResult(step_loss, local_loss)
    params = ddp.parameters()
    with span("optimizer"):
        if config.grad_clip:  # local clipping: this rank's gradient, before its step
            optim.clip_grad_norm(params, config.grad_clip)
        before = [p.data.copy() for p in params]
        strategy.optimizer.step()
        for p, theta in zip(params, before):  # .grad := u_w (weighed into the buckets); θ back
            p.grad[...] = theta - p.data
            p.data[...] = theta
    with span("gradient sync wait"):
        ddp.finish_gradient_sync()  # every bucket through the hook: Σ_w (n_w/B)·C(p_w)
    for p in params:
        if p.grad is not None:  # None: no rank's backward reached it (DDP's rule)
            p.data -= p.grad
    return StepResult(step_loss, local_loss)
