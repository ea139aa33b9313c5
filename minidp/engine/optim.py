"""Optimizers, gradient clipping and a learning-rate schedule, written as PyTorch defines them
(so tests can check them against torch.optim step by step).

Every optimizer updates `p.data` in place from `p.grad` and skips parameters whose grad is
None. On `--backend torch` the arrays are torch tensors, updated in place the same way
(`xp = namespace(w)` where a NumPy function is called). `state_dict()` holds the
hyper-parameters and per-parameter state in parameter order.

Mixed precision (parallel/amp.py) needs two things of every optimizer, both here:
- a 16-bit parameter (bfloat16, float16) is stepped through a float32 *master* copy kept in
  its state (`state["master"]`, beside Adam's m and v: 4 + 4 + 4 bytes, the ZeRO paper's
  12 per parameter), its gradient widened to float32 first; the master, rounded, is
  written back into the parameter;
- `grad_scale`: the loss was multiplied by it before backward (a GradScaler's scale), so
  each step divides the gradient by it, in float32, after widening (never in 16 bits,
  where small gradients would underflow).
With 32- and 64-bit parameters and grad_scale 1, a step is the plain step, bit for bit.
"""

import math

import numpy as np

from minidp.engine.backend import copy, is_half, namespace, widened
from minidp.engine.tensor import Tensor


class Optimizer:
    def __init__(self, params, lr: float, **hyper):
        self.params: list[Tensor] = list(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        if lr <= 0:
            raise ValueError(f"learning rate must be positive, got {lr}")
        self.lr = lr
        self.hyper = hyper
        self.state: list[dict[str, np.ndarray]] = [{} for _ in self.params]
        self.step_count = 0
        self.grad_scale = 1.0  # the loss was multiplied by this (mixed precision's scaler)
        self.after_update = None  # f(i) after parameter i's update (parallel/zero/offload.py)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.step_count += 1
        for i, (p, state) in enumerate(zip(self.params, self.state)):
            if p.grad is not None:
                self.step_one(p, state)
                if self.after_update is not None:
                    self.after_update(i)

    def step_one(self, p, state: dict) -> None:
        """One parameter's update: the plain one, or through its float32 master."""
        if not is_half(p.data) and self.grad_scale == 1:
            self.update(p.data, p.grad, state)  # the plain step
            return
        # mixed precision: the float32 master steps, from the gradient in float32 / scale
        master = state.get("master", p.data)
        if is_half(p.data) and "master" not in state:  # the first step: w in float32
            master = state["master"] = widened(p.data)
        g = widened(p.grad) if is_half(p.grad) else copy(p.grad)
        if self.grad_scale != 1:
            g /= self.grad_scale
        self.update(master, g, state)
        if master is not p.data:
            p.data[...] = master  # rounded to the parameter's 16 bits

    def update(self, w: np.ndarray, g: np.ndarray, state: dict) -> None:
        raise NotImplementedError

    def init_state(self) -> None:
        """Make each parameter's state where no step has made it yet: the zeros a first
        step starts from (a step from them is the first step's), so that a checkpoint has
        arrays to load into (PyTorch's get_state_dict makes them too)."""
        for p, state in zip(self.params, self.state):
            if not state:
                if is_half(p.data):  # a 16-bit weight's state: its float32 master, and
                    state["master"] = widened(p.data)  # the rest shaped and typed as it
                state.update(self.empty_state(state.get("master", p.data)))

    def empty_state(self, w) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {
            "lr": self.lr,
            "hyper": dict(self.hyper),
            "step_count": self.step_count,
            "state": [{k: copy(v) for k, v in s.items()} for s in self.state],
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["state"]) != len(self.params):
            raise ValueError(
                f"optimizer state has {len(state['state'])} parameters, "
                f"this optimizer {len(self.params)}"
            )
        self.lr, self.hyper = state["lr"], dict(state["hyper"])
        self.step_count = state["step_count"]
        self.state = [{k: _own(v) for k, v in s.items()} for s in state["state"]]


class SGD(Optimizer):
    """w -= lr * v, with v = momentum * v + g (first step: v = g), as torch.optim.SGD.

    weight_decay adds wd * w to g first; nesterov uses g + momentum * v instead of v."""

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ):
        if nesterov and momentum <= 0:
            raise ValueError("nesterov needs momentum > 0")
        super().__init__(
            params, lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov
        )

    def empty_state(self, w) -> dict:
        return {"velocity": namespace(w).zeros_like(w)} if self.hyper["momentum"] else {}

    def update(self, w, g, state):
        momentum, wd = self.hyper["momentum"], self.hyper["weight_decay"]
        if wd:
            g = g + wd * w
        if momentum:
            if "velocity" not in state:
                state["velocity"] = namespace(g).array(g, dtype=w.dtype)
            else:
                v = state["velocity"]
                v *= momentum
                v += g
            v = state["velocity"]
            g = g + momentum * v if self.hyper["nesterov"] else v
        w -= self.lr * g


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015), with L2 weight decay added to the gradient (torch.optim.Adam):

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """

    decoupled = False

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)

    def empty_state(self, w) -> dict:
        xp = namespace(w)
        return {"m": xp.zeros_like(w), "v": xp.zeros_like(w), "step": np.zeros((), np.int64)}

    def update(self, w, g, state):
        (b1, b2), eps, wd = self.hyper["betas"], self.hyper["eps"], self.hyper["weight_decay"]
        if wd and self.decoupled:
            w *= 1 - self.lr * wd  # AdamW: decay the weights, not the gradient
        elif wd:
            g = g + wd * w
        xp = namespace(w)  # numpy, or NumPy's names over torch (backend.py)
        if "m" not in state:
            state.update(self.empty_state(w))
        state["step"] += 1  # per parameter, as torch: a step without a gradient does not count
        m, v, t = state["m"], state["v"], int(state["step"])
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * (g * g)
        denom = xp.sqrt(v) / math.sqrt(1 - b2**t) + eps
        w -= (self.lr / (1 - b1**t)) * m / denom


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019): w *= 1 - lr * wd."""

    decoupled = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        super().__init__(params, lr, betas, eps, weight_decay)


