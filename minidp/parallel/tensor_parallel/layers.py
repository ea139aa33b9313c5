"""Tensor parallelism: each layer's weight split across the ranks of a TP group (Megatron).

Shoeybi et al. 2019 write a linear layer Y = X A (minidp's orientation: A is (in, out)).
Split A among p ranks one of two ways:

    column-parallel  A = [A_1 | ... | A_p]         rank i computes Y_i = f(X) A_i
                     (output features split)       Y = [Y_1 | ... | Y_p], gathered or not
    row-parallel     A = [A_1 ; ... ; A_p]         rank i holds X_i (columns of X) and
                     (input features split)        computes X_i A_i; Z = g(sum_i X_i A_i) + b

Put together (column, then row) a block needs no communication between its two matmuls:

                 ┌─ X A_1 ─ GeLU ─ Y_1 B_1 ─┐
    X ── f ──────┤          ...             ├── g ── Z + b        (ParallelMLP)
                 └─ X A_p ─ GeLU ─ Y_p B_p ─┘

one allreduce forward (g) and one backward (f). Attention splits the same way along heads:
QKV column-parallel (each rank its heads), the output projection row-parallel. With sequence
parallelism (communications.py) f and g become gather_sequence and reduce_scatter_sequence.

Every layer here is built from the *whole* layer of minidp.nn (`ColumnParallelLinear(full,
group)`): each rank keeps its slice of the same full weights, so a TP model built from
nn.GPT(seed) equals the one-process model with that seed. Each Parameter carries a
`placement`: the name of the whole parameter, the axis it is split along (None: replicated
on every rank of the group) and the indices of the whole it holds; gpt.py gathers the
whole model back from them.
"""

import copy
from dataclasses import dataclass

import numpy as np

from minidp import comm
from minidp.engine import functional as F
from minidp.engine import nn
from minidp.engine.registry import fast
from minidp.engine.tensor import Tensor
from minidp.models.gpt import CausalSelfAttention, attention
from minidp.parallel.tensor_parallel.communications import (
    copy_to_tensor_parallel,
    gather_last,
    gather_sequence,
    reduce_from_tensor_parallel,
    reduce_scatter_sequence,
    split_last,
)
from minidp.tools.chunks import chunk_range


@dataclass(frozen=True)
class Placement:
    """Where a TP parameter sits in the whole one: `axis` None means a full replica."""

    name: str
    axis: int | None = None
    index: np.ndarray | None = None  # the whole's indices along `axis` this rank holds
    length: int = 0  # the whole's length along `axis`


def shard(whole: nn.Parameter, name: str, axis: int, index: np.ndarray) -> nn.Parameter:
    """A new Parameter holding `whole`'s entries at `index` along `axis` (a copy)."""
    p = nn.Parameter(np.take(whole.data, index, axis=axis), dtype=whole.dtype)
    p.placement = Placement(name, axis, np.asarray(index), whole.shape[axis])
    return p


def replica(whole: nn.Parameter, name: str) -> nn.Parameter:
    """A new Parameter equal to `whole` (a copy), held whole by every rank of the group."""
    p = nn.Parameter(whole.data.copy(), dtype=whole.dtype)
    p.placement = Placement(name)
    return p


def my_range(n: int, group: comm.Group) -> np.ndarray:
    """This rank's contiguous chunk of n features (chunk_bounds: sizes differ by one)."""
    return np.arange(*chunk_range(n, group.size, group.rank))


def _enter(x: Tensor, group: comm.Group, sequence_parallel: bool) -> Tensor:
    """Into a parallel region: f, or with sequence parallelism the allgather along T."""
    return gather_sequence(x, group) if sequence_parallel else copy_to_tensor_parallel(x, group)


def _leave(x: Tensor, group: comm.Group, sequence_parallel: bool) -> Tensor:
    """Out of a parallel region: g, or with sequence parallelism the reduce-scatter along T."""
    return (
        reduce_scatter_sequence(x, group)
        if sequence_parallel
        else reduce_from_tensor_parallel(x, group)
    )


