"""The tiny GPT of minidp.nn, tensor-parallel: built by slicing the same whole weights.

    full = nn.GPT(cfg, seed=s)                       # every rank: the one-process model
    model = TensorParallelGPT(full, tp_group, sequence_parallel=False)
    loss = model.loss(idx, targets)                  # the same on every rank of the group
    model.gather_into(full)                          # collective: the trained whole model

What each rank holds (p = TP group size), and where the group talks:

    wte            VocabParallelEmbedding   rows v_i..v_{i+1}     g      (fwd)
    wpe, ln*, biases of row-parallel layers  replicated (whole on every rank)
    attn.qkv       column-parallel, its heads' q, k and v          f      (bwd)
    attn.proj      row-parallel, the same heads' features          g      (fwd)
    mlp.fc         column-parallel, 4C/p hidden features           f      (bwd)
    mlp.fc_proj    row-parallel, the same hidden features          g      (fwd)
    moe            a MoE block's (models/moe/): replicated, router and experts whole
                   (every rank has the same tokens; ExpertParallel over the DP
                   ranks may then spread the experts, mesh_gpt.py)
    head           column-parallel over the vocabulary             f      (bwd)
                   (tied to wte: wte's own shard, logits_i = f(X) E_i^T)
    loss           vocab_parallel_cross_entropy: N-element allreduces, never the logits

With sequence parallelism every f / g above becomes an allgather / reduce-scatter along T,
and the residual stream, LayerNorms and dropouts hold T/p positions per rank. Then each
replicated parameter sees only this rank's positions, so its gradient is a partial sum:
`replicated_grads_partial` says so, and the strategy allreduces those over the group.

A head tied to the token embedding (GPT-2's weight tying, Press & Wolf 2017): the user's
head holds `wte.weight` itself (`head.weight is wte.weight`) and computes logits = X E^T
(E: V x C; nn.Linear holds (in, out), so a tied head is a module of the user's, not an
nn.Linear). The embedding's rows v_i..v_{i+1} are the head's columns v_i..v_{i+1}, so one
shard serves both: the head computes f(X) E_i^T with the embedding's own Parameter, and
autograd adds the gradients of its two uses, as one process does. The shard is listed once
(as "wte.weight"), and an optimizer steps it once.
"""

import copy

import numpy as np

