"""Structured pruning: remove whole units (attention heads, hidden channels) by importance,
then slice the weights so that what is left is a smaller dense model.

    from minidp.models.prune import structured
    units = structured.mlp_units(model)          # or gpt_units(gpt): per block, heads + MLP
    structured.prune(units, amount=0.5, score="l2", optimizer=opt)   # sliced, not masked
    model.num_parameters()                       # fewer: every matmul is smaller now

Unstructured pruning (magnitude.py) zeroes single weights: the matrices keep their shapes
and a step costs what it did. Here a unit is a row or column block that one output of the
network's computation owns, and removing it shrinks every matrix that touches it:

    unit                      what it owns (the parts)                 sliced
    a hidden channel j of an  column j of W_i and b_i[j] (it makes the W_i: (in, F) -> (in, F')
    MLP, between Linear i     channel), row j of W_i+1 (it reads it)   W_i+1: (F, out) -> (F', out)
    and i+1
    an attention head h       q, k, v's columns h·hs..(h+1)·hs of the  qkv: (C, 3A) -> (C, 3A')
    (head size hs)            packed qkv weight and bias, proj's rows  proj: (A, C) -> (A', C)

A `Units` holds a group of them: `count` units and its `Part`s, each a (module, parameter
name, axis, index) with index of shape (G, count, width): unit u owns indices index[:, u]
along that axis. G is the number of blocks a packed weight lays its units out in (3 for
qkv: all the q columns, then all the k's, then the v's), so the kept units' indices,
index[:, kept].ravel(), come in the order the sliced weight needs.

Importance, one score per unit from every value it owns:
  magnitude, "l1" / "l2" (torch.nn.utils.prune.ln_structured's Ln norm):
      s_u = (sum_i |w_i|^n)^(1/n)
  first-order Taylor, "taylor" (Molchanov et al. 2019, "Importance Estimation for Neural
  Network Pruning"): the loss change of setting the unit to zero, to first order, summed
  over its values: s_u = sum_i |w_i · dL/dw_i| (after a backward: it reads .grad).

The mask (ln_structured's): the round(amount · count) units of smallest score go, ties by
position (the lower index first); at least one unit stays. `masks` zeroes them in place, the
masked dense model; `slice` takes the kept indices, the smaller dense one. Both compute the
same function: a removed channel's pre-activation is 0, relu(0) = gelu(0) = 0, and the row
that reads it is 0 too; a removed head's q, k, v are 0, so it attends evenly over v = 0 and
its output, 0, meets proj rows that are 0. Slicing drops only zeros (tests/test_prune_structured.py
checks the forwards agree in float64).

Under data parallelism every rank must remove the same units: pass `agree`, a function that
makes the score vector the same on every rank (parallel/structured_pruning.py:
`agreed_scores`, the mean over the group), before the sort.
"""

import numbers
from dataclasses import dataclass, replace

import numpy as np

from minidp.engine.nn import MLP, Linear, Module, Parameter
from minidp.models.gpt import GPT

SCORES = ("l1", "l2", "taylor")


@dataclass
class Part:
    """One parameter's share of a group of units: index (G, count, width) along `axis`."""

    module: Module
    name: str
    axis: int
    index: np.ndarray

    def values(self, kind: str = "data") -> np.ndarray:
        """(count, n) float64: row u holds the values unit u owns ("data" or "grad")."""
        array = getattr(getattr(self.module, self.name), kind)
        if array is None:
            raise ValueError(f"score 'taylor' needs gradients: {self.name} has none (backward)")
        taken = np.take(np.asarray(array, dtype=np.float64), self.index, axis=self.axis)
        taken = np.moveaxis(taken, self.axis + 1, 0)  # the unit axis first
        return taken.reshape(self.index.shape[1], -1)

    def indices(self, units: np.ndarray) -> np.ndarray:
        """These units' indices along the axis, in the packed order (the G blocks kept)."""
        return self.index[:, units].ravel()


class Units:
    """`count` units of a model and the parts of its weights they own; `after(kept)` is
    told the number left after slicing (an attention sets its n_head)."""

    def __init__(self, name: str, parts: list[Part], after=None):
        self.name, self.parts, self.after = name, parts, after
        self.count = parts[0].index.shape[1]

    def scores(self, score: str = "l2") -> np.ndarray:
        """One importance per unit (the module docstring's formulas), float64."""
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if score == "taylor":
            return sum(np.abs(p.values() * p.values("grad")).sum(axis=1) for p in self.parts)
        n = 1 if score == "l1" else 2
        return sum((np.abs(p.values()) ** n).sum(axis=1) for p in self.parts) ** (1 / n)

    def masks(self, kept: np.ndarray) -> None:
        """Zero the removed units' values in place: the masked dense model."""
        gone = np.setdiff1d(np.arange(self.count), kept)
        for p in self.parts:
            where = [slice(None)] * getattr(p.module, p.name).ndim
            where[p.axis] = p.indices(gone)
            getattr(p.module, p.name).data[tuple(where)] = 0

    def slice(self, kept: np.ndarray, optimizer=None) -> None:
        """Keep only the `kept` units: each part's parameter replaced by a smaller one (its
        optimizer state, of the parameter's shape, sliced alike: AdamW's m and v)."""
        states = {} if optimizer is None else {id(p): i for i, p in enumerate(optimizer.params)}
        for p in self.parts:
            old = getattr(p.module, p.name)
            new = Parameter(np.take(old.data, p.indices(kept), axis=p.axis))
            new.requires_grad = old.requires_grad
            setattr(p.module, p.name, new)
            if id(old) in states:
                i = states[id(old)]
                optimizer.params[i] = new
                optimizer.state[i] = {
                    k: np.take(v, p.indices(kept), axis=p.axis) if v.shape == old.shape else v
                    for k, v in optimizer.state[i].items()
                }
        if self.after is not None:
            self.after(len(kept))


