"""The autograd engine and every op, checked two ways (after minitorch and micrograd).

One shared table, `OPS`, lists each op once: its minidp form, the same op in PyTorch, and how
to draw an input (shapes from Hypothesis, broadcast-compatible pairs for binary ops; values in
the op's domain: log and sqrt see positive inputs, relu and division stay away from 0).
Three tests walk the table: central differences in float64, PyTorch autograd in float64 (forward
and every input gradient), and float32 in -> float32 out and gradients. One row is an op written
outside minidp with the public `minidp.op` only, as parallel schemes write theirs. The fused
ops (fused.py) are rows too, and `FUSED` checks each against the composed graph it replaces.
The engine's own behaviour (seeds, accumulation, no_grad per thread, grad-ready hooks,
errors, aliasing) and dropout follow.
"""

import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
from gradcheck import SETTINGS, check_gradients, output_weight
from hypothesis import given, settings

import minidp
from minidp import Tensor, concatenate, cross_entropy, functional, mse, no_grad, split, stack, where
from minidp.fast import fused
from minidp.fast.fused_attention import causal_self_attention
from minidp.models.gpt import composed_attention
from minidp.nn import MLP, LayerNorm, Linear, linear

try:
    import torch
    import torch.nn.functional as F
except Exception:  # the tests marked torch skip (conftest.py); finite differences still run
    torch = F = None


# ---- drawing inputs ------------------------------------------------------------------------
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4)
SHAPES_1D_UP = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)
PAIRS = hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=4)
TRIPLES = hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=3, max_side=4)


def values(draw, shape, domain: str = "real") -> np.ndarray:
    """float64 values for `shape`, from a Hypothesis-drawn seed, inside the op's domain."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if domain == "real":
        return rng.uniform(-2, 2, shape)
    if domain == "positive":  # log, sqrt, fractional powers
        return rng.uniform(0.3, 2, shape)
    if domain == "nonzero":  # relu's kink, division by b
        return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.3, 2, shape)
    if domain == "distinct":  # max: no ties, and gaps far wider than the finite-difference step
        n = int(np.prod(shape))
        return ((rng.permutation(n) - n / 2) * 0.3 + rng.uniform(0, 0.01, n)).reshape(shape)
    raise ValueError(domain)


def axis_choice(draw, ndim: int):
    """None, one axis (maybe negative) or a tuple of distinct axes."""
    one = st.integers(-ndim, ndim - 1)
    several = st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True)
    return draw(st.one_of(st.none(), one, several.map(tuple)))


def unary(domain="real", shapes=SHAPES, **params):
    """One input of any shape; `params` maps a parameter name to a strategy."""

    def example(draw):
        x = values(draw, draw(shapes), domain)
        return [x], {name: draw(strategy) for name, strategy in params.items()}

    return example


def binary(domain_b="real"):
    def example(draw):
        (shape_a, shape_b), _ = draw(PAIRS)
        return [values(draw, shape_a), values(draw, shape_b, domain_b)], {}

    return example


def reduction(domain="real"):
    def example(draw):
        x = values(draw, draw(SHAPES_1D_UP), domain)
        return [x], {"axis": axis_choice(draw, x.ndim), "keepdims": draw(st.booleans())}

    return example


def with_axis(draw, shapes=SHAPES_1D_UP, domain="real"):
    x = values(draw, draw(shapes), domain)
    return [x], {"axis": draw(st.integers(-x.ndim, x.ndim - 1))}


def matmul_example(draw):
    """Batched operands whose batch shapes broadcast; either operand may be 1-D."""
    (lead_a, lead_b), _ = draw(
        hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=2, max_side=3)
    )
    n, k, m = (draw(st.integers(1, 4)) for _ in range(3))
    shape_a = (k,) if draw(st.booleans()) else (*lead_a, n, k)
    shape_b = (k,) if draw(st.booleans()) else (*lead_b, k, m)
    return [values(draw, shape_a), values(draw, shape_b)], {}


def linear_example(draw):
    """x (..., in) with up to two leading axes (a (B, T, C) batch too), W (in, out), b (out,)."""
    lead = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3))
    k, m = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return [values(draw, (*lead, k)), values(draw, (k, m)), values(draw, (m,))], {}


def reshape_example(draw):
    x = values(draw, draw(SHAPES))
    targets = [(-1,), tuple(reversed(x.shape)), (x.size, 1), (1, *x.shape), ()]
    shape = draw(st.sampled_from(targets if x.size == 1 else targets[:-1]))
    return [x], {"shape": shape}


def permute_example(draw):
    """A permutation of the axes, each written as a or a - ndim (torch and NumPy take both)."""
    x = values(draw, draw(SHAPES_1D_UP))
    axes = draw(st.permutations(range(x.ndim)))
    return [x], {"axes": tuple(a - x.ndim if draw(st.booleans()) else a for a in axes)}


def basic_index_example(draw):
    """A tuple of ints and slices (negative steps included): numpy basic indexing."""
    x = values(draw, draw(SHAPES_1D_UP))
    index = []
    for n in x.shape[: draw(st.integers(1, x.ndim))]:
        if draw(st.booleans()):
            index.append(draw(st.integers(-n, n - 1)))
        else:
            start, stop = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
            stop = max(stop, start + 1)
            if draw(st.booleans()):  # the same elements, walked backwards
                index.append(slice(stop - 1, start - 1 if start else None, -1))
            else:
                index.append(slice(start, stop, draw(st.integers(1, 2))))
    return [x], {"index": tuple(index)}


def fancy_index_example(kind: str):
    """Integer-array indices with a repeated entry: its gradients must add up."""

    def example(draw):
        shapes = (
            SHAPES_1D_UP if kind == "rows" else hnp.array_shapes(min_dims=2, max_dims=3, max_side=4)
        )
        x = values(draw, draw(shapes))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        size = draw(st.integers(1, 5))

        def ids(n):
            chosen = rng.integers(0, n, size)
            return np.append(chosen, chosen[0])  # at least one repeat

        if kind == "rows":
            index = ids(x.shape[0])
        elif kind == "pairs":
            index = (ids(x.shape[0]), ids(x.shape[1]))
        else:  # a slice, then an array: x[:, ids]
            index = (slice(None), ids(x.shape[1]))
        return [x], {"index": index}

    return example


def concatenate_example(draw):
    base = draw(SHAPES_1D_UP)
    axis = draw(st.integers(-len(base), len(base) - 1))
    arrays = []
    for _ in range(draw(st.integers(1, 3))):
        shape = list(base)
        shape[axis] = draw(st.integers(1, 3))
        arrays.append(values(draw, tuple(shape)))
    return arrays, {"axis": axis}


def stack_example(draw):
    shape = draw(SHAPES)
    arrays = [values(draw, shape) for _ in range(draw(st.integers(1, 3)))]
    return arrays, {"axis": draw(st.integers(-len(shape) - 1, len(shape)))}


def split_example(draw):
    x = values(draw, draw(SHAPES_1D_UP))
    axis = draw(st.integers(-x.ndim, x.ndim - 1))
    n = x.shape[axis]
    if draw(st.booleans()):
        sections = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    else:
        sections = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    return [x], {"sections": sections, "axis": axis}


def where_example(draw):
    (shape_c, shape_a, shape_b), _ = draw(TRIPLES)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    condition = rng.random(shape_c) < 0.5
    return [values(draw, shape_a), values(draw, shape_b)], {"condition": condition}


def masked_fill_example(draw):
    """A mask that broadcasts to x: some of x's trailing axes, some of them of size 1."""
    x = values(draw, draw(SHAPES_1D_UP))
    kept = x.shape[x.ndim - draw(st.integers(0, x.ndim)) :]
    mask_shape = tuple(n if draw(st.booleans()) else 1 for n in kept)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return [x], {"mask": rng.random(mask_shape) < 0.5}


