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

The compressor's residual e_w (base.py) is v_w: it is handed u_w and keeps
e_w = (u_w + e_w) - C(u_w + e_w), which is v_w with S_w cleared, exactly. What is added here
is u_w and its masking. A `--compress-warmup` round allreduces u_w uncompressed and masks
nothing: Σ_w u_w is then the momentum buffer of the mean gradient, and the step is momentum
SGD's (tests/test_compress_velocity.py checks it against `--compress-on gradient`).

Only the sparsifiers (VELOCITY_COMPRESSORS in training/scheme_checks.py: topk, randomk) clear what
they sent, so only they run here; DGC also clips each rank's gradient locally (here with the whole
--grad-clip threshold; DGC scales it by N^-1/2 for N ranks) and ramps the density up in
its first epochs (here: --compress-warmup, uncompressed steps first).

On a user's own DDP, with update.LocalGradients as the synchronizer:

    ddp = DistributedDataParallel(model, group)
    ddp.register_comm_hook(MomentumCorrection(TopK(0.01), momentum=0.9))
    sync, opt = LocalGradients(ddp), MomentumCorrectedSGD(ddp, lr, weight_decay=1e-4)
    sync.zero_grad()
    with sync.no_sync():                   # g_w, this rank's own
        loss_fn(model(x), y).backward()
    clip_grad_norm(model.parameters(), 1.0)  # local, as DGC clips
    opt.step()                             # + wd·θ, u_w and C in the hook, θ -= lr·Σ
"""

import numpy as np

from minidp import comm
from minidp.comm.trace import Timeline
from minidp.parallel.data_parallel.buckets import Bucket
from minidp.parallel.data_parallel.ddp import DistributedDataParallel

__all__ = ["MomentumCorrection", "MomentumCorrectedSGD"]


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


class MomentumCorrectedSGD:
    """The optimizer of --compress-on velocity: weight decay added to this rank's own
    gradient, the sync (MomentumCorrection, DDP's hook, builds u_w and sends C(v_w)), then
    plain SGD on the sum: the momentum is already in it."""

    def __init__(
        self,
        ddp: DistributedDataParallel,
        lr: float,
        weight_decay: float = 0.0,
        timeline: Timeline | None = None,
    ):
        self.ddp, self.lr, self.weight_decay = ddp, lr, weight_decay
        self.timeline = timeline or Timeline(enabled=False)

    def step(self) -> None:
        params = self.ddp.parameters()
        if self.weight_decay:  # torch's SGD: g + wd·θ, before the momentum
            for p in params:
                if p.grad is not None:  # None: frozen, or no backward here reached it
                    p.grad += p.grad.dtype.type(self.weight_decay) * p.data
        with self.timeline.span("gradient sync wait"):
            self.ddp.finish_gradient_sync()  # each bucket through MomentumCorrection
        for p in params:  # plain SGD on Σ_w C(v_w)
            if p.grad is not None:  # None: frozen, or no rank's backward reached it
                p.data -= p.grad.dtype.type(self.lr) * p.grad

    def zero_grad(self) -> None:
        self.ddp.zero_grad()
