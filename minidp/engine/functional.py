"""Nonlinearities, joining ops and losses, each backward right beside its forward (PyTorch's
torch.nn.functional; matmul and the elementwise math are Tensor's own ops, named here too).

Every function takes Tensors (targets, masks and conditions may be plain arrays) and returns
a Tensor built by the public `op(data, parents, backward)`, whose backward closure maps the
output gradient `g` to one gradient per input: the contract at the top of tensor.py, which
an op written outside minidp follows too. NumPy functions are called through
`xp = namespace(data)`: numpy itself on NumPy data, NumPy's names over torch on torch data.
"""

import math

import numpy as np

from minidp.engine.backend import namespace
from minidp.engine.casts import in_float32
from minidp.engine.registry import fast
from minidp.engine.tensor import Tensor, op, unbroadcast


def _tensor(x) -> Tensor:
    return x if isinstance(x, Tensor) else Tensor(x)


def _amax(a, axis):
    """a.max(axis, keepdims=True): NumPy's method (torch's returns indices too). Along the
    last axis NumPy finds where the maximum is (argmax) faster than it finds the maximum
    (docs/memory.md has the times): the same value, read from where argmax says (a NaN
    too: both pick it; of -0.0 and +0.0 it may pick the other zero, equal for every use
    here)."""
    if not isinstance(a, np.ndarray):
        return namespace(a).max(a, axis, True)
    if a.size and axis in (-1, a.ndim - 1):
        return np.take_along_axis(a, a.argmax(axis=-1, keepdims=True), axis=-1)
    return a.max(axis=axis, keepdims=True)


# ---- matmul and elementwise math: Tensor's own ops (tensor.py), under their function names
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with NumPy's rules: batched over leading axes, 1-D operands promoted."""
    return _tensor(a) @ b


def exp(x: Tensor) -> Tensor:
    return _tensor(x).exp()


def log(x: Tensor) -> Tensor:
    return _tensor(x).log()


def sqrt(x: Tensor) -> Tensor:
    return _tensor(x).sqrt()


def tanh(x: Tensor) -> Tensor:
    return _tensor(x).tanh()


def sigmoid(x: Tensor) -> Tensor:
    return _tensor(x).sigmoid()


def relu(x: Tensor) -> Tensor:
    return _tensor(x).relu()


# ---- nonlinearities built on arrays ---------------------------------------------------------
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
    x = in_float32(x)  # 16-bit torch data: in float32 (casts.py)
    e = namespace(x.data).exp(x.data - _amax(x.data, axis))  # shift: no overflow
    s = e / e.sum(axis=axis, keepdims=True)
    # Jacobian-vector product: ds = s * (g - sum(g * s))
    return op(s, (x,), lambda g: (s * (g - (g * s).sum(axis=axis, keepdims=True)),))


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    x = in_float32(x)
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
    logits = in_float32(logits)  # 16-bit torch logits: the loss in float32 (casts.py)
    xp, z = namespace(logits.data), logits.data.reshape(-1, V)
    t = targets.reshape(-1)
    N = len(t)
    if xp is not np:
        t = xp.index(t)  # the targets beside the logits, on their device
    e = z - _amax(z, 1)  # shifted: the log-sum-exp trick, stable for large logits
    rows = xp.arange(N)
    target = e[rows, t]  # each example's shifted logit at its target
    xp.exp(e, out=e)  # in place: the shifted logits are needed no more
    row_sums = fast("row_sums") if xp is np else None  # a speed trick's (registry.py)
    sum_e = e.sum(axis=1) if row_sums is None else row_sums(e)  # each row's sum
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
