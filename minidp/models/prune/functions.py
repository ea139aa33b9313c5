"""Pruning as functions on a model you built, under torch.nn.utils.prune's names.

    from minidp.models.prune import functions as prune
    prune.l1_unstructured(model.layers[0], "weight", amount=0.5)       # half of one matrix
    prune.global_unstructured([(m, "weight") for m in model.layers], amount=0.8)
    ...train: loss.backward(); opt.step()   # pruned weights stay exactly 0
    prune.remove(model.layers[0], "weight")  # permanent: the zeros stay, the mask goes

The masks are minidp/models/prune/magnitude.py's `magnitude_masks` (the smallest |w| go
first; ties by position). `amount` is a fraction in [0, 1] (round(amount · n) entries) or
a count, as in torch, and like torch's repeated calls it counts among the entries *still unpruned*:
pruning 0.5 twice leaves a quarter. `global_unstructured` draws one threshold over all the
(module, name) pairs it is given.

How it differs from PyTorch. torch keeps the dense `weight_orig` as the parameter and a
`weight_mask` buffer, and recomputes weight = weight_orig · mask before every forward; the
mask is in the graph, so the masked gradient is zero by the chain rule. minidp has no
forward pre-hooks, so it does the simplest equivalent: it zeroes the weight itself (the
parameter stays `module.weight`; the values pruned are gone, as after torch's `remove`),
keeps the mask as `module.weight_mask` (a NumPy bool array, True = kept), and registers a
grad-ready hook (engine/tensor.py) on the weight that zeroes the masked entries of its gradient
the moment backward finishes it. What torch's effective weight sees, minidp's weight sees:
gradient 0 at a masked entry (so clipping norms agree too), and the weight stays 0 through
SGD and decoupled weight decay. An optimizer that has already stepped remembers the pruned
weights' past gradients in its moments (AdamW's m, v), which would move them off zero (torch's
weight_orig drifts too, but the mask hides it): pass it as `optimizer=` and those entries
are zeroed with the weight.

With data parallelism: the mask hook goes ahead of any hook already on the weight
(`prepend=True`), so it zeroes the masked entries before DDP's own grad-ready hook weighs the
gradient into its bucket, whether the weight was pruned before or after wrapping;
`minidp.parallel.masked_allreduce_hook(ddp)` then sends only the kept gradients. Every
rank computes the same masks from its identical replica.
"""

import itertools
import numbers

import numpy as np

from minidp.engine.nn import Module, Parameter
from minidp.models.prune.magnitude import magnitude_masks, zero_masked

_stamps = itertools.count(1)  # every mask change gets a new stamp: the DP hook re-packs on it


def l1_unstructured(module: Module, name: str, amount, optimizer=None) -> Module:
    """Mask the `amount` smallest-|w| entries of `getattr(module, name)` still unpruned;
    zero them (and their `optimizer` state); keep the mask as `module.<name>_mask`."""
    return _prune([(module, name)], amount, optimizer)[0]


def global_unstructured(parameters, amount, optimizer=None) -> None:
    """l1_unstructured over every (module, name) pair at once: one threshold for all."""
    _prune(list(parameters), amount, optimizer)


def is_pruned(module: Module) -> bool:
    """Whether this module or any module inside it holds a mask (torch's is_pruned)."""
    return any(getattr(m, "_pruned", None) for m in _modules(module))


def remove(module: Module, name: str) -> Module:
    """Make the pruning permanent: the zeros stay in the weight, the mask and its gradient
    hook go (from here on the weight trains as any other)."""
    _parameter(module, name)
    unhook, _ = getattr(module, "_pruned", {}).pop(name, (None, 0))
    if unhook is None:
        raise ValueError(f"parameter {name!r} of {type(module).__name__} is not pruned")
    delattr(module, f"{name}_mask")
    unhook()
    return module


class ModelMasks:
    """The masks the functions left in `model`, as the DP hook reads a MagnitudePruner's:
    `params`, `masks` (in model order) and `version` (changes whenever a mask does)."""

    def __init__(self, model: Module):
        self.model = model

    def _pruned(self):
        for m in _modules(self.model):
            for name, (_, stamp) in getattr(m, "_pruned", {}).items():
                yield m, name, stamp

    params = property(lambda self: [getattr(m, n) for m, n, _ in self._pruned()])
    masks = property(lambda self: [getattr(m, f"{n}_mask") for m, n, _ in self._pruned()])
    version = property(lambda self: tuple(s for _, _, s in self._pruned()))


# ---- the parts ---------------------------------------------------------------------------
def _parameter(module, name) -> Parameter:
    if not isinstance(module, Module):
        raise TypeError(f"module must be a minidp.nn.Module, got {type(module).__name__}")
    param = getattr(module, name, None) if isinstance(name, str) else None
    if not isinstance(param, Parameter):
        raise ValueError(f"name {name!r}: {type(module).__name__} has no parameter by that name")
    return param


def _count(amount, remaining: int) -> int:
    """How many of the `remaining` unpruned entries `amount` prunes (torch's rules)."""
    if isinstance(amount, bool) or not isinstance(amount, numbers.Real):
        raise TypeError(f"amount must be a float in [0, 1] or an int, got {amount!r}")
    if isinstance(amount, numbers.Integral):
        if not 0 <= amount <= remaining:
            raise ValueError(f"amount {amount} must be in [0, {remaining}] (entries unpruned)")
        return int(amount)
    if not 0.0 <= amount <= 1.0:  # nan fails too
        raise ValueError(f"amount must be in [0, 1] as a fraction, got {amount}")
    return round(amount * remaining)


def _prune(pairs, amount, optimizer) -> list[Module]:
    if not pairs:
        raise ValueError("parameters must name at least one (module, name) pair")
    params = [_parameter(module, name) for module, name in pairs]
    old = [getattr(m, f"{n}_mask", np.ones(p.shape, bool)) for (m, n), p in zip(pairs, params)]
    total = sum(p.size for p in params)
    pruned = total - sum(int(m.sum()) for m in old)
    k = _count(amount, total - pruned)
    # magnitude_masks prunes the pruned ones first again (they score below every live
    # weight), so asking for pruned + k of all is asking for k more among the unpruned
    masks = magnitude_masks([p.data for p in params], (pruned + k) / max(1, total), masks=old)
    zero_masked(params, masks, optimizer)
    stamp = next(_stamps)
    for (module, name), p, mask in zip(pairs, params, masks):
        setattr(module, f"{name}_mask", mask)
        hooks = module.__dict__.setdefault("_pruned", {})
        # the first pruning of this weight hooks it, once, ahead of any hook already there
        # (DDP's, which weighs the gradient into its bucket: masked first, then sent)
        unhook = (
            hooks[name][0]
            if name in hooks
            else p.register_grad_ready_hook(_mask_grad(module, name), prepend=True)
        )
        hooks[name] = (unhook, stamp)
    return [module for module, _ in pairs]


def _mask_grad(module: Module, name: str):
    """The grad-ready hook: zero the gradient where the weight's current mask is 0."""

    def hook(p):
        p.grad[~getattr(module, f"{name}_mask")] = 0

    return hook


def _modules(root: Module):
    """root and every module inside it, each once."""
    seen, stack = set(), [root]
    while stack:
        m = stack.pop()
        if id(m) not in seen:
            seen.add(id(m))
            yield m
            stack.extend(child for _, child in reversed(list(m.children())))
