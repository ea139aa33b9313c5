"""Matmul, nonlinearities, joining ops and losses, each backward right beside its forward.

Every function takes Tensors (targets, masks and conditions may be plain arrays) and returns
a Tensor built by the public `op(data, parents, backward)`, whose backward closure maps the
output gradient `g` to one gradient per input: the contract at the top of autograd.py, which
an op written outside minidp follows too. NumPy functions are called through
`xp = namespace(data)`: numpy itself on NumPy data, NumPy's names over torch on torch data.
"""

import math

import numpy as np

from minidp.autograd import Tensor, op, unbroadcast
from minidp.backend import namespace
from minidp.fused import row_sums


def _tensor(x) -> Tensor:
    return x if isinstance(x, Tensor) else Tensor(x)


def _amax(a, axis):
    """a.max(axis, keepdims=True): NumPy's method (torch's returns indices too). Along the
    last axis NumPy finds where the maximum is (argmax) ~3x faster than it finds the
    maximum: the same value, read from where argmax says (a NaN too: both pick it; of -0.0
    and +0.0 it may pick the other zero, equal for every use here)."""
    if not isinstance(a, np.ndarray):
        return namespace(a).max(a, axis, True)
    if a.size and axis in (-1, a.ndim - 1):
        return np.take_along_axis(a, a.argmax(axis=-1, keepdims=True), axis=-1)
    return a.max(axis=axis, keepdims=True)


# ---- matrix product ----------------------------------------------------------------------
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with NumPy's rules: batched over leading axes, 1-D operands promoted."""
    A = a.data[None, :] if a.ndim == 1 else a.data
    B = b.data[:, None] if b.ndim == 1 else b.data
    if a.ndim == 0 or b.ndim == 0 or A.shape[-1] != B.shape[-2]:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align")
    try:
        out = A @ B
    except ValueError:
        raise ValueError(
            f"matmul: batch shapes of {a.shape} and {b.shape} do not broadcast"
        ) from None

    def backward(g):  # C = A B  ->  dA = g B^T,  dB = A^T g  (then undo batch broadcasting)
        g = g.reshape(out.shape)  # put back the axes a 1-D operand dropped
        At, Bt = A.swapaxes(-1, -2), B.swapaxes(-1, -2)  # views, no copies
        da = unbroadcast(g @ Bt, A.shape).reshape(a.shape) if a.requires_grad else None
        db = unbroadcast(At @ g, B.shape).reshape(b.shape) if b.requires_grad else None
        return da, db

    result = out
    if a.ndim == 1:
        result = result[..., 0, :]
    if b.ndim == 1:
        result = result[..., 0]
    return op(result, (a, b), backward)


# ---- elementwise ------------------------------------------------------------------------
def exp(x: Tensor) -> Tensor:
    out = namespace(x.data).exp(x.data)
    return op(out, (x,), lambda g: (g * out,))  # d/dx e^x = e^x


def log(x: Tensor) -> Tensor:
    return op(namespace(x.data).log(x.data), (x,), lambda g: (g / x.data,))  # d/dx log x = 1/x


def sqrt(x: Tensor) -> Tensor:
    out = namespace(x.data).sqrt(x.data)
    return op(out, (x,), lambda g: (g * 0.5 / out,))  # d/dx sqrt x = 1 / (2 sqrt x)


def tanh(x: Tensor) -> Tensor:
    out = namespace(x.data).tanh(x.data)
    return op(out, (x,), lambda g: (g * (1 - out * out),))


def sigmoid(x: Tensor) -> Tensor:
    out = 1 / (1 + namespace(x.data).exp(-x.data))
    return op(out, (x,), lambda g: (g * out * (1 - out),))


def relu(x: Tensor) -> Tensor:
    positive = x.data > 0
    # maximum, not x * positive: -inf * 0 would be nan
    return op(namespace(x.data).maximum(x.data, 0), (x,), lambda g: (g * positive,))


_GELU_C = math.sqrt(2 / math.pi)  # a Python float: keeps float32 arrays float32


def gelu(x: Tensor) -> Tensor:
    """GELU, tanh approximation (GPT-2; torch's `gelu(approximate="tanh")`):
    0.5 x (1 + tanh(c (x + 0.044715 x^3))),  c = sqrt(2/pi)."""
    v = x.data
    t = namespace(v).tanh(_GELU_C * (v + 0.044715 * v * v * v))

    def backward(g):  # product rule, then d tanh(u) = (1 - tanh^2) du
        du = _GELU_C * (1 + 3 * 0.044715 * v * v)
        return (g * (0.5 * (1 + t) + 0.5 * v * (1 - t * t) * du),)

    return op(0.5 * v * (1 + t), (x,), backward)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    e = namespace(x.data).exp(x.data - _amax(x.data, axis))  # shift: no overflow
    s = e / e.sum(axis=axis, keepdims=True)
    # Jacobian-vector product: ds = s * (g - sum(g * s))
    return op(s, (x,), lambda g: (s * (g - (g * s).sum(axis=axis, keepdims=True)),))


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    xp, shifted = namespace(x.data), x.data - _amax(x.data, axis)
    out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
    # d log_softmax: g - softmax * sum(g)
    return op(out, (x,), lambda g: (g - xp.exp(out) * g.sum(axis=axis, keepdims=True),))


