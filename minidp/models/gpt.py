"""A tiny character-level GPT (after nanoGPT), built from minidp.nn's layers.

`minidp.nn.GPT` and `minidp.nn.GPTConfig` name it too (minidp/__init__.py). Where a layer
can run as one fused op (the speed tricks' table, minidp/engine/registry.py), the helpers
below take it: `fused=False` runs every layer the plain, composed way. Shapes: B batch,
T positions (<= block_size), C = n_embd channels, H = n_head heads of C / H each.
"""

import math
from dataclasses import dataclass

import numpy as np

from minidp.engine import functional as F
from minidp.engine.backend import to_numpy
from minidp.engine.nn import Dropout, Embedding, LayerNorm, Linear, Module
from minidp.engine.recompute import checkpoint
from minidp.engine.registry import fast
from minidp.engine.tensor import Tensor, no_grad
from minidp.models.moe.layer import MoE

__all__ = [
    "GPTConfig",
    "attention",
    "composed_attention",
    "norm_linear",
    "add_linear",
    "CausalSelfAttention",
    "Block",
    "GPT",
]


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 64  # context length T
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64  # C; head size = C / n_head
    dropout: float = 0.0
    # mixture of experts (models/moe/, docs/experts.md); n_experts 0: every block's MLP
    n_experts: int = 0  # E experts in place of the MLP
    moe_every: int = 1  # 1: every block's MLP; 2: every other block's (blocks 1, 3, ...)
    top_k: int = 1  # 1: Switch; 2: GShard's renormalized pair
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float = 0.01  # Switch's alpha: load_balancing_loss(model) adds it
    # after structured pruning (models/prune/structured.py), per block; (): every block full
    heads: tuple[int, ...] = ()  # heads kept per block; the head size stays n_embd / n_head
    mlp_channels: tuple[int, ...] = ()  # MLP hidden channels per block (full: 4 n_embd)

    def layer_heads(self, layer: int) -> int:
        """Block `layer`'s heads: n_head, or what structured pruning left (`heads`)."""
        return self.heads[layer] if self.heads else self.n_head

    def layer_channels(self, layer: int) -> int:
        """Block `layer`'s MLP hidden width: 4 n_embd, or what pruning left (`mlp_channels`)."""
        return self.mlp_channels[layer] if self.mlp_channels else 4 * self.n_embd


