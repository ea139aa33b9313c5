"""A mixture-of-experts layer: route each token to k experts, run them, combine the results
with the gates (GShard, Switch Transformer; the routing is routing.py).

    moe = MoE(n_embd=32, n_experts=4, top_k=2, capacity_factor=1.25, rng=rng)
    y = moe(x)                                  # x, y: (B, T, C)
    loss = cross_entropy(head(x + y), targets) + load_balancing_loss(model)

The data flow of one forward, N tokens, E experts, S slots per expert:

    x (N, C) --router--> p (N, E) --route--> kept assignments (token, expert, slot, gate)
    dispatch:  buf[e, s] = x[token]                           (E, S, C), zeros where unused
    experts:   out[e] = expert_e(buf[e])                      (E, S, C)
    combine:   y[n] = sum over n's assignments of gate * out[expert, slot]       (N, C)

The buffer is GShard's dispatch tensor: every expert gets the same number of slots S, the
most that any (capacity group, expert) kept, so the experts run as equal blocks and, under
expert parallelism, the blocks travel in one all-to-all of equal rows. Unused slots hold
zeros; their outputs are never combined, so their gradients are exactly 0.

Where the experts run is the dispatcher's business (`moe.dispatcher`), composed in, not
inherited: `LocalExperts` below runs all E in this process; parallel/experts/ swaps in one
that sends each expert's slots to the rank holding it and sums the load over the
data-parallel ranks. A dispatcher answers three calls:

    sum_over_batch(counts)   the routing counts summed over every rank of the batch
    slots(width)             S: the width every rank exchanging buffers agrees on
    dispatcher(buf, experts) (E, S, C) -> (E, S, C), each expert on its slots

After each forward the layer keeps `aux_loss` (Switch's aux, a Tensor, unscaled) and
`load` (ExpertLoad: the histogram over the whole batch). `load_balancing_loss(model)` sums
aux_loss_coef * aux_loss over a model's MoE layers: what a training loop adds to its loss.
"""

from dataclasses import dataclass

import numpy as np

from minidp.engine import functional as F
from minidp.engine.nn import Linear, Module
from minidp.engine.tensor import Tensor, op
from minidp.models.moe.routing import route

__all__ = [
    "MoE",
    "Expert",
    "ExpertLoad",
    "LocalExperts",
    "combine",
    "dispatch",
    "load_balancing_loss",
    "moe_layers",
    "run_experts",
]


