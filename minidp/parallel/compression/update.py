"""`--compress-on update`: compress each rank's optimizer step, not its gradient.

Karimireddy et al. (2019, "Error Feedback Fixes SignSGD") compress the *scaled step*: with
rank w's step u_w = θ - θ' (lr already in it) and residual e_w,

    p_w = u_w + e_w,   send C(p_w),   e_w = p_w - C(p_w),   θ' = θ - Σ_w (n_w/B)·C(p_w)

Compressing the gradient instead (`--compress-on gradient`, the default) puts the residual
*before* the optimizer. With SGD that is nearly the same thing; with Adam it is not: Adam
divides each coordinate by the root of its second moment, so a coordinate that error
feedback sends once every T steps, as a burst T times its gradient, moves about one lr per
burst instead of one lr per step, and the burst inflates v for ~1/(1-β₂) steps after. The
magnitude that error feedback saved up is normalized away (docs/compression.md measures
top-k against none with momentum SGD and with AdamW).

Here every rank runs its own optimizer on its own gradient (clipped locally, as Deep
Gradient Compression clips), and the compressor (the same DDP hook) reduces the steps. The
parameters stay bitwise identical on every rank (the same θ, the same summed bits); the
optimizers' moments do not (each saw its own gradients): they are per-rank state.

Two pieces, usable on a user's own DDP (the training loop's step skeleton, parallel/step.py, runs
the same): `LocalGradients(ddp)`, a synchronizer whose backwards never reduce, and
`CompressedUpdate(optimizer, ddp)`, an optimizer whose `step()` reduces the update:

    ddp = DistributedDataParallel(model, group)
    ddp.register_comm_hook(TopK(0.1))               # C, with error feedback
    sync, opt = LocalGradients(ddp), CompressedUpdate(AdamW(model.parameters(), lr), ddp)
    sync.zero_grad()
    with sync.no_sync():                            # this rank's own gradient, unreduced
        loss_fn(model(x), y).backward()
    clip_grad_norm(model.parameters(), 1.0)         # local clipping, before its step
    opt.step()                                      # u_w, Σ_w (n_w/B)·C(p_w), θ -= Σ
"""

from minidp.comm.trace import Timeline
from minidp.parallel.data_parallel.ddp import DistributedDataParallel


class LocalGradients:
    """The synchronizer of a step whose reduction happens inside the optimizer: every
    backward accumulates this rank's own gradient in `ddp`'s buckets (under `ddp.no_sync()`),
    and `finish_gradient_sync()` leaves it there (CompressedUpdate's step reduces)."""

    reduces_in_backward = False  # the step skeleton runs even the last backward in no_sync

    def __init__(self, ddp: DistributedDataParallel):
        self.ddp = ddp

    def zero_grad(self) -> None:
        self.ddp.zero_grad()

    def set_batch_share(self, local_examples: int, global_examples: int) -> None:
        self.ddp.set_batch_share(local_examples, global_examples)

    def no_sync(self):
        return self.ddp.no_sync()

    def finish_gradient_sync(self) -> None:
        """Nothing yet: the gradients stay local until the optimizer has stepped on them."""


class CompressedUpdate:
    """An optimizer whose step is `optimizer`'s on this rank's own gradients, then the
    reduction of the step u_w = θ - θ' through `ddp`'s comm hook (the module docstring).
    `lr` is the inner optimizer's; its state is the state of this one."""

    def __init__(self, optimizer, ddp: DistributedDataParallel, timeline: Timeline | None = None):
        self.optimizer, self.ddp = optimizer, ddp
        self.timeline = timeline or Timeline(enabled=False)

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @lr.setter
    def lr(self, lr: float) -> None:
        self.optimizer.lr = lr

    def step(self) -> None:
        # frozen, or reached by no backward on this rank: no .grad, no step, u_w = 0 (its
        # bucket slot keeps the zeros zero_grad left)
        params = [p for p in self.ddp.parameters() if p.grad is not None]
        before = [p.data.copy() for p in params]
        self.optimizer.step()
        for p, theta in zip(params, before):  # .grad := u_w (weighed into the buckets); θ back
            p.grad[...] = theta - p.data
            p.data[...] = theta
        with self.timeline.span("gradient sync wait"):
            self.ddp.finish_gradient_sync()  # every bucket through the hook: Σ_w (n_w/B)·C(p_w)
        for p in self.ddp.parameters():
            if p.grad is not None:  # None: frozen, or no rank's backward reached it
                p.data -= p.grad

    def zero_grad(self) -> None:
        self.ddp.zero_grad()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