def causal_example(draw):
    lead = draw(hnp.array_shapes(min_dims=0, max_dims=2, max_side=3))
    T = draw(st.integers(1, 5))
    return [values(draw, (*lead, T, T))], {}


def cross_entropy_example(draw):
    lead = draw(hnp.array_shapes(min_dims=1, max_dims=2, max_side=4))
    V = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return [values(draw, (*lead, V)) * 2], {"targets": rng.integers(0, V, lead)}


def mse_example(draw):
    shape = draw(SHAPES)
    return [values(draw, shape), values(draw, shape)], {}


def layer_norm_example(draw):
    """x (..., C), weight (C,), bias (C,): C >= 2, or every x̂ is 0."""
    lead = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3))
    C = draw(st.integers(2, 5))
    return [values(draw, (*lead, C)), values(draw, (C,)), values(draw, (C,))], {}


def layer_norm_linear_example(draw):
    """x (..., C), LayerNorm's weight and bias (C,), then a Linear's weight (C, D), bias (D,)."""
    (x, w, b), _ = layer_norm_example(draw)
    D = draw(st.integers(1, 4))
    return [x, w, b, values(draw, (x.shape[-1], D)), values(draw, (D,))], {}


def linear_residual_example(draw):
    """A residual r (..., out), then linear_example's x (..., in), W (in, out), b (out,)."""
    (x, W, b), _ = linear_example(draw)
    return [values(draw, (*x.shape[:-1], W.shape[1])), x, W, b], {}


def layer_norm_linear_no_bias_example(draw):
    """As layer_norm_linear_example, the Linear without a bias (a GPT's head)."""
    arrays, params = layer_norm_linear_example(draw)
    return arrays[:4], params


def attention_example(draw):
    """Packed projections qkv (B, T, 3 H hs) and the head count H."""
    B, T, H, hs = (draw(st.integers(1, n)) for n in (2, 4, 2, 3))
    return [values(draw, (B, T, 3 * H * hs))], {"n_head": H}


def embedding_example(draw):
    """A table (V, C) and ids (batch, T) with a repeat: gradient rows must add up."""
    V, C = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = rng.integers(0, V, (draw(st.integers(1, 3)), draw(st.integers(1, 4))))
    ids.flat[-1] = ids.flat[0]
    return [values(draw, (V, C))], {"ids": ids}


# ---- the same op in PyTorch, where its spelling differs ---------------------------------------
def torch_dims(axis, ndim):
    return tuple(range(ndim)) if axis is None else axis


def torch_index(index):
    """numpy integer arrays -> torch tensors (torch also accumulates repeated indices)."""
    if isinstance(index, tuple):
        return tuple(torch_index(i) for i in index)
    return torch.as_tensor(index) if isinstance(index, np.ndarray) else index


def torch_basic_index(x, index):
    """x[index] for ints and slices; torch has no negative steps, so those use index_select."""
    for axis in reversed(range(len(index))):  # last axis first: ints then shift nothing
        item = index[axis]
        if isinstance(item, int):
            x = x.select(axis, item)
        elif item.step < 0:
            picked = torch.tensor(list(range(*item.indices(x.shape[axis]))), dtype=torch.long)
            x = x.index_select(axis, picked)
        else:
            x = x[(slice(None),) * axis + (item,)]
    return x


def torch_split(x, sections, axis):
    n = x.shape[axis]
    cuts = list(range(0, n + 1, n // sections)) if isinstance(sections, int) else [0, *sections, n]
    sizes = [max(0, hi - lo) for lo, hi in zip(cuts[:-1], cuts[1:])]
    return torch.cat(torch.split(x, sizes, dim=axis)[::-1], dim=axis)


def torch_cross_entropy(logits, targets):
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), torch.as_tensor(targets).reshape(-1))


def causal_softmax(x):
    T = x.shape[-1]
    return x.masked_fill(np.triu(np.ones((T, T), dtype=bool), k=1), -np.inf).softmax(axis=-1)