class Expert(Module):
    """One expert: the GPT block's MLP, fc -> GELU -> fc_proj."""

    def __init__(self, n_embd: int, hidden: int, *, rng, dtype=np.float32, proj_std=0.02):
        self.fc = Linear(n_embd, hidden, rng=rng, dtype=dtype, std=0.02)
        self.fc_proj = Linear(hidden, n_embd, rng=rng, dtype=dtype, std=proj_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_proj(F.gelu(self.fc(x)))


@dataclass
class ExpertLoad:
    """One forward's routing over the whole batch (every data-parallel rank's tokens):
    routed[e], the assignments the router made to expert e; dropped[e], those past its
    capacity; tokens, N; slots, S per capacity group (the buffer's width on this rank)."""

    routed: np.ndarray
    dropped: np.ndarray
    tokens: int
    slots: int


def dispatch(x: Tensor, token, expert, slot, n_experts: int, n_slots: int) -> Tensor:
    """(N, C) -> (E, S, C): buf[expert[a], slot[a]] = x[token[a]], zeros elsewhere."""
    buf = np.zeros((n_experts, n_slots, x.shape[1]), dtype=x.dtype)
    buf[expert, slot] = x.data[token]

    def backward(g):  # each token's gradient: the sum over the slots it was copied to
        dx = np.zeros_like(x.data)
        np.add.at(dx, token, g[expert, slot])
        return (dx,)

    return op(buf, (x,), backward)


def combine(out: Tensor, gate: Tensor, token, expert, slot, n_tokens: int) -> Tensor:
    """(E, S, C) -> (N, C): y[n] = sum over n's assignments a of gate[a] * out[expert, slot]."""
    picked = out.data[expert, slot]  # (M, C)
    y = np.zeros((n_tokens, out.shape[2]), dtype=out.dtype)
    np.add.at(y, token, gate.data[:, None] * picked)  # a token's choices added in order

    def backward(g):
        g_picked = g[token]  # (M, C): dL/dy of each assignment's token
        d_out = np.zeros_like(out.data)  # unused slots: exactly 0
        d_out[expert, slot] = g_picked * gate.data[:, None]  # each (expert, slot) once
        d_gate = (g_picked * picked).sum(axis=1)  # dy/dgate = the expert's output
        return d_out, d_gate

    return op(y, (out, gate), backward)


def run_experts(experts: list, buf: Tensor) -> Tensor:
    """(E, S, C) -> (E, S, C): expert e on its S slots, one after another."""
    return F.stack([expert(buf[e]) for e, expert in enumerate(experts)])


class LocalExperts:
    """The plain dispatcher: every expert in this process, the batch all here."""

    def sum_over_batch(self, counts: np.ndarray) -> np.ndarray:
        return counts

    def slots(self, width: int) -> int:
        return width

    def __call__(self, buf: Tensor, experts: list) -> Tensor:
        return run_experts(experts, buf)


class MoE(Module):
    """E experts (each fc -> GELU -> fc_proj, `hidden` wide) behind a router, in place of
    an MLP: (..., C) -> (..., C). top_k 1 (Switch) or 2 (GShard's renormalized gates);
    capacity_factor 0 is dropless; `capacity_groups` G cuts the tokens into G groups with a
    capacity each (routing.py); a one-process model set to G = R ranks drops exactly what
    R data-parallel ranks drop. `proj_std`: fc_proj's init, as the GPT's residual layers."""

    def __init__(
        self,
        n_embd: int,
        n_experts: int,
        top_k: int = 1,
        capacity_factor: float = 0.0,
        *,
        rng: np.random.Generator,
        dtype=np.float32,
        hidden: int | None = None,
        proj_std: float = 0.02,
        aux_loss_coef: float = 0.01,
        capacity_groups: int = 1,
    ):
        if n_experts < 1 or not 1 <= top_k <= n_experts:
            raise ValueError(
                f"need n_experts >= 1 and 1 <= top_k <= n_experts, got "
                f"n_experts={n_experts}, top_k={top_k}"
            )
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_loss_coef, self.capacity_groups = aux_loss_coef, capacity_groups
        self.router = Linear(n_embd, n_experts, bias=False, rng=rng, dtype=dtype, std=0.02)
        hidden = 4 * n_embd if hidden is None else hidden
        self.experts = [
            Expert(n_embd, hidden, rng=rng, dtype=dtype, proj_std=proj_std)
            for _ in range(n_experts)
        ]
        self.dispatcher = LocalExperts()
        self.aux_loss: Tensor | None = None  # the last forward's (unscaled)
        self.load: ExpertLoad | None = None  # the last forward's

    def forward(self, x: Tensor) -> Tensor:
        *lead, C = x.shape
        h = x.reshape(-1, C)  # (N, C): every token alike
        N, E, k = h.shape[0], self.n_experts, self.top_k
        probs = F.softmax(self.router(h), axis=-1)  # (N, E)
        r = route(probs, k, self.capacity_factor, self.capacity_groups)

        # the counts over the whole batch: one message for the histogram and for f_e
        mine = np.concatenate([r.routed, r.dropped, [N]]).astype(np.int64)
        total = self.dispatcher.sum_over_batch(mine)
        S = self.dispatcher.slots(r.width)  # slots per capacity group
        self.load = ExpertLoad(total[:E], total[E : 2 * E], int(total[-1]), S)
        f = (total[:E] / (total[-1] * k)).astype(probs.dtype)  # f_e: a constant to backward
        # P_e over this process's tokens: under data parallelism the ranks' aux losses
        # average to the global one, and so do their gradients (docs/experts.md)
        self.aux_loss = (probs.mean(axis=0) * f).sum() * E

        slot = r.group * S + r.position  # each capacity group its own S slots
        buf = dispatch(h, r.token, r.expert, slot, E, self.capacity_groups * S)
        out = self.dispatcher(buf, self.experts)
        y = combine(out, r.gate, r.token, r.expert, slot, N)
        return y.reshape(*lead, C)


def moe_layers(model: Module, prefix: str = ""):
    """(dotted name with a trailing dot, layer) for every MoE layer in `model`."""
    if isinstance(model, MoE):
        yield prefix, model
        return
    for name, child in model.children():
        yield from moe_layers(child, f"{prefix}{name}.")


def load_balancing_loss(model: Module):
    """sum over the model's MoE layers of aux_loss_coef * aux_loss, from their last
    forward: a Tensor to add to the training loss (0.0 for a model without one)."""
    total = 0.0
    for _, layer in moe_layers(model):
        if layer.aux_loss is not None and layer.aux_loss_coef:
            total = layer.aux_loss * layer.aux_loss_coef + total
    return total