def kept_units(scores: np.ndarray, amount) -> np.ndarray:
    """The units left after removing round(amount · count) of smallest score (`amount` a
    fraction in [0, 1) or a count), ties by position; sorted."""
    count = len(scores)
    if isinstance(amount, bool) or not isinstance(amount, numbers.Real):
        raise TypeError(f"amount must be a fraction or a count, got {amount!r}")
    k = int(amount) if isinstance(amount, numbers.Integral) else round(amount * count)
    if not 0 <= k < count:
        raise ValueError(f"amount {amount} removes {k} of {count} units: at least one must stay")
    return np.sort(np.argsort(scores, kind="stable")[k:])


def prune(units: list[Units], amount, score="l2", optimizer=None, agree=None, masks_only=False):
    """Remove `amount` of each group's units (per group, as ln_structured per tensor) by
    `score`; slice (or, `masks_only`, zero them in place). `agree(vector) -> vector` makes
    the scores the same on every rank (data parallelism). Returns the kept units per group."""
    scores = [u.scores(score) for u in units]
    if agree is not None:  # one message for all the groups' scores
        flat = agree(np.concatenate(scores))
        scores = np.split(flat, np.cumsum([u.count for u in units])[:-1])
    kept = [kept_units(s, amount) for s in scores]
    for u, k in zip(units, kept):
        u.masks(k) if masks_only else u.slice(k, optimizer)
    return kept


# ---- the units of two models ------------------------------------------------------------
def _blocks(G: int, count: int, width: int) -> np.ndarray:
    """index[g, u] = g·count·width + u·width + (0..width-1): G blocks of `count` units."""
    return np.arange(G * count * width).reshape(G, count, width)


def linear_channels(name: str, first: Linear, second: Linear) -> Units:
    """The hidden channels between two Linears (x W1 + b1 -> activation -> · W2)."""
    index = _blocks(1, first.weight.shape[1], 1)
    parts = [Part(first, "weight", 1, index), Part(second, "weight", 0, index)]
    if first.bias is not None:
        parts.append(Part(first, "bias", 0, index))
    return Units(name, parts)


def mlp_units(model: MLP) -> list[Units]:
    """The hidden channels of a user's MLP (minidp.nn.MLP: Linears with ReLU between)."""
    if not isinstance(model, MLP):
        raise TypeError(f"mlp_units needs a minidp.nn.MLP, got {type(model).__name__}")
    layers = model.layers
    return [
        linear_channels(f"layers.{i}", a, b) for i, (a, b) in enumerate(zip(layers, layers[1:]))
    ]


def gpt_units(model: GPT) -> list[Units]:
    """Per block, its attention heads and its MLP channels; slicing them keeps the head
    size and updates model.config's `heads` and `mlp_channels` (models/gpt.py)."""
    if not isinstance(model, GPT) or model.config.n_experts:
        raise TypeError("gpt_units needs a minidp GPT without experts (MoE blocks stay whole)")
    units = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        H = attn.n_head
        hs = attn.qkv.weight.shape[1] // (3 * H)
        qkv, heads = _blocks(3, H, hs), _blocks(1, H, hs)
        parts = [Part(attn.qkv, "weight", 1, qkv), Part(attn.proj, "weight", 0, heads)]
        parts += [Part(attn.qkv, "bias", 0, qkv)] if attn.qkv.bias is not None else []
        units.append(Units(f"blocks.{i}.attn", parts, after=_set_heads(model, i)))
        channels = linear_channels(f"blocks.{i}.mlp", block.fc, block.fc_proj)
        channels.after = _set_channels(model, i)
        units.append(channels)
    return units


def _set_heads(model: GPT, layer: int):
    def after(kept: int) -> None:
        model.blocks[layer].attn.n_head = kept
        cfg = model.config
        heads = [cfg.layer_heads(i) for i in range(cfg.n_layer)]
        model.config = replace(cfg, heads=(*heads[:layer], kept, *heads[layer + 1 :]))

    return after


def _set_channels(model: GPT, layer: int):
    def after(kept: int) -> None:
        cfg = model.config
        channels = [cfg.layer_channels(i) for i in range(cfg.n_layer)]
        model.config = replace(cfg, mlp_channels=(*channels[:layer], kept, *channels[layer + 1 :]))

    return after


def units_of(model: Module) -> list[Units]:
    """gpt_units or mlp_units, as the model is."""
    return gpt_units(model) if isinstance(model, GPT) else mlp_units(model)