def torch_causal_softmax(x):
    T = x.shape[-1]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    return x.masked_fill(future, -torch.inf).softmax(dim=-1)


def future(T: int) -> np.ndarray:
    return np.triu(np.ones((T, T), dtype=bool), k=1)


def fused_attention(qkv, n_head):
    return causal_self_attention(qkv, n_head, future(qkv.shape[1]))


def torch_attention(qkv, n_head):
    """The same attention in PyTorch, written out."""
    B, T, C3 = qkv.shape
    q, k, v = (
        t.reshape(B, T, n_head, -1).transpose(1, 2) for t in torch.split(qkv, C3 // 3, dim=2)
    )
    S = (q @ k.transpose(-1, -2)) / np.sqrt(q.shape[-1])
    P = S.masked_fill(torch.as_tensor(future(T)), -torch.inf).softmax(dim=-1)
    return (P @ v).transpose(1, 2).reshape(B, T, C3 // 3)


def composed_layer_norm(x, weight, bias):
    ln = LayerNorm(x.shape[-1], fused=False)
    ln.weight, ln.bias = weight, bias
    return ln(x)


def composed_layer_norm_linear(x, weight, bias, W, b=None):
    return linear(composed_layer_norm(x, weight, bias), W, b)


def mul_exp(a: Tensor, b: Tensor) -> Tensor:
    """a * e^b, broadcasting, written as an outside op would be: public API only."""
    e = np.exp(b.data)

    def backward(g):  # d(a e^b)/da = e^b, d(a e^b)/db = a e^b
        return (
            minidp.engine.tensor.unbroadcast(g * e, a.shape),
            minidp.engine.tensor.unbroadcast(g * a.data * e, b.shape),
        )

    return minidp.op(a.data * e, (a, b), backward)


@dataclass(frozen=True)
class Op:
    name: str
    minidp: Callable  # (*Tensors, **params) -> Tensor
    torch: Callable  # (*torch.Tensors, **params) -> torch.Tensor
    example: Callable  # draw -> (list of float64 arrays, params)


def method(name: str):
    """x.name(): minidp and torch tensors both have it."""
    return lambda x: getattr(x, name)()


def power(x, exponent):
    return x**exponent


REAL_POWERS = st.sampled_from([0, 1, 2, 3])
POSITIVE_POWERS = st.sampled_from([0.5, -1.0, 2.5, -0.5])

OPS = [
    # arithmetic, broadcasting both ways
    Op("add", operator.add, operator.add, binary()),
    Op("sub", operator.sub, operator.sub, binary()),
    Op("mul", operator.mul, operator.mul, binary()),
    Op("div", operator.truediv, operator.truediv, binary(domain_b="nonzero")),
    Op("neg", operator.neg, operator.neg, unary()),
    Op("add_scalar", lambda x: 1.5 + x, lambda x: 1.5 + x, unary()),
    Op("rsub_scalar", lambda x: 2.0 - x, lambda x: 2.0 - x, unary()),
    Op("mul_scalar", lambda x: x * 2.5, lambda x: x * 2.5, unary()),
    Op("rdiv_scalar", lambda x: 3.0 / x, lambda x: 3.0 / x, unary("nonzero")),
    Op("pow_real", power, power, unary(exponent=REAL_POWERS)),
    Op("pow_positive", power, power, unary("positive", exponent=POSITIVE_POWERS)),
    Op("matmul", operator.matmul, operator.matmul, matmul_example),
    Op("linear", linear, lambda x, w, b: x @ w + b, linear_example),
    # reductions
    Op(
        "sum",
        lambda x, axis, keepdims: x.sum(axis=axis, keepdims=keepdims),
        lambda x, axis, keepdims: x.sum(dim=torch_dims(axis, x.ndim), keepdim=keepdims),
        reduction(),
    ),
    Op(
        "mean",
        lambda x, axis, keepdims: x.mean(axis=axis, keepdims=keepdims),
        lambda x, axis, keepdims: x.mean(dim=torch_dims(axis, x.ndim), keepdim=keepdims),
        reduction(),
    ),
    Op(
        "max",
        lambda x, axis, keepdims: x.max(axis=axis, keepdims=keepdims),
        lambda x, axis, keepdims: x.amax(dim=torch_dims(axis, x.ndim), keepdim=keepdims),
        reduction("distinct"),
    ),
    # shapes and indexing
    Op(
        "reshape",
        lambda x, shape: x.reshape(shape),
        lambda x, shape: x.reshape(shape),
        reshape_example,
    ),
    Op(
        "transpose",
        lambda x: x.transpose(),
        lambda x: x.permute(tuple(reversed(range(x.ndim)))),
        unary(),
    ),
    Op("T", lambda x: x.T, lambda x: x.permute(tuple(reversed(range(x.ndim)))), unary()),
    Op(
        "permute",
        lambda x, axes: x.permute(*axes),
        lambda x, axes: x.permute(axes),
        permute_example,
    ),
    Op(
        "transpose_tuple",
        lambda x, axes: x.transpose(axes),
        lambda x, axes: x.permute(axes),
        permute_example,
    ),
    Op("index_basic", lambda x, index: x[index], torch_basic_index, basic_index_example),
    Op(
        "index_rows_repeated",
        lambda x, index: x[index],
        lambda x, index: x[torch_index(index)],
        fancy_index_example("rows"),
    ),
    Op(
        "index_pairs_repeated",
        lambda x, index: x[index],
        lambda x, index: x[torch_index(index)],
        fancy_index_example("pairs"),
    ),
    Op(
        "index_slice_then_array",
        lambda x, index: x[index],
        lambda x, index: x[torch_index(index)],
        fancy_index_example("slice"),
    ),
    # joining and splitting
    Op(
        "concatenate",
        lambda *xs, axis: concatenate(list(xs), axis=axis),
        lambda *xs, axis: torch.cat(xs, dim=axis),
        concatenate_example,
    ),
    Op(
        "stack",
        lambda *xs, axis: stack(list(xs), axis=axis),
        lambda *xs, axis: torch.stack(xs, dim=axis),
        stack_example,
    ),
    Op(
        "split",
        lambda x, sections, axis: concatenate(split(x, sections, axis)[::-1], axis),
        torch_split,
        split_example,
    ),
    # elementwise nonlinearities
    Op("exp", method("exp"), method("exp"), unary()),
    Op("log", method("log"), method("log"), unary("positive")),
    Op("sqrt", method("sqrt"), method("sqrt"), unary("positive")),
    Op("tanh", method("tanh"), method("tanh"), unary()),
    Op("sigmoid", method("sigmoid"), method("sigmoid"), unary()),
    Op("relu", method("relu"), method("relu"), unary("nonzero")),
    Op("gelu", functional.gelu, lambda x: F.gelu(x, approximate="tanh"), unary()),
    Op(
        "softmax",
        lambda x, axis: functional.softmax(x, axis),
        lambda x, axis: x.softmax(dim=axis),
        with_axis,
    ),
    Op(
        "log_softmax",
        lambda x, axis: functional.log_softmax(x, axis),
        lambda x, axis: x.log_softmax(dim=axis),
        with_axis,
    ),
    # selection
    Op(
        "where",
        lambda a, b, condition: where(condition, a, b),
        lambda a, b, condition: torch.where(torch.as_tensor(condition), a, b),
        where_example,
    ),
    Op(
        "masked_fill",
        lambda x, mask: functional.masked_fill(x, mask, -3.0),
        lambda x, mask: x.masked_fill(torch.as_tensor(mask), -3.0),
        masked_fill_example,
    ),
    Op("causal_mask_softmax", causal_softmax, torch_causal_softmax, causal_example),
    # losses
    Op(
        "cross_entropy",
        cross_entropy,
        torch_cross_entropy,
        cross_entropy_example,
    ),
    Op("mse", mse, lambda a, b: F.mse_loss(a, b), mse_example),
    # fused ops (fused.py): one node each, the derivative written out; FUSED below checks
    # each against the composed graph it replaces
    Op(
        "layer_norm_fused",
        lambda x, w, b: fused.layer_norm(x, w, b, 1e-5),
        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5),
        layer_norm_example,
    ),
    Op(
        "layer_norm_linear_fused",
        lambda x, w, b, W, bW: fused.layer_norm_linear(x, w, b, 1e-5, W, bW),
        lambda x, w, b, W, bW: F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5) @ W + bW,
        layer_norm_linear_example,
    ),
    Op(
        "layer_norm_linear_no_bias_fused",
        lambda x, w, b, W: fused.layer_norm_linear(x, w, b, 1e-5, W),
        lambda x, w, b, W: F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5) @ W,
        layer_norm_linear_no_bias_example,
    ),
    Op(
        "linear_residual_fused",
        fused.linear_residual,
        lambda r, x, W, b: r + (x @ W + b),
        linear_residual_example,
    ),
    Op("gelu_fused", fused.gelu, lambda x: F.gelu(x, approximate="tanh"), unary()),
    Op("causal_self_attention_fused", fused_attention, torch_attention, attention_example),
    Op(
        "embedding_fused",
        lambda w, ids: fused.embedding(w, ids),
        lambda w, ids: w[torch.as_tensor(ids)],
        embedding_example,
    ),
    # written outside minidp with the public op API
    Op("public_op_mul_exp", mul_exp, lambda a, b: a * torch.exp(b), binary()),
]


