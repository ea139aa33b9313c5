"""The engine: a Tensor, the ops it records, and backward over them (micrograd, on arrays).

A `Tensor` wraps an array (`.data`). Every op computes its forward on arrays and returns
`op(data, parents, backward)`; `loss.backward()` walks the recorded graph once in reverse
topological order, so each tensor's gradient is complete before it flows further back.
Leaves that require a gradient accumulate into `.grad`, as in PyTorch, and fire their
grad-ready hooks the moment it is final: data parallelism communicates from those hooks.

Writing an op, the contract (for every op here, in functional.py, and outside minidp):
`backward(g)`, written right beside the forward, maps the gradient of the loss with respect
to the output to a tuple with one entry per parent: that parent's gradient, or None where it
needs none. A backward never writes into `g` (it may be shared, or a read-only view), and
returns gradients of its inputs' shapes: `unbroadcast(grad, shape)` undoes broadcasting.
Parallel schemes write their communication ops this way, outside this file: Megatron's f
(identity forward, allreduce backward), ZeRO's gather-on-use.

One hook for a speed trick: a backward may return a `LazyGradient` (a gradient not computed
yet). The engine takes its value() for anything but a leaf; a leaf asks it `into_leaf(leaf)`
what to add, and it may stay pending on the leaf until .grad is read. Deferred weight
gradients (minidp/fast/weight_grads.py) plug in there; else every gradient is an array.

Grad mode is per thread (grad_mode.py). The arrays are NumPy's, or torch tensors with
`--backend torch` (backend.py). Tensor's ops are in tensor_ops.py; functional.py, next.
"""

from collections.abc import Callable

import numpy as np

from minidp.engine.backend import backend_torch, base_of, is_torch, is_torch_dtype, namespace
from minidp.engine.grad_mode import _grad_mode, is_grad_enabled, no_grad
from minidp.engine.tensor_ops import TensorOps, unbroadcast

__all__ = ["LazyGradient", "Tensor", "is_grad_enabled", "no_grad", "op", "unbroadcast"]


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


class LazyGradient:
    """A gradient a backward returns uncomputed (the hook above): `shape` is the gradient's,
    `value()` computes it, and `into_leaf(leaf)` says what a leaf adds now (None: it stays
    pending on the leaf as `_pending`, a LazyGradient whose value() .grad adds in)."""

    __slots__ = ()
    shape: tuple

    def value(self) -> np.ndarray:
        raise NotImplementedError

    def into_leaf(self, leaf: "Tensor") -> np.ndarray | None:
        return self.value()


def _array(g):
    """A gradient as an array: a LazyGradient computed."""
    return g.value() if isinstance(g, LazyGradient) else g


class Tensor(TensorOps):
    """An array with a gradient. `Tensor(data, requires_grad=False, dtype=None)`; its arithmetic,
    reductions, shapes and math come from TensorOps (tensor_ops.py)."""

    __array_priority__ = 100  # `ndarray + Tensor` defers to Tensor.__radd__
    _op = staticmethod(op)  # how TensorOps (tensor_ops.py) makes its outputs

    # Defaults, on the class so that op() sets only what differs (it runs once per op):
    requires_grad = False
    _grad: np.ndarray | None = None
    _pending: LazyGradient | None = None  # a leaf's gradient not yet added in (LazyGradient)
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
        return backend_torch().host_view(self.data.cpu()) if is_torch(self.data) else self.data

    def detach(self) -> "Tensor":
        return Tensor(self.data)

    @property
    def grad(self) -> np.ndarray | None:
        """The accumulated gradient (a leaf's). A pending LazyGradient is added in here, on
        first read, so every reader sees the whole gradient. (So a read may write: like
        backward itself, it belongs to one thread at a time.)"""
        if self._pending is not None:
            self._settle()
        return self._grad

    @grad.setter
    def grad(self, value) -> None:
        self._pending = None  # replaced: a pending gradient goes with the old one
        self._grad = value

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
            if type(g) is not np.ndarray and is_torch(g) and g.dtype != node.data.dtype:
                g = g.to(node.data.dtype)  # torch: a gradient in its tensor's dtype (casts.py)
            for parent, pg in zip(node._parents, node._backward(g)):
                if pg is not None and parent.requires_grad:
                    if isinstance(pg, LazyGradient) and parent._backward is not None:
                        pg = pg.value()  # only a leaf takes a gradient uncomputed
                    key = id(parent)
                    total = grads.get(key)
                    grads[key] = pg if total is None else _array(total) + _array(pg)
                    handed_out.add(id(pg))

    def _accumulate(self, g, owned: bool) -> None:
        """Add backward's gradient g (an array, or a LazyGradient) into this leaf's."""
        if g.shape != self.data.shape:  # += would broadcast a wrong gradient silently
            raise ValueError(f"gradient of shape {g.shape} for a tensor of shape {self.shape}")
        if isinstance(g, LazyGradient):
            g = g.into_leaf(self)
            if g is None:
                return  # pending on this leaf (or joined to what was)
            owned = True  # computed just now: nobody else holds it
        self._add(g, owned)

    def _settle(self) -> None:
        """Add the pending LazyGradient in."""
        pending, self._pending = self._pending, None
        self._add(pending.value(), owned=True)

    def _add(self, g: np.ndarray, owned: bool) -> None:
        if self._grad is not None:
            self._grad += g  # in place: data parallelism's gradients are views into buckets
        elif owned and g.dtype == self.dtype:
            self._grad = g
        else:
            self._grad = namespace(g).array(g, dtype=self.dtype)  # a private copy
