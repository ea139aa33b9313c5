"""Mixed precision: weights and gradients in 16 bits, the optimizer in float32, and a loss
scaler for float16 (Micikevicius et al. 2018, "Mixed Precision Training"; torch.amp's names).

    model = amp.to_half(model, "bf16")            # weights in bfloat16: 2 bytes a parameter
    ddp = DistributedDataParallel(model)          # gradients and their allreduce: 16 bits
    opt = optim.AdamW(model.parameters(), lr=3e-3)   # float32 masters, m, v: 12 bytes
    scaler = amp.GradScaler(group=comm.world())   # float16 only (bfloat16 needs none)
    for x, y in batches:
        loss = loss_fn(ddp(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)                      # inf or NaN on any rank: every rank skips
        scaler.step(opt)
        scaler.update()                           # halve the scale after an overflow, double
                                                  # it after growth_interval good steps
What is where, per parameter (the ZeRO paper's 2 + 2 + 12 = 16 bytes, sharded by ZeRO):

    the weight          16 bits   p.data: what forward reads (rounded to 16 bits)
    its gradient        16 bits   p.grad: what backward writes and the allreduce sends
    the master weight   float32   the optimizer's state["master"] (engine/optim.py)
    Adam's m and v      float32   the optimizer's state

The arithmetic runs in float32: an op that reads a 16-bit weight with float32 activations
computes in float32 (NumPy's promotion: `x @ W` multiplies 16-bit inputs and sums the
products in float32, as tensor cores do), and an embedding's rows are widened as they enter
(nn.computed). So activations stay float32 here: NumPy has no fast 16-bit arithmetic, and
summing in 16 bits is wrong (bfloat16 adds 1 + 1 + ... to 256). bfloat16 comes from
ml_dtypes (JAX's NumPy dtypes); float16 is NumPy's own.

On `--backend torch` the weights are torch.bfloat16 / torch.float16 tensors and so are the
matrix products' activations: torch's matmul does not promote mixed dtypes, so the engine
casts explicitly, by torch.autocast's rule (engine/casts.py: products in 16 bits; the
residual stream, LayerNorm, softmax and the loss in float32). The masters and Adam's state
are float32 tensors; a bucket of 16-bit gradients reaches MPI as its 16-bit words
(backend_torch.host_view: bfloat16 as ml_dtypes.bfloat16, a view, not a widened copy).

Why a scaler for float16 and not bfloat16: float16 has 5 exponent bits (largest 65,504,
smallest normal 6.1e-5); a gradient below 6e-8 is 0 in float16. Multiplying the loss by S
(2^16 to start) multiplies every gradient by S, out of the underflow range; the optimizer
divides S out in float32 (engine/optim.py's `grad_scale`). An overflow (inf or NaN
anywhere, on any rank) skips that step on every rank and halves S. bfloat16 has float32's
8 exponent bits, so no gradient underflows for want of range.

One difference from torch.cuda.amp: `unscale_` does not divide the gradients in place, for
16-bit gradients would underflow right there; the optimizer divides in float32. Clip with
`scaler.clip_grad_norm_`, which compares the unscaled norm.
"""

import numpy as np

from minidp import comm
from minidp.engine import optim
from minidp.engine.backend import namespace
from minidp.engine.precision import PRECISIONS, half_dtype, to_half

__all__ = ["PRECISIONS", "GradScaler", "half_dtype", "to_half"]


class GradScaler:
    """Dynamic loss scaling (torch.amp.GradScaler's arguments and methods; see the module
    docstring). `group`: the ranks whose gradients differ (a sharded or model-parallel job:
    every rank of it) agree on an overflow by one allreduce; None: this rank alone."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        group: comm.Group | None = None,
    ):
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(
                "need growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1, got "
                f"{growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.enabled, self.group = enabled, group
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._scale = float(init_scale) if enabled else 1.0
        self._good_steps = 0  # in a row, since the last overflow or growth
        self._found_inf: bool | None = None  # this step's, once unscale_ looked
        self.skipped = 0  # steps skipped for an overflow, in all (counted by update)

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss):
        """The loss times the scale: backward from it gives scaled gradients."""
        return loss * self._scale if self.enabled else loss

    def unscale_(self, optimizer: optim.Optimizer) -> bool:
        """Tell the optimizer to divide the scale out (in float32, as it steps) and look for
        inf or NaN in its gradients, agreed over `group`. Returns whether one was found."""
        if not self.enabled:
            self._found_inf = False
            return False
        optimizer.grad_scale = self._scale
        local = any(not _all_finite(p.grad) for p in optimizer.params if p.grad is not None)
        self._found_inf = self._agree(local)
        return self._found_inf

    def _agree(self, local: bool) -> bool:
        if self.group is None or self.group.size == 1:
            return local
        return bool(comm.allreduce(np.array([int(local)]), op="max", group=self.group)[0])

    def clip_grad_norm_(self, params, max_norm: float, shard_group=None) -> float:
        """Clip the scaled gradients so that the unscaled ones' global norm is at most
        max_norm (each shard counted once over `shard_group`); returns the unscaled norm."""
        from minidp.parallel.across_ranks import global_l2

        params = list(params)
        norm = global_l2([p.grad for p in params], shard_group) / self._scale
        optim.clip_grad_norm(params, max_norm * self._scale, total_norm=norm * self._scale)
        return norm

    def step(self, optimizer: optim.Optimizer) -> bool:
        """optimizer.step() unless this step's gradients overflowed; returns whether it ran."""
        if self._found_inf is None:
            self.unscale_(optimizer)
        if self._found_inf:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Halve the scale after an overflow; double it after growth_interval good steps."""
        if not self.enabled or self._found_inf is None:
            self._found_inf = None
            return
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._good_steps = 0
            self.skipped += 1
        else:
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self._scale *= self.growth_factor
                self._good_steps = 0
        self._found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self._scale, "good_steps": self._good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])


def _all_finite(a) -> bool:
    """No inf or NaN in array `a`, looked for in a's own library and device (a torch
    tensor's on its GPU: one number comes back, not the gradient)."""
    return bool(namespace(a).isfinite(a).all())
