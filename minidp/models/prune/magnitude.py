"""Magnitude pruning with masks, on a schedule: the model gets lighter while it trains.

    pruner = MagnitudePruner(model, optimizer, target=0.9, start=50, end=200, every=10)
    for step in range(steps):
        pruner.begin_step()            # on a pruning step: new masks, weights zeroed
        loss.backward()
        pruner.mask_grads()            # one process; under DP, parallel/pruning.py's hook
        optimizer.step()               # masked weights stay exactly 0

What is pruned. Every parameter with two or more axes: the Linear weights and the
embedding tables. Vectors (biases, LayerNorm's gain and shift) stay dense: they are 1.5% of
the default GPT (1,792 of 116,480 values) and each one scales a whole channel.

The mask (as torch.nn.utils.prune's l1_unstructured and global_unstructured compute it).
At sparsity s, the k = round(s * n) weights of smallest magnitude |w| get mask 0, the
others 1; `scope="layer"` counts n and k per weight matrix, `scope="global"` over all of
them at once (one threshold, so layers that matter less lose more). Ties are broken by
position (a stable sort: lower index pruned first), and a weight pruned once stays pruned
(it sorts below every live weight), so masks only ever lose ones. Unlike torch, which keeps
`weight_orig` and multiplies by the mask in every forward, minidp zeroes the weight itself;
the mask then says which zeros must stay.

Keeping them zero. After pruning, each masked weight w = 0 must not move again. Its
gradient is set to 0 before the optimizer (and under data parallelism it is never sent).
That alone is not enough for Adam(W): its moments m and v still remember the weight's past
gradients, so w would drift off zero for many steps. So pruning also zeroes the masked
entries of every optimizer state array of the weight's shape (m, v, SGD's velocity); with
g = m = v = 0 the update is 0 / (0 + eps) = 0, and decoupled decay (1 - lr wd) * 0 = 0.

The schedule (Zhu & Gupta 2017, "To prune, or not to prune"): the cubic ramp from s_i = 0
at step t0 = start to the target s_f at step end, pruning every Δt = every steps:

    s_t = s_f (1 - (1 - (t - t0) / (end - t0))^3)     for t0 <= t <= end, s_f after

It prunes fast early, while many weights are redundant, and slowly near the end.
Pruning steps are t0, t0 + Δt, ... and end itself. The target is the fraction of all
prunable weights (not of those left, as torch's repeated `prune` calls count it).
"""

import numpy as np

from minidp.engine.nn import Module, Parameter

SCOPES = ("global", "layer")


def prunable(model: Module) -> list[tuple[str, Parameter]]:
    """The weights pruning may zero: every parameter with two or more axes, in model order."""
    return [(name, p) for name, p in model.named_parameters() if p.data.ndim >= 2]


def cubic_sparsity(t: int, target: float, start: int, end: int) -> float:
    """Zhu & Gupta's s_t (module docstring): 0 before `start`, `target` from `end` on."""
    if t < start:
        return 0.0
    if t >= end:
        return target
    return target * (1.0 - (1.0 - (t - start) / (end - start)) ** 3)


def is_pruning_step(t: int, start: int, end: int, every: int) -> bool:
    """Whether the masks are recomputed at step t: t0, t0 + Δt, ... up to end, and end."""
    return start <= t <= end and ((t - start) % every == 0 or t == end)


def _smallest(scores: np.ndarray, k: int) -> np.ndarray:
    """A flat boolean mask that is 0 at the k smallest scores (ties: lower index first)."""
    keep = np.ones(scores.size, dtype=bool)
    keep[np.argsort(scores, kind="stable")[:k]] = False
    return keep


