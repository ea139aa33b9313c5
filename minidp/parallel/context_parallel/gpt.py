"""Context parallelism on a GPT: every rank of the group holds the whole model and T/C of
the sequence.

    model = nn.GPT(cfg, seed=0)           # every rank of the CP group: the same model
    cp = ContextParallel(model, cp_group, algo="ring", zigzag=True)   # or algo="ulysses"
    loss = cp.loss(idx, targets)          # idx, targets: the whole (B, T) batch, every rank
    loss.backward()
    cp.finish_gradient_sync()             # each gradient summed over the group
    opt.step()                            # an optimizer over model.parameters(), as usual

What a rank does that one process does not:

    tokens       only its own positions of idx: layout.positions(rank), T/C of them
    wpe          embeds those positions (GPT.embed's `positions`), not 0..T/C-1
    attention    each CausalSelfAttention's core (`attend`) is ContextParallelAttention:
                 ring_attention or ulysses_attention, the only layer that mixes positions
    the rest     position by position (LayerNorm, MLP, head): the same code on fewer rows
    loss         the mean cross-entropy of its tokens, weighted by its share of them (1/C),
                 summed over the group: forward an allreduce of the value, backward the
                 identity (Megatron's g), so `loss` is the whole batch's mean on every rank
    gradients    each rank saw T/C positions, so each parameter's gradient is a partial
                 sum (ring attention has already sent dK/dV home): finish_gradient_sync
                 allreduces (sum) every gradient over the group, and every rank steps the
                 same whole model the same way

The model must be a GPT, or a model whose attention layers have an `attend` core as
`CausalSelfAttention`'s (a TensorParallelGPT's ParallelAttention: each TP rank then runs the
ring, or Ulysses, with its own heads over its CP group) and whose forward takes `positions`
as GPT's does; its `criterion(logits, targets)` is the loss where it has one (the TP GPT's
vocab-parallel cross-entropy), else cross_entropy. Attention dropout is refused (the ring
computes no probabilities to drop).
"""

import numpy as np

from minidp import comm
from minidp.engine.functional import cross_entropy
from minidp.engine.nn import Module
from minidp.engine.tensor import Tensor, op
from minidp.models.gpt import CausalSelfAttention
from minidp.parallel.context_parallel.layout import SequenceLayout
from minidp.parallel.context_parallel.ring import RingWork, ring_attention
from minidp.parallel.context_parallel.ulysses import ulysses_attention
from minidp.parallel.same_model import check_same_model

ALGOS = ("ring", "ulysses")


def sum_over_group(x: Tensor, group: comm.Group) -> Tensor:
    """Forward: allreduce(sum) of x over the group; backward: the identity (each rank's
    share of the sum gets the whole gradient, as Megatron's g)."""
    total = comm.allreduce(np.ascontiguousarray(x.data).reshape(-1), group=group)
    return op(total.reshape(x.shape), (x,), lambda g: (g,))


class ContextParallelAttention:
    """The attention core of a CausalSelfAttention (`attend`) over a context-parallel group:
    called with this rank's rows of the packed q, k, v, (B, T/C, 3C'), as gpt.attention is
    with the whole sequence's. `work` counts the ring's score elements on this rank."""

    def __init__(self, group: comm.Group, algo: str = "ring", zigzag: bool = False):
        if algo not in ALGOS:
            raise ValueError(f"context parallelism: algo must be one of {ALGOS}, got {algo!r}")
        self.group, self.algo, self.zigzag = group, algo, zigzag
        self.work = RingWork()

    def layout(self, T: int) -> SequenceLayout:
        return SequenceLayout(T, self.group.size, self.zigzag)

    def __call__(self, qkv: Tensor, n_head: int, future=None, attn_drop=None, fused=True):
        if attn_drop is not None and attn_drop.training and attn_drop.p > 0:
            raise ValueError(
                f"context parallelism: attention dropout ({attn_drop.p}) is not supported; "
                "use dropout 0 (or eval())"
            )
        layout = self.layout(qkv.shape[1] * self.group.size)
        if self.algo == "ring":
            return ring_attention(qkv, n_head, self.group, layout, self.work)
        return ulysses_attention(qkv, n_head, self.group, layout, attn_drop, fused)


def _modules(module: Module):
    yield module
    for _, child in module.children():
        yield from _modules(child)


def attention_layers(model: Module) -> list[Module]:
    """The layers whose core `attend` context parallelism replaces: CausalSelfAttention's,
    and any other whose class has an `attend` (tensor parallelism's ParallelAttention)."""
    return [
        m
        for m in _modules(model)
        if isinstance(m, CausalSelfAttention) or hasattr(type(m), "attend")
    ]


class ContextParallel(Module):
    """`model` (a GPT) with its sequence split over `group`; see the module docstring.

    forward(idx) takes the whole (B, T) batch and gives the logits of this rank's positions,
    (B, T/C, V); loss(idx, targets) the whole batch's mean loss (the same on every rank).
    T must divide by C (by 2C with zigzag)."""

    def __init__(self, model: Module, group: comm.Group, algo: str = "ring", zigzag=False):
        self.module = model
        self.group = group
        self.attention = ContextParallelAttention(group, algo, zigzag)
        self.layers = layers = attention_layers(model)
        if not layers:
            raise ValueError("ContextParallel: the model has no CausalSelfAttention to split")
        for layer in layers:
            if algo == "ulysses" and layer.n_head % group.size:
                raise ValueError(
                    f"Ulysses: {layer.n_head} heads do not divide by {group.size} ranks"
                )
            layer.attend = self.attention  # this instance's core, not the class's
        check_same_model(model, group)

    def layout(self, T: int) -> SequenceLayout:
        """Which positions of a T-long sequence each rank holds."""
        return self.attention.layout(T)

    def shard(self, x: np.ndarray) -> np.ndarray:
        """This rank's positions of a whole (B, T, ...) array (targets, say)."""
        x = np.asarray(x)
        return self.layout(x.shape[1]).shard(x, self.group.rank)

    def forward(self, idx: np.ndarray) -> Tensor:
        idx = np.asarray(idx)
        mine = self.layout(idx.shape[-1]).positions(self.group.rank)
        return self.module(idx[:, mine], positions=mine)

    def loss(self, idx: np.ndarray, targets: np.ndarray) -> Tensor:
        """The mean cross-entropy over the whole batch: this rank's tokens' mean times its
        share 1/C, summed over the group (backward: this rank's share's gradient)."""
        criterion = getattr(self.module, "criterion", cross_entropy)
        share = criterion(self(idx), self.shard(targets)) * (1.0 / self.group.size)
        return sum_over_group(share, self.group)

    def restore_attention(self) -> None:
        """Give every attention layer back its class's own core (whole sequences again)."""
        for layer in self.layers:
            vars(layer).pop("attend", None)

    def finish_gradient_sync(self) -> None:
        """Sum every parameter's gradient over the group (each rank's is a partial sum)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        comm.allreduce_coalesced(grads, group=self.group)