# ---- the three walks over the table -------------------------------------------------------
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@SETTINGS
@given(data=st.data())
def test_gradient_matches_central_differences(op, data):
    arrays, params = op.example(data.draw)
    check_gradients(lambda *xs: op.minidp(*xs, **params), arrays)


@pytest.mark.torch
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@SETTINGS
@given(data=st.data())
def test_forward_and_gradient_match_torch(op, data):
    arrays, params = op.example(data.draw)
    ours = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    out, expected = op.minidp(*ours, **params), op.torch(*theirs, **params)
    np.testing.assert_allclose(out.data, expected.detach().numpy(), rtol=1e-10, atol=1e-12)
    assert out.shape == tuple(expected.shape)

    w = output_weight(out.shape)
    (out * Tensor(w)).sum().backward()
    (expected * torch.tensor(w)).sum().backward()
    for k, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(
            a.grad, b.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=f"input {k}"
        )


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@settings(SETTINGS, max_examples=4)
@given(data=st.data())
def test_float32_in_float32_out_and_gradients(op, data):
    arrays, params = op.example(data.draw)
    inputs = [Tensor(a.astype(np.float32), requires_grad=True) for a in arrays]
    out = op.minidp(*inputs, **params)
    assert out.dtype == np.float32
    (out * Tensor(output_weight(out.shape).astype(np.float32))).sum().backward()
    for t in inputs:
        assert t.grad.dtype == np.float32


# ---- each fused op against the composed graph it replaces -------------------------------
# (name in OPS, the composed version, whether the fused op keeps the composed graph's
# order of operations: then the bits are equal, in float64 and in float32)
FUSED = [
    ("layer_norm_fused", composed_layer_norm, False),
    ("layer_norm_linear_fused", composed_layer_norm_linear, False),
    ("layer_norm_linear_no_bias_fused", composed_layer_norm_linear, False),
    ("linear_residual_fused", lambda r, x, W, b: r + linear(x, W, b), True),
    ("gelu_fused", functional.gelu, False),  # constants grouped otherwise: to rounding
    (
        "causal_self_attention_fused",
        lambda qkv, n_head: composed_attention(qkv, n_head, future(qkv.shape[1]), lambda a: a),
        False,
    ),
    ("embedding_fused", lambda w, ids: w[ids], False),  # reduceat may sum pairwise
]


