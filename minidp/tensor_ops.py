"""Tensor's arithmetic, reductions, shape ops and indexing, each backward beside its forward.

`Tensor` (autograd.py) takes these methods from `TensorOps`; every one computes its forward
on arrays and returns `op(data, parents, backward)`, the contract at the top of autograd.py.
Matmul, the nonlinearities, joining ops and losses are in functional.py.
"""

import operator
from collections.abc import Callable

import numpy as np

import minidp
from minidp.autograd import op, unbroadcast
from minidp.backend import namespace


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


def _constant(data):
    """A Tensor of `data` that records nothing: op() with no parents."""
    return op(data, (), None)


class TensorOps:
    """The methods of autograd.Tensor that build graph nodes from arrays."""

    __slots__ = ()

    # ---- arithmetic (forward beside backward) -------------------------------------------
    def _lift(self, other):
        """A number takes a float tensor's dtype (x * 2.0 stays float32, as in torch); with an
        integer tensor it promotes as in NumPy (x * 0.5 is float64). Arrays promote as arrays."""
        if isinstance(other, TensorOps):
            return other
        if isinstance(other, np.ndarray):
            return _constant(other)
        if not isinstance(self.data, np.ndarray):  # a torch tensor: torch's promotion rules
            return _constant(namespace(self.data).scalar(other, self.data))
        kind = self.dtype if self.dtype.kind == "f" else np.result_type(self.dtype, other)
        return _constant(np.asarray(other, dtype=kind))

    def __add__(self, other):
        a, b = self, self._lift(other)
        out = _broadcasting("add", operator.add, a, b)
        return op(out, (a, b), lambda g: (unbroadcast(g, a.shape), unbroadcast(g, b.shape)))

    def __sub__(self, other):
        a, b = self, self._lift(other)
        out = _broadcasting("sub", operator.sub, a, b)
        return op(out, (a, b), lambda g: (unbroadcast(g, a.shape), unbroadcast(-g, b.shape)))

    def __mul__(self, other):
        a, b = self, self._lift(other)

        def backward(g):
            return (
                unbroadcast(g * b.data, a.shape) if a.requires_grad else None,
                unbroadcast(g * a.data, b.shape) if b.requires_grad else None,
            )

        return op(_broadcasting("mul", operator.mul, a, b), (a, b), backward)

    def __truediv__(self, other):
        a, b = self, self._lift(other)

        def backward(g):  # d(a/b) = da/b - a db/b^2
            return (
                unbroadcast(g / b.data, a.shape) if a.requires_grad else None,
                unbroadcast(-g * a.data / (b.data * b.data), b.shape) if b.requires_grad else None,
            )

        return op(_broadcasting("div", operator.truediv, a, b), (a, b), backward)

    def __neg__(self):
        return op(-self.data, (self,), lambda g: (-g,))

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

        return op(x**exponent, (self,), backward)

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

        return op(self.data.sum(axis=axis, keepdims=keepdims), (self,), backward)

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

        return op(out, (self,), backward)

    # ---- shapes and indexing ----------------------------------------------------------
    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        old = self.shape
        return op(self.data.reshape(shape), (self,), lambda g: (g.reshape(old),))

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], tuple | list) else axes
        axes = tuple(axes) or tuple(reversed(range(self.ndim)))
        out = _permute(self.data, axes)  # NumPy (or torch) checks the axes
        inverse = tuple(np.argsort([a % self.ndim for a in axes]).tolist())  # -1: the last
        return op(out, (self,), lambda g: (_permute(g, inverse),))

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

        return op(self.data[index], (self,), backward)

    # ---- matmul, elementwise math and friends, defined in functional.py -----------------------
    def __matmul__(self, other):
        return minidp.functional.matmul(self, self._lift(other))

    def __rmatmul__(self, other):
        return minidp.functional.matmul(self._lift(other), self)

    def exp(self):
        return minidp.functional.exp(self)

    def log(self):
        return minidp.functional.log(self)

    def sqrt(self):
        return minidp.functional.sqrt(self)

    def tanh(self):
        return minidp.functional.tanh(self)

    def sigmoid(self):
        return minidp.functional.sigmoid(self)

    def relu(self):
        return minidp.functional.relu(self)

    def gelu(self):
        return minidp.functional.gelu(self)

    def softmax(self, axis: int = -1):
        return minidp.functional.softmax(self, axis)

    def log_softmax(self, axis: int = -1):
        return minidp.functional.log_softmax(self, axis)

    def masked_fill(self, mask, value: float):
        return minidp.functional.masked_fill(self, mask, value)