from minidp import comm
from minidp.engine import nn
from minidp.engine.recompute import checkpoint
from minidp.engine.tensor import Tensor
from minidp.models.gpt import GPT, Block
from minidp.models.moe.layer import MoE
from minidp.parallel.tensor_parallel.communications import (
    copy_to_tensor_parallel,
    gather_sequence,
    sequence_range,
)
from minidp.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    Placement,
    dropout_of_rank,
    replica,
)
from minidp.parallel.tensor_parallel.vocab import (
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


def _replicated_layer_norm(full: nn.LayerNorm, name: str) -> nn.LayerNorm:
    layer = copy.copy(full)
    layer.weight, layer.bias = (
        replica(full.weight, name + "weight"),
        replica(full.bias, name + "bias"),
    )
    return layer


def tied_to_embedding(full: GPT) -> bool:
    """Whether `full.head` is tied to `full.wte` (GPT-2's way, logits X E^T); ValueError for
    a head TensorParallelGPT cannot split: neither an nn.Linear nor tied to wte."""
    weight = getattr(full.head, "weight", None)
    if weight is full.wte.weight:
        if isinstance(full.head, nn.Linear):  # X E, with E as an (in, out) matrix: V == C
            raise ValueError(
                "full.head is an nn.Linear whose weight is full.wte.weight (logits X E, not "
                "X E^T): a tied head computes X E^T (see gpt.py's docstring)"
            )
        return True
    if not isinstance(full.head, nn.Linear):
        raise ValueError(
            f"full.head must be an nn.Linear or tied to full.wte (its weight the embedding's "
            f"own), got a {type(full.head).__name__}"
        )
    return False


def _replicated_moe(full: MoE, name: str) -> MoE:
    """A copy of `full` held whole by every rank of the group (router and experts): every TP
    rank has the same tokens, so each routes them alike and runs the same experts."""
    moe = copy.deepcopy(full)
    for pname, p in moe.named_parameters():
        p.placement = Placement(name + pname)
    return moe


class ParallelBlock(nn.Module):
    """nn.Block with parallel attention and MLP: x + attn(ln1(x)), then x + mlp(ln2(x));
    a block whose MLP is a MoE keeps it whole (`moe`, replicated): x + drop(moe(ln2(x)))."""

    moe: MoE | None = None

    def __init__(self, full: Block, group: comm.Group, *, name: str, sequence_parallel: bool):
        sp = sequence_parallel
        self.ln1 = _replicated_layer_norm(full.ln1, name + "ln1.")
        self.attn = ParallelAttention(full.attn, group, name=name + "attn.", sequence_parallel=sp)
        self.ln2 = _replicated_layer_norm(full.ln2, name + "ln2.")
        fused = getattr(full, "fused", True)  # the one-process Block's choice of ops
        if full.moe is not None:
            if sp:  # each rank would route its own T/p positions: the counts over TP too
                raise ValueError("a MoE block with sequence parallelism: not supported")
            self.moe = _replicated_moe(full.moe, name + "moe.")
        else:
            self.mlp = ParallelMLP(
                full.fc, full.fc_proj, group, name=name, sequence_parallel=sp, fused=fused
            )
        self.drop = dropout_of_rank(full.drop, group if sp else None)  # SP: T/p of its own

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        mlp = self.mlp if self.moe is None else self.moe
        return x + self.drop(mlp(self.ln2(x)))


class TiedParallelHead(nn.Module):
    """logits_i = f(X) E_i^T: the head tied to a VocabParallelEmbedding, on its own shard
    E_i (rows v_i..v_{i+1} of E, the head's columns v_i..v_{i+1}); f becomes the allgather
    along T under sequence parallelism."""

    def __init__(self, wte: VocabParallelEmbedding, group: comm.Group, sequence_parallel: bool):
        self.weight = wte.weight  # the same Parameter: its gradient sums both uses
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        x = (
            gather_sequence(x, self.group)
            if self.sequence_parallel
            else copy_to_tensor_parallel(x, self.group)
        )
        return x @ self.weight.T


class TensorParallelGPT(nn.Module):
    """nn.GPT split over `group`; see the module docstring. forward(idx) gives this rank's
    columns of the logits (B, T, V_i); loss(idx, targets) the whole batch's mean loss.

    `full.head` is an nn.Linear (C -> V), or a head tied to `full.wte` (its `weight` is
    `full.wte.weight`, its logits X E^T); anything else is a ValueError."""

    def __init__(self, full: GPT, group: comm.Group, *, sequence_parallel: bool = False):
        cfg = full.config
        if cfg.n_head % group.size or (4 * cfg.n_embd) % group.size:
            raise ValueError(
                f"tensor parallelism over {group.size} ranks needs n_head ({cfg.n_head}) and "
                f"4 n_embd ({4 * cfg.n_embd}) to divide by {group.size}"
            )
        sp = sequence_parallel and group.size > 1
        self.config, self.group, self.sequence_parallel = cfg, group, sp
        self.wte = VocabParallelEmbedding(full.wte, group, name="wte.", sequence_parallel=sp)
        self.wpe = replica(full.wpe.weight, "wpe.weight")
        self.drop = dropout_of_rank(full.drop, group if sp else None)
        self.blocks = [
            ParallelBlock(b, group, name=f"blocks.{i}.", sequence_parallel=sp)
            for i, b in enumerate(full.blocks)
        ]
        self.ln_f = _replicated_layer_norm(full.ln_f, "ln_f.")
        if tied_to_embedding(full):
            self.head = TiedParallelHead(self.wte, group, sp)
        else:
            self.head = ColumnParallelLinear(full.head, group, name="head.", sequence_parallel=sp)
        self.replicated_grads_partial = sp
        self.recompute = full.recompute  # each block run again in backward, as full's

    @property
    def tied(self) -> bool:
        """Whether the head reads the token embedding's shard (see the module docstring)."""
        return isinstance(self.head, TiedParallelHead)

    def forward(self, idx: np.ndarray, positions: np.ndarray | None = None) -> Tensor:
        x = self.embed(idx, positions)
        for block in self.blocks:
            x = checkpoint(block, x) if self.recompute else block(x)
        return self.head(self.ln_f(x))  # f (or the allgather along T), then my vocabulary

    def embed(self, idx: np.ndarray, positions: np.ndarray | None = None) -> Tensor:
        """idx: (B, T) token ids -> the blocks' input, (B, T, C) or (B, T/p, C) with
        sequence parallelism: this rank's positions. `positions` (T,): each token's place
        in the sequence, 0..T-1 if None (context parallelism passes a rank's own, as to
        GPT.embed; not with sequence parallelism)."""
        idx = np.asarray(idx)
        T = idx.shape[-1]
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size")
        if positions is not None:
            if self.sequence_parallel:
                raise ValueError("positions with sequence parallelism: not supported")
            return self.drop(self.wte(idx) + self.wpe[positions])
        lo, hi = sequence_range(T, self.group) if self.sequence_parallel else (0, T)
        return self.drop(self.wte(idx) + self.wpe[np.arange(lo, hi)])

    def criterion(self, logits: Tensor, targets: np.ndarray) -> Tensor:
        """The mean cross-entropy of this rank's vocabulary columns of the logits (the
        same on every rank of the group): what `loss` applies to `forward`'s output."""
        return vocab_parallel_cross_entropy(logits, targets, self.wte.start, self.group)

    def loss(self, idx: np.ndarray, targets: np.ndarray) -> Tensor:
        return self.criterion(self(idx), targets)

    def sharded_and_replicated(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(parameters split over the group, parameters every rank holds whole)."""
        params = self.parameters()
        return (
            [p for p in params if p.placement.axis is not None],
            [p for p in params if p.placement.axis is None],
        )

    def gather_whole(self, which: str = "data") -> dict[str, np.ndarray]:
        """Collective: {whole name: whole array} of every parameter's `data` (or `grad`)."""
        return whole_arrays(self.parameters(), self.group, which)

    def gather_into(self, full: GPT) -> None:
        """Collective: the whole trained weights into `full` (an nn.GPT of this config), as
        fresh arrays: `full`'s own may be released stand-ins (TensorParallel frees them)."""
        whole = self.gather_whole("data")
        for name, p in full.named_parameters():
            p.data = whole[name]


def whole_arrays(params, group: comm.Group, which: str = "data") -> dict[str, np.ndarray]:
    """Collective over `group`: {whole name: whole array} of the `data` (or `grad`) of TP
    parameters `params` (each with its `placement`; the same list on every rank of `group`).

    Each rank writes its shard into zeros of the whole shape; an allreduce(sum) over the
    group fills in the rest (adding zeros is exact). Once, after training: bytes are no
    concern here, one clear way is."""
    whole = {}
    for p in params:
        mine = getattr(p, which)
        place = p.placement
        if place.axis is None:
            whole[place.name] = mine.copy()
            continue
        shape = list(mine.shape)
        shape[place.axis] = place.length
        full = np.zeros(shape, mine.dtype)
        index = [slice(None)] * full.ndim
        index[place.axis] = place.index
        full[tuple(index)] = mine
        whole[place.name] = comm.allreduce(full, group=group)
    return whole