def composed_attention(qkv: Tensor, n_head: int, future: np.ndarray, attn_drop) -> Tensor:
    """Causal self-attention from the packed projections, (B, T, 3C) -> (B, T, C), op by
    op: split q, k, v; heads; scores S = q k^T / sqrt(hs); the future masked; softmax;
    dropout; the weighted sum P v; heads merged. The plain way, and the reference that
    fused_attention.causal_self_attention is tested against."""
    B, T, C3 = qkv.shape
    C, H = C3 // 3, n_head
    q, k, v = F.split(qkv, 3, axis=2)  # each (B, T, C)
    q, k, v = (t.reshape(B, T, H, C // H).transpose(0, 2, 1, 3) for t in (q, k, v))
    att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(C // H))  # (B, H, T, T)
    att = F.softmax(F.masked_fill(att, future[:T, :T], -np.inf), axis=-1)
    y = attn_drop(att) @ v  # (B, H, T, hs)
    return y.transpose(0, 2, 1, 3).reshape(B, T, C)


def attention(qkv: Tensor, n_head: int, future, attn_drop, fused: bool = True) -> Tensor:
    """composed_attention, or (fused, NumPy data, no attention dropout at work) the same as
    one op with its backward written out: the table's "attention"
    (fast/fused_attention.py causal_self_attention)."""
    dropping = attn_drop.training and attn_drop.p > 0
    one_op = fused and not dropping and fast("attention", qkv)
    if one_op:
        return one_op(qkv, n_head, future)
    return composed_attention(qkv, n_head, future, attn_drop)


def own_forward(module, cls) -> bool:
    """`module` is a `cls` whose forward is cls.forward itself (not overridden or wrapped)."""
    return (
        isinstance(module, cls)
        and type(module).forward is cls.forward
        and "forward" not in vars(module)
    )


def norm_linear(norm: LayerNorm, linear: Linear, x: Tensor, fused: bool = True) -> Tensor:
    """linear(norm(x)), or (fused, NumPy data) the same as one op, the LayerNorm's scale and
    shift folded into the Linear's weight: the table's "layer_norm_linear". Only for
    a LayerNorm and a Linear whose forward is their class's own: not a user's head in the
    Linear's place (a tied one), a subclass, or a forward wrapped on the instance (FSDP /
    ZeRO-3 with either a unit of its own gathers its weights around that forward): those
    are called as they are."""
    plain = own_forward(norm, LayerNorm) and own_forward(linear, Linear)
    one_op = (
        fused and plain and norm.fused and fast("layer_norm_linear", x, norm.weight, linear.weight)
    )
    if one_op:
        return one_op(x, norm.weight, norm.bias, norm.eps, linear.weight, linear.bias)
    return linear(norm(x))


def add_linear(residual: Tensor, linear: Linear, drop, x: Tensor, fused: bool = True) -> Tensor:
    """residual + drop(linear(x)), or (fused, NumPy data of one dtype, the library's own
    Dropout and not dropping, the library's own Linear: as norm_linear) the same as one op:
    the table's "linear_residual" (the residual add into the product's own array)."""
    if (
        fused
        and own_forward(drop, Dropout)  # the library's own, and not dropping now
        and not (drop.training and drop.p > 0)
        and own_forward(linear, Linear)  # (a module without .weight is called as it is)
        and (one_op := fast("linear_residual", residual, x, linear.weight))
        and residual.dtype == x.dtype == linear.weight.dtype
        and residual.shape == (*x.shape[:-1], linear.weight.shape[1])
        and (linear.bias is None or linear.bias.dtype == residual.dtype)
    ):
        return one_op(residual, x, linear.weight, linear.bias)
    return residual + drop(linear(x))


class CausalSelfAttention(Module):
    """Multi-head attention where position t attends to positions <= t only.

    `attend` is its core, `attention` above, called as attend(qkv, n_head, future,
    attn_drop, fused): context parallelism sets its own on the instance (ring or Ulysses,
    parallel/context_parallel/gpt.py)."""

    attend = staticmethod(attention)

    def __init__(self, cfg: GPTConfig, *, rng, dtype=np.float32, fused: bool = True, layer=0):
        C, std = cfg.n_embd, 0.02
        self.n_head = cfg.layer_heads(layer)  # n_head, or fewer after structured pruning
        A = self.n_head * (C // cfg.n_head)  # the heads' width: C, unless pruned
        self.qkv = Linear(C, 3 * A, rng=rng, dtype=dtype, std=std)
        # residual projections scaled by 1/sqrt(2 n_layer) (GPT-2)
        self.proj = Linear(A, C, rng=rng, dtype=dtype, std=std / np.sqrt(2 * cfg.n_layer))
        self.attn_drop = Dropout(cfg.dropout, rng=rng)
        self.resid_drop = Dropout(cfg.dropout, rng=rng)
        self.future = np.triu(np.ones((cfg.block_size, cfg.block_size), dtype=bool), k=1)
        self.fused = fused

    def forward(self, x: Tensor, norm: LayerNorm | None = None, residual=None) -> Tensor:
        """Attention over x; with `norm`, over norm(x) (its LayerNorm fused with q/k/v's
        projection: norm_linear); with `residual`, residual + the attention (the add fused
        with the output projection: add_linear)."""
        qkv = self.qkv(x) if norm is None else norm_linear(norm, self.qkv, x, self.fused)
        y = self.attend(qkv, self.n_head, self.future, self.attn_drop, self.fused)
        if residual is None:
            return self.resid_drop(self.proj(y))
        return add_linear(residual, self.proj, self.resid_drop, y, self.fused)


class Block(Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)), or with `moe`,
    x + drop(moe(ln(x))): experts in the MLP's place (GPTConfig.n_experts)."""

    moe: MoE | None = None  # the block's MoE layer, where it has one

    def __init__(
        self, cfg: GPTConfig, *, rng, dtype=np.float32, fused: bool = True, moe=False, layer=0
    ):
        C, std = cfg.n_embd, 0.02
        self.ln1 = LayerNorm(C, dtype=dtype, fused=fused)
        self.attn = CausalSelfAttention(cfg, rng=rng, dtype=dtype, fused=fused, layer=layer)
        self.ln2 = LayerNorm(C, dtype=dtype, fused=fused)
        if moe:  # the MLP's place taken by experts (models/moe/), each one the MLP below
            self.moe = MoE(
                C,
                cfg.n_experts,
                cfg.top_k,
                cfg.capacity_factor,
                rng=rng,
                dtype=dtype,
                proj_std=std / np.sqrt(2 * cfg.n_layer),
                aux_loss_coef=cfg.aux_loss_coef,
            )
        else:
            F = cfg.layer_channels(layer)  # 4C, or fewer after structured pruning
            self.fc = Linear(C, F, rng=rng, dtype=dtype, std=std)
            self.fc_proj = Linear(F, C, rng=rng, dtype=dtype, std=std / np.sqrt(2 * cfg.n_layer))
        self.drop = Dropout(cfg.dropout, rng=rng)
        self.fused = fused

    def forward(self, x: Tensor) -> Tensor:
        x = self.attn(x, norm=self.ln1, residual=x)  # x + attn(ln1(x))
        if self.moe is not None:
            return x + self.drop(self.moe(self.ln2(x)))
        h = norm_linear(self.ln2, self.fc, x, self.fused)
        gelu = (self.fused and fast("gelu", h)) or F.gelu
        h = gelu(h)
        return add_linear(x, self.fc_proj, self.drop, h, self.fused)  # x + drop(fc_proj(h))


def uses_moe(cfg: GPTConfig, layer: int) -> bool:
    """Does block `layer` hold a MoE: with n_experts > 0, every moe_every-th block, the last
    of each run of moe_every (GShard's every other layer: blocks 1, 3, ...)."""
    return cfg.n_experts > 0 and (layer + 1) % cfg.moe_every == 0


class GPT(Module):
    """Token + position embeddings, n_layer blocks, a final LayerNorm and an output head.

    `fused` (the default): LayerNorm (in a block, with the Linear after it), attention, GELU
    and the embeddings' backward as the fused ops of minidp/fast/ (docs/memory.md); False: every
    layer the plain, composed way. ln_f and the head stay two ops: fused, every forward would
    make a vocabulary-sized w_n * W (GPT-2's: 154 MB in float32) and the head's gradient
    would skip weight_grads.py's deferral, for a small gain in the tiny GPT's step
    (docs/memory.md).
    The same model and the same results to rounding either way (tests/test_autograd.py).

    `recompute = True` (`--recompute`): each block keeps only its input and runs again in
    backward (engine/recompute.py's `checkpoint`): the same bits, less memory."""

    recompute = False

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, dtype=np.float32, fused: bool = True):
        rng = np.random.default_rng(seed)
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, rng=rng, dtype=dtype, fused=fused)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd, rng=rng, dtype=dtype, fused=fused)
        self.drop = Dropout(cfg.dropout, rng=rng)
        self.blocks = [
            Block(cfg, rng=rng, dtype=dtype, fused=fused, moe=uses_moe(cfg, i), layer=i)
            for i in range(cfg.n_layer)
        ]
        self.ln_f = LayerNorm(cfg.n_embd, dtype=dtype, fused=fused)
        self.head = Linear(cfg.n_embd, cfg.vocab_size, bias=False, rng=rng, dtype=dtype, std=0.02)

    def forward(self, idx: np.ndarray, positions: np.ndarray | None = None) -> Tensor:
        """idx: (B, T) token ids -> logits (B, T, vocab_size); `positions` as in embed."""
        x = self.embed(idx, positions)
        for block in self.blocks:
            x = checkpoint(block, x) if self.recompute else block(x)
        return self.head(self.ln_f(x))  # two ops: fused, the head's C x V would be made again

    def embed(self, idx: np.ndarray, positions: np.ndarray | None = None) -> Tensor:
        """idx: (B, T) token ids -> the blocks' input (B, T, n_embd): token + position.
        `positions` (T,): each token's place in the sequence, 0..T-1 if None (context
        parallelism passes the places of a rank's own tokens)."""
        idx = np.asarray(idx)
        T = idx.shape[-1]
        if T > self.config.block_size:
            raise ValueError(
                f"sequence of {T} tokens is longer than block_size {self.config.block_size}"
            )
        where = np.arange(T) if positions is None else positions
        return self.drop(self.wte(idx) + self.wpe(where))

    def generate(
        self, idx: np.ndarray, new_tokens: int, rng: np.random.Generator, temperature: float = 1.0
    ) -> np.ndarray:
        """Sample `new_tokens` more tokens after each row of idx (B, T)."""
        was_training = self.training
        self.eval()
        idx = np.array(idx)
        with no_grad():
            for _ in range(new_tokens):
                logits = to_numpy(self(idx[:, -self.config.block_size :]).data[:, -1, :])
                logits = logits.astype(np.float64) / temperature  # float64: p sums to 1
                p = np.exp(logits - logits.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                nxt = [rng.choice(len(row), p=row) for row in p]
                idx = np.concatenate([idx, np.array(nxt)[:, None]], axis=1)
        self.train(was_training)
        return idx