class ColumnParallelLinear(nn.Module):
    """Y_i = f(X) A_i + b_i: this rank's output features of the whole Linear `full`.

    `columns`: which output features (default: this rank's chunk of them); `gather_output`
    allgathers Y along the last axis (needs equal chunks); `sequence_parallel`: X arrives as
    this rank's T/p positions and is allgathered along T instead of passing through f."""

    def __init__(
        self,
        full: nn.Linear,
        group: comm.Group,
        *,
        name: str = "",
        columns: np.ndarray | None = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
    ):
        out = full.weight.shape[1]
        columns = my_range(out, group) if columns is None else columns
        if gather_output and out % group.size:
            raise ValueError(f"gather_output: {out} output features do not divide by {group.size}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gather_output = gather_output
        self.weight = shard(full.weight, name + "weight", 1, columns)
        self.bias = None if full.bias is None else shard(full.bias, name + "bias", 0, columns)

    def forward(self, x: Tensor) -> Tensor:
        y = nn.linear(_enter(x, self.group, self.sequence_parallel), self.weight, self.bias)
        return gather_last(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Z = g(sum_i X_i A_i) + b: this rank's input features (rows of A) of `full`.

    `input_is_parallel`: X already holds this rank's features (the output of a
    column-parallel layer); otherwise X is whole and split_last takes them. The bias is
    replicated and added once, after g. `sequence_parallel`: g becomes a reduce-scatter
    along T, and Z is this rank's T/p positions."""

    def __init__(
        self,
        full: nn.Linear,
        group: comm.Group,
        *,
        name: str = "",
        rows: np.ndarray | None = None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ):
        rows = my_range(full.weight.shape[0], group) if rows is None else rows
        self.group, self.sequence_parallel = group, sequence_parallel
        self.input_is_parallel = input_is_parallel
        self.weight = shard(full.weight, name + "weight", 0, rows)
        self.bias = None if full.bias is None else replica(full.bias, name + "bias")

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = split_last(x, self.group)
        z = _leave(nn.linear(x, self.weight), self.group, self.sequence_parallel)
        return z if self.bias is None else z + self.bias


class ParallelMLP(nn.Module):
    """Z = g(GeLU(f(X) A_i) B_i) + b: column- then row-parallel, the block of the figure above.

    Built from the two Linears of nn.Block (`fc`: C -> 4C, `fc_proj`: 4C -> C)."""

    def __init__(
        self,
        fc: nn.Linear,
        fc_proj: nn.Linear,
        group: comm.Group,
        *,
        name: str = "",
        sequence_parallel: bool = False,
        fused: bool = True,
    ):
        self.fused = fused  # the GELU as nn's Block runs it: one op (fused.gelu), or composed
        hidden = my_range(fc.weight.shape[1], group)  # the same features leave A, enter B
        self.fc = ColumnParallelLinear(
            fc, group, name=name + "fc.", columns=hidden, sequence_parallel=sequence_parallel
        )
        self.fc_proj = RowParallelLinear(
            fc_proj, group, name=name + "fc_proj.", rows=hidden, sequence_parallel=sequence_parallel
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return self.fc_proj(((self.fused and fast("gelu", h)) or F.gelu)(h))  # registry.py


def head_features(n_head: int, head_size: int, group: comm.Group) -> np.ndarray:
    """The features (of C = n_head * head_size) of this rank's heads: n_head must divide by p."""
    if n_head % group.size:
        raise ValueError(f"{n_head} attention heads do not divide by {group.size} TP ranks")
    heads = my_range(n_head, group)
    return (heads[:, None] * head_size + np.arange(head_size)).ravel()


def dropout_of_rank(full: nn.Dropout, group: comm.Group | None) -> nn.Dropout:
    """A copy of `full`; with a group, its masks drawn from a stream of this rank's own.

    Where ranks hold different elements (heads, or T/p positions under sequence
    parallelism), equal masks would correlate what one process draws independently; where
    they hold the same elements (the replicated residual stream), the masks must be equal."""
    drop = copy.deepcopy(full)
    if group is not None and full.p > 0:
        seed = int(drop.rng.integers(2**31))  # the same on every rank
        drop.rng = np.random.default_rng([seed, group.rank])
    return drop


class ParallelAttention(nn.Module):
    """Causal self-attention with this rank's n_head / p heads (built from nn's attention).

    QKV is column-parallel: this rank's columns of q, of k and of v (its heads' features in
    each third of the whole QKV weight); each rank attends with its own heads; the output
    projection is row-parallel over the same features, and g sums the heads' shares."""

    attend = staticmethod(attention)  # its core, as CausalSelfAttention's (CP sets its own)

    def __init__(
        self,
        full: CausalSelfAttention,
        group: comm.Group,
        *,
        name: str = "",
        sequence_parallel: bool = False,
    ):
        C = full.proj.weight.shape[0]
        self.n_head = full.n_head // group.size  # this rank's heads
        self.head_size = C // full.n_head
        features = head_features(full.n_head, self.head_size, group)
        qkv_columns = np.concatenate([features, C + features, 2 * C + features])
        self.qkv = ColumnParallelLinear(full.qkv, group, name=name + "qkv.", columns=qkv_columns,
                                        sequence_parallel=sequence_parallel)  # fmt: skip
        self.proj = RowParallelLinear(
            full.proj,
            group,
            name=name + "proj.",
            rows=features,
            sequence_parallel=sequence_parallel,
        )
        self.attn_drop = dropout_of_rank(full.attn_drop, group)  # the heads differ by rank
        # the residual output: the same positions on every rank, or T/p of its own with SP
        self.resid_drop = dropout_of_rank(full.resid_drop, group if sequence_parallel else None)
        self.future = full.future
        self.fused = getattr(full, "fused", True)  # nn's fused attention op, or composed

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)  # (B, T, 3 H hs): T whole, also with sequence parallelism
        y = self.attend(qkv, self.n_head, self.future, self.attn_drop, self.fused)  # H heads
        return self.resid_drop(self.proj(y))
