"""A tiny reverse-mode autograd engine over NumPy arrays.

A `Tensor` wraps an array (`.data`). Every op builds its output with `_result(...)`, handing
over a `backward(g)` closure written right beside the forward: given the gradient of the
loss with respect to the output, it returns the gradient with respect to each input (or None
where an input needs none). `loss.backward()` walks the graph once in reverse topological
order, so each tensor's gradient is complete before it flows further back.

Leaves that require a gradient (parameters) accumulate into `.grad`, as in PyTorch, and fire
their grad-ready hooks the moment that gradient is final: data parallelism launches its
communication from those hooks while backward goes on.

Rules every backward here keeps: never write into the incoming `g` (it may be shared), and
undo broadcasting (`_unbroadcast`) so a gradient always has its input's shape.
The nonlinearities, losses and joining ops live in ops.py; this file holds the engine,
arithmetic, matmul, reductions and shape ops.
"""

import contextlib
from collections.abc import Callable

import numpy as np

_grad_enabled = True


@contextlib.contextmanager
def no_grad():
    """Inside this block ops record no graph (evaluation, optimizer updates)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = previous


def is_grad_enabled() -> bool:
    return _grad_enabled


def _as_array(data, dtype=None) -> np.ndarray:
    """Python numbers and lists become float32 by default; NumPy arrays and NumPy scalars
    (what `array.sum()` returns) keep their dtype."""
    if isinstance(data, Tensor):
        data = data.data
    if dtype is not None:
        return np.asarray(data, dtype=dtype)
    if isinstance(data, np.ndarray | np.generic):
        return np.asarray(data)
    array = np.asarray(data)
    return array.astype(np.float32) if array.dtype == np.float64 else array


def _unbroadcast(g: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum g down to `shape`: the gradient of numpy broadcasting (undo broadcasting)."""
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


def _broadcast_shape(op: str, a: np.ndarray, b: np.ndarray) -> None:
    try:
        np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise ValueError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast") from None