MOMENTUM = 0.9  # --optimizer momentum, as the papers that compress SGD's gradient use it

OPTIMIZERS = {
    "adamw": lambda params, lr, wd: AdamW(params, lr=lr, weight_decay=wd),
    "momentum": lambda params, lr, wd: SGD(params, lr=lr, momentum=MOMENTUM, weight_decay=wd),
    "sgd": lambda params, lr, wd: SGD(params, lr=lr, weight_decay=wd),
}
"""--optimizer NAME -> the optimizer over a list of parameters, with the config's lr and
weight decay applied as torch applies it: AdamW's decoupled (w *= 1 - lr·wd), SGD's added to
the gradient (g + wd·w). The one table that dp, tp, hybrid and zero build theirs from."""


def make_optimizer(name: str, params, lr: float, weight_decay: float) -> Optimizer:
    """The optimizer --optimizer NAME builds (OPTIMIZERS)."""
    return OPTIMIZERS[name](params, lr, weight_decay)


def _own(v):
    """A private copy of a saved state array (a NumPy one as np.array makes it)."""
    return np.array(v) if isinstance(v, np.ndarray | np.generic) else copy(v)


def sum_of_squares(arrays) -> float:
    """sum of x*x over the arrays (None skipped): each array's in its own dtype (as torch
    does; a 16-bit one's in float32, a copy), their total in float64."""
    total = 0.0
    for a in arrays:
        if a is not None:
            a = widened(a) if is_half(a) else a
            total += float(namespace(a).vdot(a, a))
    return total


def global_grad_norm(params) -> float:
    """sqrt(sum of squares of every gradient)."""
    return math.sqrt(sum_of_squares(p.grad for p in params))


def clip_grad_norm(params, max_norm: float, total_norm: float | None = None) -> float:
    """Scale all gradients by max_norm / norm when the global norm exceeds max_norm.

    Returns the norm before clipping. Pass `total_norm` when it was computed elsewhere
    (a sharded model sums the squares across ranks first)."""
    params = list(params)
    norm = global_grad_norm(params) if total_norm is None else total_norm
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for p in params:
            if p.grad is not None:
                p.grad *= p.grad.dtype.type(scale) if isinstance(p.grad, np.ndarray) else scale
    return norm


def warmup_cosine(
    step: int, peak_lr: float, warmup: int, total: int, min_ratio: float = 0.1
) -> float:
    """Linear warmup to peak_lr over `warmup` steps, then cosine decay to peak_lr * min_ratio.

    step counts from 0; step = total gives the final rate."""
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