@pytest.mark.parametrize("name, composed, same_bits", FUSED, ids=[f[0] for f in FUSED])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@settings(SETTINGS, max_examples=10)
@given(data=st.data())
def test_fused_op_equals_the_composed_graph(name, composed, same_bits, dtype, data):
    fused_op = next(op for op in OPS if op.name == name)
    arrays, params = fused_op.example(data.draw)
    results = []
    for fn in (fused_op.minidp, composed):
        inputs = [Tensor(a.astype(dtype), requires_grad=True) for a in arrays]
        out = fn(*inputs, **params)
        (out * Tensor(output_weight(out.shape).astype(dtype))).sum().backward()
        results.append([out.data] + [t.grad for t in inputs])
    for ours, reference in zip(*results):
        if same_bits:
            np.testing.assert_array_equal(ours, reference)
        else:
            tol = 1e-12 if dtype == np.float64 else 1e-5
            np.testing.assert_allclose(ours, reference, rtol=tol, atol=tol)


def several_sequences(draw):
    """qkv of 3 to 5 sequences: blocks of two sequences, the last one shorter or not."""
    B, T, H, hs = draw(st.integers(3, 5)), draw(st.integers(1, 4)), 2, draw(st.integers(1, 3))
    return [values(draw, (B, T, 3 * H * hs))], {"n_head": H}


def wide_vector(draw):
    return [values(draw, (draw(st.integers(5, 9)),))], {}


BLOCKED = [  # (op, an example, the bytes of the rows a block should hold: two rows each)
    (fused.gelu, wide_vector, lambda x: 2 * x.itemsize),
    (fused_attention, several_sequences, lambda qkv, n_head: 2 * n_head * qkv.shape[1] ** 2 * 4),
]


@pytest.mark.parametrize("fn, example, two_rows", BLOCKED, ids=["gelu", "attention"])
@settings(SETTINGS, max_examples=10)
@given(data=st.data())
def test_cache_blocks_give_the_bits_of_whole_arrays(fn, example, two_rows, data):
    """fused.blocks cuts the passes into cache-sized blocks; CHUNK_BYTES = 0 runs each pass
    over the whole array. The numbers must not depend on the cut: the same bits, forward
    and backward, with blocks of one row and of two (a last block shorter than the rest
    included)."""
    arrays, params = example(data.draw)
    arrays = [a.astype(np.float32) for a in arrays]
    results, default = [], fused.CHUNK_BYTES
    try:
        for size in (0, 1, two_rows(*arrays, **params)):
            fused.CHUNK_BYTES = size
            inputs = [Tensor(a, requires_grad=True) for a in arrays]
            out = fn(*inputs, **params)
            (out * Tensor(output_weight(out.shape).astype(np.float32))).sum().backward()
            results.append([out.data] + [t.grad for t in inputs])
    finally:
        fused.CHUNK_BYTES = default
    for blocked in results[1:]:
        for ours, whole in zip(blocked, results[0]):
            np.testing.assert_array_equal(ours, whole)


def test_a_nan_in_a_future_key_reaches_no_earlier_query():
    """The fused attention masks the future as masked_fill does: a NaN score there is
    replaced, not carried into the softmax of the queries before it (the composed graph's
    NaN pattern, exactly)."""
    B, T, H, hs = 2, 5, 2, 3
    qkv = np.random.default_rng(0).standard_normal((B, T, 3 * H * hs))
    qkv[:, -1, H * hs : 2 * H * hs] = np.nan  # the last position's key
    with np.errstate(invalid="ignore"):
        fused_y = causal_self_attention(Tensor(qkv), H, future(T)).data
        composed_y = composed_attention(Tensor(qkv), H, future(T), lambda a: a).data
    np.testing.assert_array_equal(np.isnan(fused_y), np.isnan(composed_y))
    assert np.isfinite(fused_y[:, :-1]).all()


def test_cache_blocks_cover_every_row_once(monkeypatch):
    monkeypatch.setattr(fused, "CHUNK_BYTES", 3 * 8)  # three float64 rows of one element
    assert fused.blocks(np.zeros((7, 1))) == [slice(0, 3), slice(3, 6), slice(6, 9)]
    assert fused.blocks(np.zeros((7, 4))) == [slice(i, i + 1) for i in range(7)]
    assert len(fused.blocks(np.zeros((0, 4)))) == 1  # one empty block
    monkeypatch.setattr(fused, "CHUNK_BYTES", 0)
    assert fused.blocks(np.zeros((7, 4))) == [slice(0, 7)]


# ---- dtypes ---------------------------------------------------------------------------------
def test_python_numbers_and_lists_default_to_float32():
    assert Tensor([1.0, 2.0]).dtype == np.float32
    assert Tensor(3.0).dtype == np.float32
    assert Tensor([[1, 2]], dtype=np.float32).dtype == np.float32


def test_float64_on_request_and_numpy_arrays_keep_their_dtype():
    assert Tensor([1.0, 2.0], dtype=np.float64).dtype == np.float64
    assert Tensor(np.ones(3)).dtype == np.float64
    assert Tensor(np.ones(3, dtype=np.float32)).dtype == np.float32
    assert Linear(3, 2, rng=np.random.default_rng(0), dtype=np.float64).weight.dtype == np.float64


def test_integer_tensors_promote_with_python_floats_as_numpy_does():
    x = Tensor(np.array([1, 2, 3]))
    assert x.mean().item() == 2.0
    np.testing.assert_array_equal((x * 0.5).data, [0.5, 1.0, 1.5])
    assert (x * 2).dtype == x.dtype


def test_x_to_the_zero_has_gradient_zero_even_at_zero():
    x = Tensor(np.array([0.0, 2.0]), requires_grad=True)
    (x**0).sum().backward()
    np.testing.assert_array_equal(x.grad, [0.0, 0.0])  # torch agrees; 0 * 0**-1 would be nan