# ---- selection ----------------------------------------------------------------------------
def where(condition, a, b) -> Tensor:
    """Elementwise `a if condition else b`, broadcasting all three."""
    a, b = _tensor(a), _tensor(b)
    xp = namespace(a.data)
    cond = condition.data if isinstance(condition, Tensor) else xp.asarray(condition, bool)
    out = xp.where(cond, a.data, b.data)

    def backward(g):
        return (
            unbroadcast(xp.where(cond, g, 0), a.shape) if a.requires_grad else None,
            unbroadcast(xp.where(cond, 0, g), b.shape) if b.requires_grad else None,
        )

    return op(out, (a, b), backward)


def masked_fill(x: Tensor, mask, value: float) -> Tensor:
    """x with `value` where mask is True (a causal mask fills the future with -inf)."""
    xp = namespace(x.data)
    mask = mask.data if isinstance(mask, Tensor) else xp.asarray(mask, bool)
    out = xp.where(mask, xp.asarray(value, dtype=x.dtype), x.data)
    return op(out, (x,), lambda g: (unbroadcast(xp.where(mask, 0, g), x.shape),))


def dropout(x: Tensor, p: float, rng: np.random.Generator, training: bool = True) -> Tensor:
    """Zero each element with probability p and scale the rest by 1/(1-p) (inverted dropout)."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    xp = namespace(x.data)  # the mask is drawn on the host, from the one NumPy generator
    keep = xp.astype(rng.random(x.shape) >= p, x.dtype) * (1.0 / (1.0 - p))
    return op(x.data * keep, (x,), lambda g: (g * keep,))


# ---- joining and splitting -------------------------------------------------------------
def concatenate(tensors: list, axis: int = 0) -> Tensor:
    tensors = [_tensor(t) for t in tensors]
    try:
        xp = namespace(tensors[0].data)
        out = xp.concatenate([t.data for t in tensors], axis=axis)
    except ValueError:
        shapes = ", ".join(str(t.shape) for t in tensors)
        raise ValueError(f"concatenate(axis={axis}): shapes {shapes} do not fit") from None
    edges = np.cumsum([t.shape[axis] for t in tensors])[:-1]
    return op(out, tuple(tensors), lambda g: tuple(xp.split(g, edges, axis=axis)))


def stack(tensors: list, axis: int = 0) -> Tensor:
    tensors = [_tensor(t) for t in tensors]
    shapes = {t.shape for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"stack: all shapes must match, got {sorted(shapes)}")
    xp = namespace(tensors[0].data)
    out = xp.stack([t.data for t in tensors], axis=axis)
    n = len(tensors)
    return op(out, tuple(tensors), lambda g: tuple(xp.take(g, i, axis=axis) for i in range(n)))


def split(x: Tensor, sections, axis: int = 0) -> list[Tensor]:
    """Like np.split: `sections` is a count of equal parts or a list of cut indices."""
    n = x.shape[axis]
    if isinstance(sections, int):
        if sections <= 0 or n % sections:
            raise ValueError(
                f"split: axis {axis} of shape {x.shape} does not divide into {sections}"
            )
        cuts = list(range(0, n + 1, n // sections))
    else:
        cuts = [0, *sections, n]
    index = [slice(None)] * x.ndim
    parts = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        index[axis % x.ndim] = slice(lo, hi)
        parts.append(x[tuple(index)])
    return parts


# ---- losses -------------------------------------------------------------------------------
def cross_entropy(logits: Tensor, targets) -> Tensor:
    """Mean over examples of -log softmax(logits)[target]; logits (..., V), targets (...) ints.

    Fused: forward keeps exp(logits - max) and its row sums, and backward is
    (softmax - onehot(target)) / N, in one pass."""
    targets = np.asarray(targets.data if isinstance(targets, Tensor) else targets)
    V = logits.shape[-1]
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: logits {logits.shape} do not match targets {targets.shape}"
        )
    if targets.size and (targets.min() < 0 or targets.max() >= V):
        raise ValueError(
            f"cross_entropy: targets must lie in [0, {V}), got {targets.min()}..{targets.max()}"
        )
    xp, z = namespace(logits.data), logits.data.reshape(-1, V)
    t = targets.reshape(-1)
    N = len(t)
    if xp is not np:
        t = xp.index(t)  # the targets beside the logits, on their device
    e = z - _amax(z, 1)  # shifted: the log-sum-exp trick, stable for large logits
    rows = xp.arange(N)
    target = e[rows, t]  # each example's shifted logit at its target
    xp.exp(e, out=e)  # in place: the shifted logits are needed no more
    sum_e = row_sums(e) if xp is np else e.sum(axis=1)  # each row's sum (fused.row_sums)
    loss = xp.log(sum_e) - target

    def backward(g):  # (softmax - onehot(target)) g / N
        d = e * (g / N / sum_e)[:, None]
        d[rows, t] -= g / N
        return (d.reshape(logits.shape),)

    # sum / N: the bits of loss.mean(), without its Python overhead
    return op(xp.asarray(loss.sum() / N, dtype=logits.dtype), (logits,), backward)


def mse(prediction: Tensor, target) -> Tensor:
    """Mean squared error, averaged over every element."""
    target = _tensor(target)
    if prediction.shape != target.shape:
        raise ValueError(f"mse: prediction {prediction.shape} and target {target.shape} differ")
    diff = prediction - target
    return (diff * diff).mean()
