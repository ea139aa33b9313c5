"""`--compress-on velocity`: Deep Gradient Compression's momentum correction with momentum
factor masking (Lin et al., ICLR 2018, "Deep Gradient Compression", section 3.2).

With `--optimizer momentum`, compressing the gradient puts error feedback *before* the
momentum: a coordinate's residual reaches the momentum late, as one burst, and the velocity
then carries that burst on for ~1/(1-m) steps. DGC moves the momentum to each rank, before
the compression, and sparsifies the velocity's accumulation instead. On rank w, with m the
momentum, g_w this rank's (clipped) gradient, weight decay added as torch adds it:

    u_w = m·u_w + (n_w/B)·(g_w + wd·θ)       momentum correction: the local velocity
    v_w = v_w + u_w                          the residual accumulates the velocity
    send top-k of v_w (its indices S_w)      the compressor, error feedback and all
    v_w[S_w] = 0,  u_w[S_w] = 0              momentum factor masking: a coordinate just
                                             sent starts again, so its stale momentum is
                                             not sent a second time
    θ = θ - lr·Σ_w v_w[S_w]                  plain SGD on the sum (the momentum is in u)

The compressor's residual e_w (compress_base.py) is v_w: it is handed u_w and keeps
e_w = (u_w + e_w) - C(u_w + e_w), which is v_w with S_w cleared, exactly. What is added here
is u_w and its masking. A `--compress-warmup` round allreduces u_w uncompressed and masks
nothing: Σ_w u_w is then the momentum buffer of the mean gradient, and the step is momentum
SGD's (tests/test_compress_velocity.py checks it against `--compress-on gradient`).

Only the sparsifiers (config.VELOCITY_COMPRESSORS: topk, randomk) clear what they sent,
so only they run here; DGC also clips each rank's gradient locally (here with the whole
--grad-clip threshold; DGC scales it by N^-1/2 for N ranks) and ramps the density up in
its first epochs (here: --compress-warmup, uncompressed steps first).
"""

import numpy as np

from minidp import comm, optim
from minidp.parallel.buckets import Bucket
from minidp.parallel.compress_update import local_backward
from minidp.parallel.strategy import StepResult

__all__ = ["MomentumCorrection", "velocity_step"]


class MomentumCorrection:
    """DDP's hook for --compress-on velocity: u_w per bucket, then the compressor on it."""

    def __init__(self, compressor, momentum: float):
        self.compressor, self.momentum = compressor, momentum
        self.velocity: dict[int, np.ndarray] = {}  # u_w, by bucket index, flat
        self.algo = f"{compressor.algo} on the velocity"

    def __call__(self, bucket: Bucket, group: comm.Group) -> None:
        """bucket.data holds (n_w/B)·(g_w + wd·θ); leave Σ_w C(v_w) there."""
        key, x = bucket.index, bucket.data
        warm = self.compressor.round(key) < self.compressor.warmup  # an uncompressed round
        u = self.velocity.get(key)
        if u is None:
            u = self.velocity[key] = x.copy()
        else:
            u *= u.dtype.type(self.momentum)
            u += x
        x[...] = u
        self.compressor(bucket, group)  # x = Σ_w C(u_w + e_w); e_w = v_w with S_w cleared
        if not warm:
            u[self.compressor.sent[key]] = 0  # momentum factor masking

    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.velocity.values())

    def state_dict(self) -> dict:
        return {"velocity": {k: u.copy() for k, u in self.velocity.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.velocity = {k: u.copy() for k, u in state["velocity"].items()}


def velocity_step(strategy, local: np.ndarray, lr: float) -> StepResult:
    """One step of DataParallel with DGC's momentum correction (the module docstring)."""
    ddp, config = strategy.ddp, strategy.config
    step_loss, local_loss = local_backward(strategy, local)  # this rank's own gradient
    if not np.isfinite(step_loss):  # alike on every rank: no step, no message
        return StepResult(step_loss, local_loss)
    params = ddp.parameters()
    with strategy.timeline.span("optimizer"):
        if config.grad_clip:  # local clipping, as DGC clips: this rank's gradient
            optim.clip_grad_norm(params, config.grad_clip)
        if config.weight_decay:  # torch's SGD: g + wd·θ, before the momentum
            for p in params:
                p.grad += p.grad.dtype.type(config.weight_decay) * p.data
    with strategy.timeline.span("gradient sync wait"):
        ddp.finish_gradient_sync()  # each bucket through MomentumCorrection
    for p in params:  # plain SGD on Σ_w C(v_w): the momentum is already in it
        if p.grad is not None:  # None: no rank's backward reached it (DDP's rule)
            p.data -= p.grad.dtype.type(lr) * p.grad
    return StepResult(step_loss, local_loss)