def test_python_scalars_keep_float32():
    x = Tensor(np.ones(3, dtype=np.float32), requires_grad=True)
    for y in (x * 2.0, 2.0 * x, x / 3.0, 1.0 - x, x + np.float64(0.5), x**2.0, x.mean()):
        assert y.dtype == np.float32
    (x * 2.0).sum().backward()
    assert x.grad.dtype == np.float32


# ---- backward: seeds, accumulation, reuse, no_grad --------------------------------------------
def test_backward_on_non_scalar_without_seed_is_a_clear_error():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(RuntimeError, match=r"non-scalar.*\(2, 3\).*seed"):
        (x * 2.0).backward()


def test_backward_without_a_graph_is_a_clear_error():
    with pytest.raises(RuntimeError, match="does not require grad"):
        Tensor([1.0]).sum().backward()


def test_seed_of_the_wrong_shape_is_an_error():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 3\)"):
        (x * 2.0).backward(np.ones(3))


def test_seeded_backward_scales_by_the_seed():
    x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    seed = np.arange(6.0).reshape(2, 3) - 2
    (x * 3.0).backward(seed)
    np.testing.assert_array_equal(x.grad, 3.0 * seed)


def test_gradients_accumulate_across_two_backward_calls():
    x = Tensor(np.array([1.0, -2.0, 3.0]), requires_grad=True)
    loss = (x * x).sum()
    loss.backward()
    loss.backward()
    np.testing.assert_array_equal(x.grad, 4 * x.data)
    (x.sum() * 1.0).backward()  # a fresh graph adds on top as well
    np.testing.assert_array_equal(x.grad, 4 * x.data + 1)


def test_a_tensor_used_twice_gets_the_sum_of_both_gradients():
    x = Tensor(np.array([1.0, -2.0, 3.0]), requires_grad=True)
    (x * x + x).sum().backward()
    np.testing.assert_array_equal(x.grad, 2 * x.data + 1)


def test_a_diamond_graph_sums_both_paths():
    x = Tensor(np.array([0.5, 1.5]), requires_grad=True)
    h = x.exp()
    (h * 2.0 + h.tanh()).sum().backward()
    e = np.exp(x.data)
    np.testing.assert_allclose(x.grad, e * 2 + e * (1 - np.tanh(e) ** 2), rtol=1e-14)


def test_no_grad_records_no_graph_and_restores_afterwards():
    x = Tensor(np.ones(3), requires_grad=True)
    with no_grad():
        assert not minidp.is_grad_enabled()
        y = (x * 2.0).exp().sum()
    assert minidp.is_grad_enabled()
    assert not y.requires_grad and y._parents == () and y._backward is None
    with pytest.raises(KeyError), no_grad():
        raise KeyError("an error inside the block")
    assert minidp.is_grad_enabled()


def in_another_thread(fn):
    """fn()'s result, computed in a fresh thread (its exception re-raised here)."""
    results = []
    thread = threading.Thread(target=lambda: results.append(fn()))
    thread.start()
    thread.join(timeout=30)
    assert results, "the other thread failed (its traceback is above) or hung"
    return results[0]


def records_a_graph() -> tuple[bool, bool]:
    x = Tensor(np.ones(2), requires_grad=True)
    return minidp.is_grad_enabled(), (x * 2.0).requires_grad


def test_no_grad_in_the_main_thread_leaves_another_thread_recording():
    with no_grad():
        assert in_another_thread(records_a_graph) == (True, True)
        assert records_a_graph() == (False, False)


def test_no_grad_in_another_thread_leaves_the_main_thread_recording():
    inside, release = threading.Event(), threading.Event()

    def hold_no_grad():
        with no_grad():
            inside.set()
            release.wait(timeout=30)
            return records_a_graph()

    results = []
    thread = threading.Thread(target=lambda: results.append(hold_no_grad()))
    thread.start()
    try:
        assert inside.wait(timeout=30)
        assert records_a_graph() == (True, True)  # while the other thread is inside no_grad
    finally:
        release.set()
        thread.join(timeout=30)
    assert results == [(False, False)]
    assert records_a_graph() == (True, True)


def test_the_op_api_is_public_and_one_function():
    assert minidp.op is minidp.engine.tensor.op
    x, y = Tensor(np.ones(2), requires_grad=True), Tensor(np.ones(2))
    assert minidp.op(x.data, (y,), lambda g: (g,)).requires_grad is False  # no parent needs grad
    with no_grad():
        assert minidp.op(x.data, (x,), lambda g: (g,)).requires_grad is False


def test_an_input_without_requires_grad_gets_no_gradient():
    a = Tensor(np.ones(3), requires_grad=True)
    b = Tensor(np.full(3, 2.0))
    (a * b).sum().backward()
    assert b.grad is None
    np.testing.assert_array_equal(a.grad, b.data)


def test_a_deep_chain_needs_no_recursion_limit():
    x = Tensor(np.array([1.0]), requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, [1.0])


def test_backward_visits_nodes_in_the_post_order_of_a_depth_first_walk():
    """The order fixes which gradients are summed first: float bits depend on it."""

    def post_order(node, seen, order):  # the definition, recursive: parents in order
        seen.add(id(node))
        for p in node._parents:
            if p.requires_grad and id(p) not in seen:
                post_order(p, seen, order)
        order.append(node)
        return order

    x = Tensor(np.ones((2, 3)), requires_grad=True)
    w = Tensor(np.ones((3, 3)), requires_grad=True)
    h = (x @ w).tanh()
    loss = (h + x * 2.0 + (h @ w).exp() * h).sum()  # shared nodes reached by several paths
    assert [id(t) for t in loss._topological_order()] == [
        id(t) for t in post_order(loss, set(), [])
    ]


def test_ndarray_on_the_left_defers_to_tensor():
    x = Tensor(np.ones((3, 2)), requires_grad=True)
    y = np.ones((2, 3)) @ x + np.ones(2) * x.sum(axis=0)
    assert isinstance(y, Tensor)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, np.full((3, 2), 4.0))


