"""Tensor's ops: arithmetic, reductions, shapes and indexing, matmul and the elementwise math,
each backward right beside its forward (micrograd's Value methods, on arrays).

`Tensor` (tensor.py) takes these methods from `TensorOps`. Every one computes its forward on
arrays and returns `self._op(data, parents, backward)`: tensor.py's `op`, the contract at the
top of that file, reached through the class (tensor.py imports this file, so this one cannot
import it back). Nonlinearities built from these, joining ops and losses are
in functional.py.
"""

import operator
from collections.abc import Callable

import numpy as np

from minidp.engine.backend import namespace
from minidp.engine.casts import matmul_operands

__all__ = ["TensorOps", "unbroadcast"]


def unbroadcast(g: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum g down to `shape`: the gradient of NumPy broadcasting (undo broadcasting).

    For an input of shape (3,) added to a batch (4, 3), `unbroadcast(g, (3,))` is g.sum(0).
    Returns g itself when it has the shape already (so: never write into the result)."""
    if g.shape == shape:
        return g
    extra = g.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        i + extra for i, n in enumerate(shape) if n == 1 and g.shape[i + extra] != 1
    )
    summed = g.sum(axis=axes, keepdims=True) if axes else g
    if summed.shape[extra:] != shape:  # a backward returned the wrong shape: say so, loudly
        raise ValueError(f"a gradient of shape {g.shape} does not reduce to shape {shape}")
    return summed.reshape(shape)


class TensorOps:
    """The methods of Tensor that build graph nodes from arrays."""

    __slots__ = ()
    _op: Callable  # tensor.op, set by Tensor

    # ---- arithmetic (forward beside backward) -------------------------------------------
    def _constant(self, data):
        """A Tensor of `data` that records nothing: op() with no parents."""
        return self._op(data, (), None)

    def _lift(self, other):
        """A number takes a float tensor's dtype (x * 2.0 stays float32, as in torch); with an
        integer tensor it promotes as in NumPy (x * 0.5 is float64). Arrays promote as arrays."""
        if isinstance(other, TensorOps):
            return other
        if isinstance(other, np.ndarray):
            return self._constant(other)
        if not isinstance(self.data, np.ndarray):  # a torch tensor: torch's promotion rules
            return self._constant(namespace(self.data).scalar(other, self.data))
        kind = self.dtype if self.dtype.kind == "f" else np.result_type(self.dtype, other)
        return self._constant(np.asarray(other, dtype=kind))

    def __add__(self, other):
        a, b = self, self._lift(other)
        out = _broadcasting("add", operator.add, a, b)
        return self._op(out, (a, b), lambda g: (unbroadcast(g, a.shape), unbroadcast(g, b.shape)))

    def __sub__(self, other):
        a, b = self, self._lift(other)
        out = _broadcasting("sub", operator.sub, a, b)
        return self._op(out, (a, b), lambda g: (unbroadcast(g, a.shape), unbroadcast(-g, b.shape)))

    def __mul__(self, other):
        a, b = self, self._lift(other)

        def backward(g):
            return (
                unbroadcast(g * b.data, a.shape) if a.requires_grad else None,
                unbroadcast(g * a.data, b.shape) if b.requires_grad else None,
            )

        return self._op(_broadcasting("mul", operator.mul, a, b), (a, b), backward)

    def __truediv__(self, other):
        a, b = self, self._lift(other)

        def backward(g):  # d(a/b) = da/b - a db/b^2
            return (
                unbroadcast(g / b.data, a.shape) if a.requires_grad else None,
                unbroadcast(-g * a.data / (b.data * b.data), b.shape) if b.requires_grad else None,
            )

        return self._op(_broadcasting("div", operator.truediv, a, b), (a, b), backward)

    def __neg__(self):
        return self._op(-self.data, (self,), lambda g: (-g,))

    def __pow__(self, exponent):
        if not isinstance(exponent, int | float):
            raise TypeError("** takes a Python number as exponent")
        x = self.data

        def backward(g):  # d/dx x^k = k x^(k-1); x^0 is constant (no 0 * 0^-1 = nan at 0)
            return (
                namespace(g).zeros_like(g)
                if exponent == 0
                else g * (exponent * x ** (exponent - 1)),
            )

        return self._op(x**exponent, (self,), backward)

    def __radd__(self, other):
        return self + other

    def __rsub__(self, other):
        return self._lift(other) - self

    def __rmul__(self, other):
        return self * other

    def __rtruediv__(self, other):
        return self._lift(other) / self

    # ---- reductions ---------------------------------------------------------------------
    def sum(self, axis=None, keepdims: bool = False):
        shape = self.shape

        def backward(g):  # every input element contributed once: spread g back out
            xp = namespace(g)
            if axis is not None and not keepdims:
                g = xp.expand_dims(g, axis)
            return (xp.broadcast_to(g, shape),)

        return self._op(self.data.sum(axis=axis, keepdims=keepdims), (self,), backward)

    def mean(self, axis=None, keepdims: bool = False):
        axes = range(self.ndim) if axis is None else np.atleast_1d(axis)
        count = int(np.prod([self.shape[i] for i in axes]))
        return self.sum(axis=axis, keepdims=keepdims) * (1.0 / count)

    def max(self, axis=None, keepdims: bool = False):
        x, xp = self.data, namespace(self.data)
        out = x.max(axis=axis, keepdims=keepdims) if xp is np else xp.max(x, axis, keepdims)

        def backward(g):  # ties share the gradient equally
            if axis is not None and not keepdims:
                g, m = xp.expand_dims(g, axis), xp.expand_dims(out, axis)
            else:
                m = out
            mask = xp.astype(x == m, x.dtype)  # in x's dtype: float32 stays float32
            return (g * mask / mask.sum(axis=axis, keepdims=True),)

        return self._op(out, (self,), backward)

    # ---- shapes and indexing ----------------------------------------------------------
    def to(self, dtype):
        """These values as `dtype` (PyTorch's .to(dtype)); the gradient goes back as the old
        dtype. Mixed precision reads 16-bit weights as float32 this way."""
        old, xp = self.dtype, namespace(self.data)
        return self._op(xp.astype(self.data, dtype), (self,), lambda g: (xp.astype(g, old),))

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        old = self.shape
        return self._op(self.data.reshape(shape), (self,), lambda g: (g.reshape(old),))

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], tuple | list) else axes
        axes = tuple(axes) or tuple(reversed(range(self.ndim)))
        out = _permute(self.data, axes)  # NumPy (or torch) checks the axes
        inverse = tuple(np.argsort([a % self.ndim for a in axes]).tolist())  # -1: the last
        return self._op(out, (self,), lambda g: (_permute(g, inverse),))

    permute = transpose

    @property
    def T(self):
        return self.transpose()

    def __getitem__(self, index):
        if isinstance(index, TensorOps):
            index = index.data
        elif isinstance(index, tuple):
            index = tuple(i.data if isinstance(i, TensorOps) else i for i in index)
        shape, dtype = self.shape, self.dtype
        parts = index if isinstance(index, tuple) else (index,)
        fancy = any(isinstance(i, np.ndarray | list) for i in parts)
        xp = namespace(self.data)
        if fancy and xp is not np:
            index = xp.index(index)  # NumPy index arrays as tensors on the device

        def backward(g):
            full = xp.zeros(shape, dtype=dtype)
            if fancy:
                xp.add.at(full, index, g)  # repeated indices must add up, not overwrite
            else:
                full[index] = g  # basic slicing never repeats an element
            return (full,)

        return self._op(self.data[index], (self,), backward)

    # ---- matmul and elementwise math ---------------------------------------------------
    def __matmul__(self, other):
        return _matmul(self, self._lift(other))

    def __rmatmul__(self, other):
        return _matmul(self._lift(other), self)

    def exp(self):
        out = namespace(self.data).exp(self.data)
        return self._op(out, (self,), lambda g: (g * out,))  # d/dx e^x = e^x

    def log(self):
        return self._op(
            namespace(self.data).log(self.data), (self,), lambda g: (g / self.data,)
        )  # d/dx log x = 1/x

    def sqrt(self):
        out = namespace(self.data).sqrt(self.data)
        return self._op(out, (self,), lambda g: (g * 0.5 / out,))  # d/dx sqrt x = 1 / (2 sqrt x)

    def tanh(self):
        out = namespace(self.data).tanh(self.data)
        return self._op(out, (self,), lambda g: (g * (1 - out * out),))

    def sigmoid(self):
        out = 1 / (1 + namespace(self.data).exp(-self.data))
        return self._op(out, (self,), lambda g: (g * out * (1 - out),))

    def relu(self):
        positive = self.data > 0
        # maximum, not x * positive: -inf * 0 would be nan
        return self._op(
            namespace(self.data).maximum(self.data, 0), (self,), lambda g: (g * positive,)
        )

    # ---- ops built in functional.py, as methods (PyTorch's Tensor has them too) ---------
    def gelu(self):
        return _functional().gelu(self)

    def softmax(self, axis: int = -1):
        return _functional().softmax(self, axis)

    def log_softmax(self, axis: int = -1):
        return _functional().log_softmax(self, axis)

    def masked_fill(self, mask, value: float):
        return _functional().masked_fill(self, mask, value)


# ---- helpers of the ops above ------------------------------------------------------------
def _broadcasting(name: str, ufunc: Callable, a, b) -> np.ndarray:
    """ufunc(a.data, b.data) (an operator: the same NumPy ufunc, and torch's too), with an
    error that names the op when shapes do not broadcast."""
    try:
        return ufunc(a.data, b.data)
    except ValueError:
        raise ValueError(f"{name}: shapes {a.shape} and {b.shape} do not broadcast") from None


def _permute(a, axes):
    """NumPy's a.transpose(axes); torch calls it permute."""
    return a.transpose(axes) if isinstance(a, np.ndarray | np.generic) else a.permute(axes)


def _matmul(a: TensorOps, b: TensorOps) -> TensorOps:
    """a @ b with NumPy's rules: batched over leading axes, 1-D operands promoted (on torch,
    mixed float dtypes multiplied in the 16-bit one: casts.py)."""
    a, b = matmul_operands(a, b)
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
    return a._op(result, (a, b), backward)


def _functional():
    """functional.py, imported when first called: it builds on this file, so this file
    cannot import it at the top."""
    from minidp.engine import functional

    return functional