class Tensor:
    """An array with a gradient. `Tensor(data, requires_grad=False, dtype=None)`."""

    __array_priority__ = 100  # `ndarray + Tensor` defers to Tensor.__radd__

    def __init__(self, data, requires_grad: bool = False, dtype=None):
        self.data = _as_array(data, dtype)
        self.grad: np.ndarray | None = None
        self.requires_grad = bool(requires_grad)
        self._parents: tuple = ()
        self._backward: Callable | None = None  # None marks a leaf
        self._hooks: list[Callable] = []

    # ---- array-like conveniences ------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)
    size = property(lambda self: self.data.size)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{grad})"

    def item(self) -> float:
        return self.data.item()

    def numpy(self) -> np.ndarray:
        return self.data

    def detach(self) -> "Tensor":
        return Tensor(self.data)

    # ---- the engine ---------------------------------------------------------------------
    def register_grad_ready_hook(self, hook: Callable[["Tensor"], None]) -> Callable[[], None]:
        """Call `hook(self)` each time backward has finished this leaf's gradient.

        Returns a function that removes the hook."""
        self._hooks.append(hook)
        return lambda: self._hooks.remove(hook)

    def _topological_order(self) -> list["Tensor"]:
        order, seen, stack = [], set(), [(self, False)]
        while stack:  # iterative post-order DFS: deep graphs need no recursion limit
            node, done = stack.pop()
            if done:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            stack.extend(
                (p, False) for p in reversed(node._parents) if p.requires_grad and id(p) not in seen
            )
        return order

    def backward(self, gradient=None) -> None:
        """Backpropagate from this tensor: seeded with ones for a scalar, else `gradient`."""
        if not self.requires_grad:
            raise RuntimeError("backward(): this tensor does not require grad (no graph)")
        if gradient is None:
            if self.data.size != 1:
                raise RuntimeError(
                    f"backward() on a non-scalar tensor of shape {self.shape} needs a "
                    "seed gradient of that shape: t.backward(gradient)"
                )
            gradient = np.ones_like(self.data)
        gradient = _as_array(gradient, self.dtype)
        if gradient.shape != self.shape:
            raise ValueError(f"backward(): seed shape {gradient.shape} != tensor {self.shape}")

        grads = {id(self): gradient}
        # arrays already stored somewhere (the caller's seed too): copy before keeping
        handed_out: set[int] = {id(gradient)}
        for node in reversed(self._topological_order()):
            g = grads.pop(id(node), None)
            if g is None:
                continue
            if node._backward is None:  # a leaf: its gradient is final now
                node._accumulate(g, owned=g.base is None and id(g) not in handed_out)
                handed_out.add(id(g))
                for hook in node._hooks:
                    hook(node)
                continue
            for parent, pg in zip(node._parents, node._backward(g)):
                if pg is None or not parent.requires_grad:
                    continue
                key = id(parent)
                grads[key] = grads[key] + pg if key in grads else pg
                handed_out.add(id(pg))

    def _accumulate(self, g: np.ndarray, owned: bool) -> None:
        if g.shape != self.shape:  # += would broadcast a wrong gradient silently
            raise ValueError(f"gradient of shape {g.shape} for a tensor of shape {self.shape}")
        if self.grad is not None:
            self.grad += g  # in place: data parallelism's gradients are views into buckets
        elif owned and g.dtype == self.dtype:
            self.grad = g
        else:
            self.grad = np.array(g, dtype=self.dtype)  # a private copy

    # ---- arithmetic (forward beside backward) -------------------------------------------
    def _lift(self, other) -> "Tensor":
        """A number takes a float tensor's dtype (x * 2.0 stays float32, as in torch); with an
        integer tensor it promotes as in NumPy (x * 0.5 is float64). Arrays promote as arrays."""
        if isinstance(other, Tensor):
            return other
        if isinstance(other, np.ndarray):
            return Tensor(other)
        kind = self.dtype if self.dtype.kind == "f" else np.result_type(self.dtype, other)
        return Tensor(np.asarray(other, dtype=kind))

    def __add__(self, other):
        a, b = self, self._lift(other)
        _broadcast_shape("add", a.data, b.data)
        return _result(
            a.data + b.data, (a, b), lambda g: (_unbroadcast(g, a.shape), _unbroadcast(g, b.shape))
        )

    def __sub__(self, other):
        a, b = self, self._lift(other)
        _broadcast_shape("sub", a.data, b.data)
        return _result(
            a.data - b.data, (a, b), lambda g: (_unbroadcast(g, a.shape), _unbroadcast(-g, b.shape))
        )

    def __mul__(self, other):
        a, b = self, self._lift(other)
        _broadcast_shape("mul", a.data, b.data)

        def backward(g):
            return (
                _unbroadcast(g * b.data, a.shape) if a.requires_grad else None,
                _unbroadcast(g * a.data, b.shape) if b.requires_grad else None,
            )

        return _result(a.data * b.data, (a, b), backward)

    def __truediv__(self, other):
        a, b = self, self._lift(other)
        _broadcast_shape("div", a.data, b.data)

        def backward(g):  # d(a/b) = da/b - a db/b^2
            return (
                _unbroadcast(g / b.data, a.shape) if a.requires_grad else None,
                _unbroadcast(-g * a.data / (b.data * b.data), b.shape) if b.requires_grad else None,
            )

        return _result(a.data / b.data, (a, b), backward)

    def __neg__(self):
        return _result(-self.data, (self,), lambda g: (-g,))

    def __pow__(self, exponent):
        if not isinstance(exponent, int | float):
            raise TypeError("** takes a Python number as exponent")
        x = self.data

        def backward(g):  # d/dx x^k = k x^(k-1); x^0 is constant (no 0 * 0^-1 = nan at 0)
            return (np.zeros_like(g) if exponent == 0 else g * (exponent * x ** (exponent - 1)),)

        return _result(x**exponent, (self,), backward)

    def __radd__(self, other):
        return self + other

    def __rsub__(self, other):
        return self._lift(other) - self

    def __rmul__(self, other):
        return self * other

    def __rtruediv__(self, other):
        return self._lift(other) / self

    def __matmul__(self, other):
        return matmul(self, self._lift(other))

    def __rmatmul__(self, other):
        return matmul(self._lift(other), self)

    # ---- reductions ---------------------------------------------------------------------
    def sum(self, axis=None, keepdims: bool = False):
        shape = self.shape

        def backward(g):  # every input element contributed once: spread g back out
            if axis is not None and not keepdims:
                g = np.expand_dims(g, axis)
            return (np.broadcast_to(g, shape),)

        return _result(self.data.sum(axis=axis, keepdims=keepdims), (self,), backward)

    def mean(self, axis=None, keepdims: bool = False):
        axes = range(self.ndim) if axis is None else np.atleast_1d(axis)
        count = int(np.prod([self.shape[i] for i in axes]))
        return self.sum(axis=axis, keepdims=keepdims) * (1.0 / count)

    def max(self, axis=None, keepdims: bool = False):
        x = self.data
        out = x.max(axis=axis, keepdims=keepdims)

        def backward(g):  # ties share the gradient equally
            if axis is not None and not keepdims:
                g, m = np.expand_dims(g, axis), np.expand_dims(out, axis)
            else:
                m = out
            mask = (x == m).astype(x.dtype)  # in x's dtype: float32 stays float32
            return (g * mask / mask.sum(axis=axis, keepdims=True),)

        return _result(out, (self,), backward)

    # ---- shapes and indexing ----------------------------------------------------------
    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        old = self.shape
        return _result(self.data.reshape(shape), (self,), lambda g: (g.reshape(old),))

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], tuple | list) else axes
        axes = tuple(axes) or tuple(reversed(range(self.ndim)))
        out = self.data.transpose(axes)  # NumPy checks the axes
        inverse = tuple(np.argsort([a % self.ndim for a in axes]))  # -1 means the last axis
        return _result(out, (self,), lambda g: (g.transpose(inverse),))

    permute = transpose

    @property
    def T(self):
        return self.transpose()

    def __getitem__(self, index):
        if isinstance(index, Tensor):
            index = index.data
        elif isinstance(index, tuple):
            index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
        shape, dtype = self.shape, self.dtype
        parts = index if isinstance(index, tuple) else (index,)
        fancy = any(isinstance(i, np.ndarray | list) for i in parts)

        def backward(g):
            full = np.zeros(shape, dtype=dtype)
            if fancy:
                np.add.at(full, index, g)  # repeated indices must add up, not overwrite
            else:
                full[index] = g  # basic slicing never repeats an element
            return (full,)

        return _result(self.data[index], (self,), backward)

    # ---- elementwise math and friends, defined in ops.py -------------------------------
    def exp(self):
        return ops.exp(self)

    def log(self):
        return ops.log(self)

    def sqrt(self):
        return ops.sqrt(self)

    def tanh(self):
        return ops.tanh(self)

    def sigmoid(self):
        return ops.sigmoid(self)

    def relu(self):
        return ops.relu(self)

    def gelu(self):
        return ops.gelu(self)

    def softmax(self, axis: int = -1):
        return ops.softmax(self, axis)

    def log_softmax(self, axis: int = -1):
        return ops.log_softmax(self, axis)

    def masked_fill(self, mask, value: float):
        return ops.masked_fill(self, mask, value)


def _result(data: np.ndarray, parents: tuple, backward: Callable) -> Tensor:
    """The output of an op: recorded in the graph only if some input needs a gradient."""
    out = Tensor(data)
    if _grad_enabled and any(p.requires_grad for p in parents):
        out.requires_grad = True
        out._parents = parents
        out._backward = backward
    return out


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
        da = _unbroadcast(g @ Bt, A.shape).reshape(a.shape) if a.requires_grad else None
        db = _unbroadcast(At @ g, B.shape).reshape(b.shape) if b.requires_grad else None
        return da, db

    result = out
    if a.ndim == 1:
        result = result[..., 0, :]
    if b.ndim == 1:
        result = result[..., 0]
    return _result(result, (a, b), backward)


from minidp import ops  # noqa: E402  (ops builds on Tensor, defined above)