# ---- grad-ready hooks ------------------------------------------------------------------------
def mlp_and_loss(seed=0):
    rng = np.random.default_rng(seed)
    model = MLP([3, 5, 4, 2], rng=rng, dtype=np.float64)
    x = Tensor(rng.standard_normal((6, 3)))
    return model, lambda: cross_entropy(model(x), rng.integers(0, 2, 6))


def test_hooks_fire_once_per_leaf_with_the_final_gradient_last_layer_first():
    model, loss_fn = mlp_and_loss()
    fired = []
    for name, p in model.named_parameters():
        p.register_grad_ready_hook(lambda p, name=name: fired.append((name, p.grad.copy())))
    loss_fn().backward()
    names = [name for name, _ in fired]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each exactly once
    params = dict(model.named_parameters())
    for name, grad_seen in fired:
        np.testing.assert_array_equal(grad_seen, params[name].grad)
    layer_of = [int(name.split(".")[1]) for name in names]
    assert layer_of == sorted(layer_of, reverse=True), names  # last layer's parameters first


def test_hook_of_a_weight_used_in_two_layers_sees_both_contributions():
    rng = np.random.default_rng(1)
    W = Tensor(rng.standard_normal((3, 3)), requires_grad=True)
    x = Tensor(rng.standard_normal((2, 3)))
    seen = []
    W.register_grad_ready_hook(lambda p: seen.append(p.grad.copy()))
    ((x @ W).tanh() @ W).sum().backward()
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], W.grad)
    h = np.tanh(x.data @ W.data)  # both uses, by hand: L = sum(tanh(x W) W)
    by_hand = h.T @ np.ones((2, 3)) + x.data.T @ ((np.ones((2, 3)) @ W.data.T) * (1 - h * h))
    np.testing.assert_allclose(W.grad, by_hand, rtol=1e-12)


def test_hooks_fire_once_per_backward_and_the_handle_removes_them():
    model, loss_fn = mlp_and_loss()
    p = model.parameters()[0]
    calls = []
    remove = p.register_grad_ready_hook(lambda p: calls.append(1))
    loss_fn().backward()
    loss_fn().backward()
    assert len(calls) == 2
    remove()
    loss_fn().backward()
    assert len(calls) == 2


def test_a_prepended_hook_runs_before_those_registered_earlier():
    model, loss_fn = mlp_and_loss()
    p = model.parameters()[0]
    order = []
    p.register_grad_ready_hook(lambda p: order.append("first registered"))
    remove = p.register_grad_ready_hook(lambda p: order.append("prepended"), prepend=True)
    loss_fn().backward()
    assert order == ["prepended", "first registered"]
    remove()


# ---- errors name both shapes ------------------------------------------------------------------
def test_matmul_shape_error_names_both_shapes():
    with pytest.raises(ValueError, match=r"matmul.*\(2, 3\).*\(4, 5\)"):
        Tensor(np.ones((2, 3))) @ Tensor(np.ones((4, 5)))
    with pytest.raises(ValueError, match=r"matmul.*\(2, 2, 3\).*\(3, 3, 1\)"):
        Tensor(np.ones((2, 2, 3))) @ Tensor(np.ones((3, 3, 1)))


def test_broadcasting_error_names_both_shapes():
    for op in (operator.add, operator.sub, operator.mul, operator.truediv):
        with pytest.raises(ValueError, match=r"\(2, 3\).*\(4,\)"):
            op(Tensor(np.ones((2, 3))), Tensor(np.ones(4)))


def test_concatenate_and_stack_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        concatenate([Tensor(np.ones((2, 3))), Tensor(np.ones((2, 4)))], axis=0)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        stack([Tensor(np.ones((2, 3))), Tensor(np.ones((2, 4)))])


