"""Low-rank factorization: a Linear's weight W replaced by the product of two thinner ones,
W ≈ A B from its truncated SVD, then fine-tuned (the third route to a smaller model, beside
structured pruning, structured.py, and distillation, models/distill.py).

    from minidp.models.prune import low_rank
    low_rank.factorize_model(gpt, rank=16)         # each block's qkv, proj, fc, fc_proj
    opt = AdamW(gpt.parameters(), ...)             # new parameters: a new optimizer
    low_rank.factorize_model(user_model, rank=0.25)  # every Linear, a quarter of its rank

A Linear y = x W + b, W: (n_in, n_out), becomes two: y = (x A) B + b, A: (n_in, r),
B: (r, n_out). With the SVD W = U Σ Vᵀ (singular values σ_1 >= σ_2 >= ...),

    A = U_r Σ_r^½,   B = Σ_r^½ V_rᵀ,   A B = U_r Σ_r V_rᵀ = W_r

W_r, the first r singular triples, is the best rank-r approximation of W in the Frobenius
and spectral norms (Eckart & Young, 1936): ||W - W_r||_F² = Σ_{i>r} σ_i². Splitting Σ^½
to both sides keeps A and B of one scale (Denton et al. 2014, "Exploiting Linear Structure
Within Convolutional Networks"; Sainath et al. 2013 for the same idea on speech models'
output layers). At r = min(n_in, n_out) the product is W itself, to rounding.

Cost: r (n_in + n_out) values and multiply-adds per row, against n_in n_out: fewer only
when r < n_in n_out / (n_in + n_out) (51 for the GPT's 64 x 256 MLP, 48 for its 64 x 192
qkv, 32 for its 64 x 64 proj). Each Linear becomes two ops, so at a tiny model's size the
per-op cost can outweigh the smaller products (docs/pruning.md measures it).

Which Linears of the GPT (`gpt_linears`): every block's attention qkv and proj and its MLP
fc and fc_proj; not the head (96 symbols: 64 x 96, a sliver of the step) nor the embedding
tables (a lookup, not a product). The fused helpers of models/gpt.py take a LowRankLinear as
any module that is not a plain Linear: called as it is (the LayerNorm before it unfused).

Under data parallelism every rank factorizes its own replica: replicas are bitwise
identical and the SVD is deterministic on one machine, but the parallel side
(parallel/low_rank.py: `factorize_replicas`, `LowRankFactorization`) broadcasts rank 0's
factors so that no LAPACK's thread count can make them differ.
"""

import numbers

import numpy as np

from minidp.engine.nn import Linear, Module, Parameter
from minidp.models.gpt import GPT

__all__ = ["LowRankLinear", "factorize", "gpt_linears", "linears_of", "factorize_model"]


class LowRankLinear(Module):
    """y = (x A) B + b: `first` (n_in -> r, no bias) then `second` (r -> n_out, the bias)."""

    def __init__(self, first: Linear, second: Linear):
        self.first, self.second = first, second

    @property
    def rank(self) -> int:
        return self.first.weight.shape[1]

    def forward(self, x, relu: bool = False):
        """x A, then (x A) B + b (with relu=True, max(., 0) in the second op: nn.MLP's)."""
        return self.second(self.first(x), relu=relu)


def _rank(rank, full: int) -> int:
    """An int rank, or a fraction of the full rank (rounded, at least 1)."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Real):
        raise TypeError(f"rank must be an int or a fraction in (0, 1], got {rank!r}")
    if not isinstance(rank, numbers.Integral) and not 0 < rank <= 1:
        raise ValueError(f"rank as a fraction must be in (0, 1], got {rank}")
    r = rank if isinstance(rank, numbers.Integral) else max(1, round(rank * full))
    if not 1 <= r <= full:
        raise ValueError(f"rank {r} outside [1, {full}] (min(n_in, n_out))")
    return int(r)


def factorize(linear: Linear, rank) -> LowRankLinear:
    """The LowRankLinear whose product A B is `linear`'s weight truncated to `rank` (an int,
    or a fraction of min(n_in, n_out)); the SVD in float64, the factors in W's dtype."""
    if not isinstance(linear, Linear):
        raise TypeError(f"factorize needs a minidp.nn.Linear, got {type(linear).__name__}")
    W = linear.weight.data
    r = _rank(rank, min(W.shape))
    U, S, Vt = np.linalg.svd(np.asarray(W, dtype=np.float64), full_matrices=False)
    root = np.sqrt(S[:r])
    A, B = U[:, :r] * root, root[:, None] * Vt[:r]
    first = _linear(A, None, W.dtype, linear.weight.requires_grad)
    bias = linear.bias
    second = _linear(B, bias, W.dtype, linear.weight.requires_grad)
    return LowRankLinear(first, second)


def _linear(weight: np.ndarray, bias, dtype, requires_grad: bool) -> Linear:
    """A Linear holding `weight` (and `bias`, a Parameter kept as it is, or None)."""
    layer = Linear.__new__(Linear)
    layer.weight = Parameter(weight.astype(dtype))
    layer.weight.requires_grad = requires_grad
    layer.bias = bias
    return layer


def gpt_linears(model: GPT) -> list[tuple[Module, str]]:
    """(owner, attribute) of the Linears factorized in a GPT: per block, attn.qkv, attn.proj,
    fc and fc_proj (the module docstring says why not the head)."""
    if not isinstance(model, GPT) or model.config.n_experts:
        raise TypeError("gpt_linears needs a minidp GPT without experts")
    where = []
    for block in model.blocks:
        where += [(block.attn, "qkv"), (block.attn, "proj"), (block, "fc"), (block, "fc_proj")]
    return where


def linears_of(model: Module) -> list[tuple[Module, str]]:
    """(owner, attribute or list index) of every Linear in a user's model, depth first;
    a GPT's as gpt_linears."""
    if isinstance(model, GPT):
        return gpt_linears(model)
    found = []
    for name, value in vars(model).items():
        if isinstance(value, Linear):
            found.append((model, name))
        elif isinstance(value, list):
            found += [(value, i) for i, item in enumerate(value) if isinstance(item, Linear)]
    for _, child in model.children():
        if not isinstance(child, Linear):
            found += linears_of(child)
    return found


def factorize_model(model: Module, rank, where=None) -> list[LowRankLinear]:
    """Replace each Linear at `where` ((owner, attribute or index) pairs; default
    `linears_of(model)`) by its rank-`rank` factorization, in place; returns the new
    modules. The old weights leave the model: build its optimizer (and DDP) again."""
    made = []
    for owner, key in linears_of(model) if where is None else where:
        layer = owner[key] if isinstance(owner, list) else getattr(owner, key)
        low = factorize(layer, rank)
        if isinstance(owner, list):
            owner[key] = low
        else:
            setattr(owner, key, low)
        made.append(low)
    return made