def magnitude_masks(
    weights: list[np.ndarray], sparsity: float, scope: str = "global", masks=None
) -> list[np.ndarray]:
    """The masks that zero round(sparsity * n) weights of smallest |w| (see the module
    docstring); `masks`, if given, are the current ones, whose zeros stay zeros."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if masks is None:
        masks = [np.ones(w.shape, dtype=bool) for w in weights]
    # a pruned weight scores -1, below every live one (|w| >= 0): it is pruned first again
    scores = [np.where(m, np.abs(w), -1.0).ravel() for w, m in zip(weights, masks)]
    if scope == "layer":
        flat = [_smallest(s, round(sparsity * s.size)) for s in scores]
    else:
        every = np.concatenate(scores)
        keep = _smallest(every, round(sparsity * every.size))
        flat = np.split(keep, np.cumsum([s.size for s in scores])[:-1])
    return [f.reshape(w.shape) for f, w in zip(flat, weights)]


def zero_masked(params: list[Parameter], masks: list[np.ndarray], optimizer=None) -> None:
    """Zero each masked weight, and its entries in every optimizer state array of its shape
    (AdamW's m and v, SGD's velocity): the module docstring says why both."""
    states = {}
    if optimizer is not None:
        states = {id(p): s for p, s in zip(optimizer.params, optimizer.state)}
    for p, mask in zip(params, masks):
        p.data[~mask] = 0
        for value in states.get(id(p), {}).values():
            if value.shape == p.shape:
                value[~mask] = 0


class MagnitudePruner:
    """Masks for a model's prunable weights, updated on the cubic schedule.

    Call `begin_step()` before each step's forward. State (`state_dict`): the masks and the
    number of steps begun, so a resumed run prunes where the straight one would."""

    def __init__(
        self,
        model: Module,
        optimizer=None,
        target: float = 0.5,
        start: int = 0,
        end: int = 0,
        every: int = 1,
        scope: str = "global",
    ):
        if not 0.0 <= target < 1.0:
            raise ValueError(f"target sparsity must be in [0, 1), got {target}")
        if not (0 <= start <= end and every >= 1):
            raise ValueError(f"bad schedule: start {start}, end {end}, every {every}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self.model, self.optimizer = model, optimizer
        self.target, self.scope = target, scope  # s_f, and how the threshold is counted
        self.start, self.end, self.every = start, end, every  # t0, end, Δt
        self.named = prunable(model)
        self.params = [p for _, p in self.named]
        self.masks = [np.ones(p.shape, dtype=bool) for p in self.params]
        self.t = 0  # steps begun
        self.version = 0  # counts mask changes (the DP hook re-packs when it moves)

    def begin_step(self) -> bool:
        """Start step t: on a pruning step, prune to s_t. True when the masks changed."""
        t, self.t = self.t, self.t + 1
        if self.target == 0 or not is_pruning_step(t, self.start, self.end, self.every):
            return False
        return self.prune_to(cubic_sparsity(t, self.target, self.start, self.end))

    def prune_to(self, sparsity: float) -> bool:
        """New masks at this sparsity from the weights as they are now, then apply them."""
        weights = [p.data for p in self.params]
        new = magnitude_masks(weights, sparsity, self.scope, self.masks)
        changed = any((a != b).any() for a, b in zip(new, self.masks))
        self.masks = new
        self.apply()
        self.version += changed
        return changed

    def apply(self) -> None:
        """Zero every masked weight and its entries in the optimizer's state (m, v, ...)."""
        zero_masked(self.params, self.masks, self.optimizer)

    def mask_grads(self) -> None:
        """Zero the gradients of masked weights (one process; DP's hook does it itself)."""
        for p, mask in zip(self.params, self.masks):
            if p.grad is not None:
                p.grad[~mask] = 0

    # ---- what it reports -------------------------------------------------------------------
    def sparsity(self) -> float:
        """The fraction of prunable weights masked now."""
        total = sum(m.size for m in self.masks)
        return 1.0 - sum(int(m.sum()) for m in self.masks) / max(1, total)

    def model_sparsity(self) -> float:
        """The fraction of all the model's values that are exactly zero."""
        params = self.model.parameters()
        zeros = sum(int((p.data == 0).sum()) for p in params)
        return zeros / sum(p.size for p in params)

    def describe(self) -> str:
        return (
            f"prune to {self.target:g} ({self.scope}), cubic from step {self.start} to "
            f"{self.end} every {self.every}"
        )

    # ---- resuming ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        masks = {name: m.copy() for (name, _), m in zip(self.named, self.masks)}
        return {"masks": masks, "t": self.t}

    def load_state_dict(self, state: dict) -> None:
        self.masks = [np.array(state["masks"][name], dtype=bool) for name, _ in self.named]
        self.t = int(state["t"])
        self.version += 1
        self.apply()
