"""A tiny reverse-mode autograd engine over NumPy arrays.

A `Tensor` wraps an array (`.data`). `loss.backward()` walks the recorded graph once in
reverse topological order, so each tensor's gradient is complete before it flows further
back. Leaves that require a gradient (parameters) accumulate into `.grad`, as in PyTorch, and
fire their grad-ready hooks the moment that gradient is final: data parallelism launches its
communication from those hooks while backward goes on.

Writing an op, the contract (for every op here, in ops.py, and outside minidp): compute the
forward on arrays and return `op(data, parents, backward)`. `backward(g)`, written right
beside the forward, maps the gradient of the loss with respect to the output to a tuple with
one entry per parent: that parent's gradient, or None where it needs none. A backward
- never writes into `g` (it may be shared, or a read-only view), and
- returns gradients of its inputs' shapes: `unbroadcast(grad, shape)` undoes broadcasting.
A weight's gradient may be returned unmultiplied, as `Product(x, g)` for x^T g (nn.linear
does): the engine multiplies it out for anything but a leaf, and a leaf inside
`defer_weight_grads()` (DDP's no_sync) keeps its rows, as many as fit in its gradient's
bytes, for one product over the micro-batches of gradient accumulation, taken by the next
backward outside the block or by the first read of .grad, whichever comes first
(weight_grads.py). Parallel schemes write their communication ops this way, outside this
file: Megatron's f (identity forward, allreduce backward), ZeRO's gather-on-use.

Grad mode is per thread (grad_mode.py). The arrays are NumPy's, or torch tensors with
`--backend torch`: an op that calls a NumPy function resolves `xp = namespace(data)` once
(backend.py says how, and why it costs the NumPy path nothing). This file holds the engine,
arithmetic, reductions and shape ops; matmul, nonlinearities, losses and joining ops live in
ops.py.
"""

import operator
from collections.abc import Callable

import numpy as np

from minidp.backend import backend_torch, base_of, is_torch, is_torch_dtype, namespace
from minidp.grad_mode import _grad_mode, defer_weight_grads, is_grad_enabled, no_grad
from minidp.weight_grads import Product, Rows, deferrable, multiplied

__all__ = [
    "Product",
    "Tensor",
    "defer_weight_grads",
    "is_grad_enabled",
    "no_grad",
    "op",
    "unbroadcast",
]


def _as_array(data, dtype=None) -> np.ndarray:
    """Python numbers and lists become float32 by default; NumPy arrays and NumPy scalars
    (what `array.sum()` returns) keep their dtype."""
    if isinstance(data, Tensor):
        data = data.data
    if dtype is None and isinstance(data, np.ndarray | np.generic):  # an op's output
        return np.asarray(data)
    if is_torch(data) or is_torch_dtype(dtype):  # --backend torch (backend_torch.py)
        return backend_torch().asarray(data, dtype)
    if dtype is not None:
        return np.asarray(data, dtype=dtype)
    array = np.asarray(data)
    return array.astype(np.float32) if array.dtype == np.float64 else array


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


def _broadcasting(name: str, ufunc: Callable, a: "Tensor", b: "Tensor") -> np.ndarray:
    """ufunc(a.data, b.data) (an operator: the same NumPy ufunc, and torch's too), with an
    error that names the op when shapes do not broadcast."""
    try:
        return ufunc(a.data, b.data)
    except ValueError:
        raise ValueError(f"{name}: shapes {a.shape} and {b.shape} do not broadcast") from None


def op(data: np.ndarray, parents: tuple, backward: Callable) -> "Tensor":
    """The output Tensor of an op: `data`, recorded in the graph with `parents` and
    `backward` only when grad is enabled in this thread and some parent requires a gradient.

    `data` is the forward's result, a NumPy array (kept, not copied); `parents` a tuple of
    Tensors; `backward(g)` returns one gradient (or None) per parent, in order: see the
    contract at the top of this file. An op whose forward is the identity and whose backward
    hands g to a function (Megatron's f has `allreduce` there):

        def call_on_gradient(x: Tensor, fn) -> Tensor:
            return op(x.data, (x,), lambda g: (fn(g),))

    Nothing is checked here (this runs once per op, on the hot path); backward checks that
    each leaf's gradient has the leaf's shape.
    """
    out = Tensor.__new__(Tensor)  # not Tensor(data): an op's data is mostly an array already
    # (0-d NumPy arithmetic returns a scalar: _as_array makes it an array again)
    out.data = data if type(data) is np.ndarray else _as_array(data)
    # every other field keeps its class default: a leaf that records nothing
    if _grad_mode.enabled:
        for parent in parents:  # a loop, not any(...): no generator per op
            if parent.requires_grad:
                out.requires_grad = True
                out._parents = parents
                out._backward = backward
                break
    return out