def test_cross_entropy_errors_name_shapes_and_target_range():
    logits = Tensor(np.zeros((4, 5)))
    with pytest.raises(ValueError, match=r"\(4, 5\).*\(3,\)"):
        cross_entropy(logits, np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        cross_entropy(logits, np.array([0, 1, 5, 2]))


def test_split_that_does_not_divide_is_an_error():
    with pytest.raises(ValueError, match=r"\(5,\).*3"):
        split(Tensor(np.ones(5)), 3)


# ---- aliasing: a gradient array is owned by one tensor -------------------------------------
def test_mutating_one_leafs_grad_leaves_the_other_alone():
    a = Tensor(np.ones((2, 3)), requires_grad=True)
    b = Tensor(np.ones((2, 3)), requires_grad=True)
    (a + b).backward(np.full((2, 3), 2.0))
    a.grad += 1
    np.testing.assert_array_equal(b.grad, np.full((2, 3), 2.0))
    (a - b).backward(np.ones((2, 3)))  # accumulating into a's grad must not touch b's either
    np.testing.assert_array_equal(b.grad, np.full((2, 3), 1.0))


def test_the_seed_is_not_shared_with_any_grad():
    seed = np.full(3, 5.0)
    x = Tensor(np.ones(3), requires_grad=True)
    y = Tensor(np.ones(3), requires_grad=True)
    x.backward(seed)  # a leaf as the root
    (y * 1.0).backward(seed)
    x.grad += 1
    y.grad += 1
    np.testing.assert_array_equal(seed, np.full(3, 5.0))
    seed[:] = 0
    np.testing.assert_array_equal(x.grad, np.full(3, 6.0))
    np.testing.assert_array_equal(y.grad, np.full(3, 6.0))


def test_grads_from_views_and_broadcasts_are_writable_copies():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    x.sum().backward()  # the sum's backward hands out a read-only broadcast view
    x.grad *= 3
    x.T.backward(np.ones((3, 2)))
    np.testing.assert_array_equal(x.grad, np.full((2, 3), 4.0))


# ---- dropout -------------------------------------------------------------------------------
def test_dropout_zeroes_about_p_and_scales_the_rest():
    x = Tensor(np.ones(200_000, dtype=np.float32))
    out = functional.dropout(x, 0.3, np.random.default_rng(0))
    assert out.dtype == np.float32
    kept = out.data != 0
    assert abs(1 - kept.mean() - 0.3) < 0.01  # ~7 standard deviations
    np.testing.assert_allclose(out.data[kept], 1 / 0.7, rtol=1e-6)
    assert abs(out.data.mean() - 1.0) < 0.02  # inverted dropout keeps the expectation


def test_dropout_gradient_is_mask_times_scale():
    x = Tensor(np.random.default_rng(1).uniform(1, 2, (50, 40)), requires_grad=True)
    out = functional.dropout(x, 0.5, np.random.default_rng(2))
    seed = np.random.default_rng(3).standard_normal(x.shape)
    out.backward(seed)
    mask = out.data != 0
    np.testing.assert_array_equal(x.grad, seed * mask * 2.0)
    np.testing.assert_array_equal(out.data, x.data * mask * 2.0)


def test_dropout_is_the_identity_for_p_zero_and_in_eval():
    x = Tensor(np.ones(10), requires_grad=True)
    rng = np.random.default_rng(0)
    assert functional.dropout(x, 0.0, rng) is x
    assert functional.dropout(x, 0.5, rng, training=False) is x


def test_dropout_same_generator_state_same_mask_and_bad_p_rejected():
    x = Tensor(np.ones(100))
    a = functional.dropout(x, 0.5, np.random.default_rng(7))
    b = functional.dropout(x, 0.5, np.random.default_rng(7))
    np.testing.assert_array_equal(a.data, b.data)
    for p in (1.0, -0.1):
        with pytest.raises(ValueError, match="dropout probability"):
            functional.dropout(x, p, np.random.default_rng(0))


# ---- cross entropy and softmax stability -------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_entropy_is_stable_for_huge_logits(dtype):
    logits = np.array([[1e4, 0.0, -1e4], [5e3, 5e3 + 1.0, 0.0]], dtype=dtype)
    targets = np.array([1, 0])
    x = Tensor(logits, requires_grad=True)
    loss = cross_entropy(x, targets)
    loss.backward()
    assert np.isfinite(loss.item()) and np.all(np.isfinite(x.grad))
    expected = (1e4 + (1 + np.log1p(np.exp(-1.0)))) / 2  # -log p per row, by hand
    np.testing.assert_allclose(loss.item(), expected, rtol=1e-6)
    shifted = cross_entropy(Tensor(logits + dtype(1000)), targets)
    np.testing.assert_allclose(shifted.item(), loss.item(), rtol=1e-6)


@pytest.mark.torch
def test_cross_entropy_matches_torch_for_huge_logits():
    logits = np.random.default_rng(0).standard_normal((8, 6)) * 1e3
    targets = np.random.default_rng(1).integers(0, 6, 8)
    x, tx = Tensor(logits, requires_grad=True), torch.tensor(logits, requires_grad=True)
    loss, expected = cross_entropy(x, targets), F.cross_entropy(tx, torch.as_tensor(targets))
    loss.backward()
    expected.backward()
    np.testing.assert_allclose(loss.item(), expected.item(), rtol=1e-12)
    np.testing.assert_allclose(x.grad, tx.grad.numpy(), rtol=1e-10, atol=1e-15)


def test_relu_of_infinities():
    x = Tensor(np.array([-np.inf, -1.0, 2.0, np.inf], dtype=np.float32), requires_grad=True)
    out = x.relu()
    np.testing.assert_array_equal(out.data, [0, 0, 2, np.inf])
    assert out.dtype == np.float32
    out.backward(np.ones(4, dtype=np.float32))
    np.testing.assert_array_equal(x.grad, [0, 0, 1, 1])


def test_softmax_and_log_softmax_are_stable_for_huge_inputs():
    x = Tensor(np.array([[1e4, 0.0, -1e4]], dtype=np.float32))
    np.testing.assert_allclose(x.softmax().data, [[1, 0, 0]])
    np.testing.assert_allclose(x.log_softmax().data, [[0, -1e4, -2e4]])


def test_fused_embedding_reads_negative_ids_as_the_lookup_does():
    """-1 is row V - 1 in the lookup, so its gradient adds into that row's, as weight[ids]'s."""
    from minidp.fast.fused import embedding

    rng = np.random.default_rng(0)
    ids = np.array([[0, -1, 4, 4]])
    g = rng.standard_normal((1, 4, 3))
    fused, composed = (Tensor(rng.standard_normal((5, 3)), requires_grad=True) for _ in "ab")
    composed.data = fused.data.copy()
    (embedding(fused, ids) * Tensor(g)).sum().backward()
    (composed[ids] * Tensor(g)).sum().backward()
    np.testing.assert_allclose(fused.grad, composed.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["gelu", "softmax", "log_softmax", "masked_fill"])
def test_tensor_methods_are_the_functional_ops(name):
    """x.gelu(), x.softmax(axis), ... (tensor_ops.py, reaching functional.py when called)
    give functional's values and gradients, bit for bit."""
    data = np.random.default_rng(5).standard_normal((3, 4))
    mask = data > 0.5
    args = {"softmax": (0,), "log_softmax": (0,), "masked_fill": (mask, -2.0)}.get(name, ())
    seed = np.random.default_rng(6).standard_normal((3, 4))
    results = []
    for call in (lambda x: getattr(x, name)(*args), lambda x: getattr(functional, name)(x, *args)):
        x = Tensor(data, requires_grad=True, dtype=np.float64)
        y = call(x)
        y.backward(seed)
        results.append((y.data, x.grad))
    (y1, g1), (y2, g2) = results
    assert np.array_equal(y1, y2) and np.array_equal(g1, g2)