def _permute(a, axes):
    """NumPy's a.transpose(axes); torch calls it permute."""
    return a.transpose(axes) if isinstance(a, np.ndarray | np.generic) else a.permute(axes)


class Tensor:
    """An array with a gradient. `Tensor(data, requires_grad=False, dtype=None)`."""

    __array_priority__ = 100  # `ndarray + Tensor` defers to Tensor.__radd__

    # Defaults, on the class so that op() sets only what differs (it runs once per op):
    requires_grad = False
    _grad: np.ndarray | None = None
    _rows: Rows | None = None  # deferred weight-gradient rows (defer_weight_grads)
    _parents: tuple = ()
    _backward: Callable | None = None  # None marks a leaf
    _hooks: tuple | list = ()  # a list of its own once a hook is registered

    def __init__(self, data, requires_grad: bool = False, dtype=None):
        self.data = _as_array(data, dtype)
        if requires_grad:
            self.requires_grad = True

    # ---- array-like conveniences ------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)
    size = property(lambda s: s.data.size if isinstance(s.data, np.ndarray) else s.data.numel())

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{grad})"

    def item(self) -> float:
        return self.data.item()

    def numpy(self) -> np.ndarray:
        return self.data if isinstance(self.data, np.ndarray) else self.data.cpu().numpy()

    def detach(self) -> "Tensor":
        return Tensor(self.data)

    @property
    def grad(self) -> np.ndarray | None:
        """The accumulated gradient (a leaf's). Rows deferred by `defer_weight_grads()` are
        multiplied into it here, on first read, so every reader sees the whole gradient.
        (So a read may write: like backward itself, it belongs to one thread at a time.)"""
        if self._rows is not None:
            self._multiply_rows()
        return self._grad

    @grad.setter
    def grad(self, value) -> None:
        self._rows = None  # replaced: deferred rows go with the old gradient
        self._grad = value

    def keep_grad_in(self, home) -> None:
        """Make `home` (an array of this leaf's shape and dtype) hold its gradient from now
        on: a .grad it has is copied in, none at all (and no rows) is zeros, and later
        backward passes add into home. A leaf that holds only deferred rows is left as it
        is: home is not zeroed for them, and their product, once taken, is the leaf's own
        array (DDP's hook then weighs it into the slot). DDP's no_sync calls it at each
        block's end: the first micro-batch's gradients move into their bucket slots, the
        later ones add up there."""
        if self._grad is home:
            return
        if self._grad is not None:
            home[...] = self._grad
        elif self._rows is not None:
            return  # nothing multiplied yet: the product goes in whole, later
        else:
            home[...] = 0
        self._grad = home

    # ---- the engine ---------------------------------------------------------------------
    def register_grad_ready_hook(
        self, hook: Callable[["Tensor"], None], prepend: bool = False
    ) -> Callable[[], None]:
        """Call `hook(self)` each time backward has finished this leaf's gradient, after the
        hooks registered before it (`prepend=True`: before them, as PyTorch's `prepend`);
        returns a function that removes the hook."""
        if not isinstance(self._hooks, list):
            self._hooks = []
        if prepend:
            self._hooks.insert(0, hook)
        else:
            self._hooks.append(hook)
        return lambda: self._hooks.remove(hook)

    def _topological_order(self) -> list["Tensor"]:
        """The tensors behind this one that need a gradient, each after all of its parents:
        the post-order of a depth-first walk that visits parents in order."""
        order, seen, stack = [], {id(self)}, [(self, iter(self._parents))]
        while stack:  # iterative DFS: deep graphs need no recursion limit
            node, parents = stack[-1]
            for p in parents:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    if p._parents:
                        stack.append((p, iter(p._parents)))  # descend; come back for the rest
                        break
                    order.append(p)  # a leaf: nothing behind it
            else:  # every parent is placed: now this node
                stack.pop()
                order.append(node)
        return order

    def backward(self, gradient=None) -> None:
        """Backpropagate from this tensor: seeded with ones for a scalar, else `gradient`."""
        if not self.requires_grad:
            raise RuntimeError("backward(): this tensor does not require grad (no graph)")
        if gradient is None:
            if self.size != 1:
                raise RuntimeError(
                    f"backward() on a non-scalar tensor of shape {self.shape} needs a "
                    "seed gradient of that shape: t.backward(gradient)"
                )
            gradient = namespace(self.data).ones_like(self.data)
        gradient = _as_array(gradient, self.dtype)
        if gradient.shape != self.shape:
            raise ValueError(f"backward(): seed shape {gradient.shape} != tensor {self.shape}")

        grads = {id(self): gradient}  # id(tensor) -> its gradient, summed over its consumers
        # arrays already stored somewhere (the caller's seed too): copy before keeping
        handed_out: set[int] = {id(gradient)}
        for node in reversed(self._topological_order()):
            g = grads.pop(id(node), None)
            if g is None:
                continue
            if node._backward is None:  # a leaf: its gradient is final now
                node._accumulate(g, owned=base_of(g) is g and id(g) not in handed_out)
                for hook in node._hooks:
                    hook(node)
                continue
            for parent, pg in zip(node._parents, node._backward(g)):
                if pg is not None and parent.requires_grad:
                    if type(pg) is Product and parent._backward is not None:
                        pg = pg.value()  # only a leaf keeps a gradient as its factors
                    key = id(parent)
                    total = grads.get(key)
                    grads[key] = pg if total is None else multiplied(total) + multiplied(pg)
                    handed_out.add(id(pg))

    def _accumulate(self, g, owned: bool) -> None:
        """Add backward's gradient g (an array, or a Product) into this leaf's."""
        if g.shape != self.data.shape:  # += would broadcast a wrong gradient silently
            raise ValueError(f"gradient of shape {g.shape} for a tensor of shape {self.shape}")
        if type(g) is Product:
            rows = self._rows
            if not _grad_mode.defer:  # the last pass: one product over every row
                self._rows = None
                g = g.value() if rows is None else rows.value(g)
            else:
                if rows is not None and not rows.fits(g):
                    self._multiply_rows()  # full: their product goes in first
                    rows = None
                if rows is None and deferrable(g, self.data.nbytes):
                    rows = self._rows = Rows(g, self.data.nbytes)
                if rows is not None:
                    rows.add(g)
                    return  # more backward passes come: multiply later, once
                g = g.value()
            owned = True
        self._add(g, owned)

    def _multiply_rows(self) -> None:
        rows, self._rows = self._rows, None
        self._add(rows.value(), owned=True)

    def _add(self, g: np.ndarray, owned: bool) -> None:
        if self._grad is not None:
            self._grad += g  # in place: data parallelism's gradients are views into buckets
        elif owned and g.dtype == self.dtype:
            self._grad = g
        else:
            self._grad = namespace(g).array(g, dtype=self.dtype)  # a private copy

    # ---- arithmetic (forward beside backward) -------------------------------------------
    def _lift(self, other) -> "Tensor":
        """A number takes a float tensor's dtype (x * 2.0 stays float32, as in torch); with an
        integer tensor it promotes as in NumPy (x * 0.5 is float64). Arrays promote as arrays."""
        if isinstance(other, Tensor):
            return other
        if isinstance(other, np.ndarray):
            return Tensor(other)
        if not isinstance(self.data, np.ndarray):  # a torch tensor: torch's promotion rules
            return Tensor(namespace(self.data).scalar(other, self.data))
        kind = self.dtype if self.dtype.kind == "f" else np.result_type(self.dtype, other)
        return Tensor(np.asarray(other, dtype=kind))

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

    def __matmul__(self, other):
        return ops.matmul(self, self._lift(other))

    def __rmatmul__(self, other):
        return ops.matmul(self._lift(other), self)

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
        if isinstance(index, Tensor):
            index = index.data
        elif isinstance(index, tuple):
            index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
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


from minidp import ops  # noqa: E402  (ops builds on Tensor, defined above)
