"""Deferred weight gradients: a speed trick for gradient accumulation, beside the engine.

Gradient accumulation adds one x_k^T g_k per micro-batch into each weight's .grad: a matrix
product that writes the whole gradient, then an addition that reads and writes it again,
per micro-batch. Inside `defer_weight_grads()` (DDP's no_sync enters it) a leaf keeps copies
of the rows x_k and g_k instead, and one product over the stacked rows is the gradient of
the whole slice:

    sum_k x_k^T g_k = [x_1; ...; x_K]^T [g_1; ...; g_K]

Copies, because a loader may refill the input buffer before the product is taken; at most
as many rows as fit in the gradient's own bytes, so deferring never costs more memory than
one more gradient (past that the rows so far are multiplied at once). Megatron-LM saves the
same addition inside its weight-gradient GEMM (--gradient-accumulation-fusion); NumPy's
matmul cannot add into its output, so stacking the rows is how it is saved here.

How it plugs in: `nn.linear`'s backward returns its weight's gradient through
`weight_gradient(x, g)` (the table's entry, engine/registry.py): a `Product` (a
LazyGradient, the engine's one hook, engine/tensor.py), which the engine
multiplies out for any tensor but a leaf. At a leaf, `Product.into_leaf` keeps its rows as
the leaf's pending `Rows` inside defer_weight_grads(), and outside it takes one product over
every row kept and its own; a read of .grad takes it too (the engine settles what is
pending). `deferral(False)` turns the trick off: weight_gradient then returns x^T g
multiplied, and no Product exists anywhere (the plain path: tests/test_deferred_grads.py
compares the two).

Bits: one micro-batch (K = 1) gives the plain path's bits exactly (the same x^T g). For K > 1
the stacked product sums the rows in BLAS's order, not micro-batch by micro-batch: a
reassociated sum, equal to the plain path's to rounding, not bit for bit (measured: within
1e-15 of the gradient's largest entry in float64, 5e-7 in float32); a gradient that was not
deferred (a bias, a weight whose micro-batch has too many rows) keeps the plain path's bits.
"""

import contextlib
import threading
from collections.abc import Iterator

import numpy as np

from minidp.engine.tensor import LazyGradient, Tensor

__all__ = [
    "Product",
    "Rows",
    "defer_weight_grads",
    "deferral",
    "deferrable",
    "keep_grad_in",
    "row_capacity",
    "weight_gradient",
]


class _Switch:
    on = True  # the trick, process-wide (`deferral`); off: the plain path


class _Deferring(threading.local):
    active = False  # inside defer_weight_grads(), in this thread


_switch, _deferring = _Switch(), _Deferring()


@contextlib.contextmanager
def deferral(on: bool) -> Iterator[None]:
    """Turn the trick on or off, process-wide, inside this block (the previous setting comes
    back on exit). Off, nn.linear's backward returns x^T g multiplied: the plain path."""
    previous, _switch.on = _switch.on, on
    try:
        yield
    finally:
        _switch.on = previous


@contextlib.contextmanager
def defer_weight_grads() -> Iterator[None]:
    """Backward passes of this thread in this block leave weight gradients unmultiplied:
    more will follow. A leaf keeps copies of its Products' rows, while they take no more
    memory than its gradient, and takes one product over all of them in the next backward
    outside the block or at the first read of .grad. DDP's no_sync() enters it."""
    previous, _deferring.active = _deferring.active, True
    try:
        yield
    finally:
        _deferring.active = previous


def weight_gradient(x, g):
    """x^T g, a weight's gradient (nn.linear's backward): a Product while the trick is on."""
    return Product(x, g) if _switch.on else x.T @ g


class Product(LazyGradient):
    """A weight's gradient x^T g, kept as its two factors: x (rows, in), g (rows, out)."""

    __slots__ = ("x", "g")

    def __init__(self, x, g):
        self.x, self.g = x, g

    @property
    def shape(self) -> tuple:
        return (self.x.shape[1], self.g.shape[1])

    def value(self):
        return self.x.T @ self.g

    def into_leaf(self, leaf: Tensor):
        """Inside defer_weight_grads(): copy the rows into the leaf's pending Rows (None:
        nothing to add now), multiplying those kept first if they are full. Outside: the
        product over every row kept and these (the last micro-batch's)."""
        rows = leaf._pending
        if not _deferring.active:  # the last pass: one product over every row
            if rows is None:
                return self.value()
            leaf._pending = None
            return rows.value(self)
        if rows is not None and not rows.fits(self):
            leaf._settle()  # full: their product goes in first
            rows = None
        if rows is None and deferrable(self, leaf.data.nbytes):
            rows = leaf._pending = Rows(self, leaf.data.nbytes)
        if rows is None:
            return self.value()  # too many rows to keep: multiplied at once
        rows.add(self)
        return None


class Rows(LazyGradient):
    """A leaf's deferred gradient: the rows of its Products, copied and stacked, at most as
    many as make the copies no larger than the gradient itself (for one dtype throughout:
    in * out / (in + out) rows), so the deferral never costs more memory than one more
    gradient."""

    def __init__(self, first: Product, grad_bytes: int):
        self.capacity = row_capacity(first, grad_bytes)
        self.x = np.empty((self.capacity, first.x.shape[1]), first.x.dtype)
        self.g = np.empty((self.capacity, first.g.shape[1]), first.g.dtype)
        self.rows = 0

    @property
    def shape(self) -> tuple:
        return (self.x.shape[1], self.g.shape[1])

    def fits(self, p: Product) -> bool:
        return (
            self.rows + len(p.x) <= self.capacity
            and p.x.dtype == self.x.dtype
            and p.g.dtype == self.g.dtype
        )

    def add(self, p: Product) -> None:
        """Copy p's rows in: the caller's arrays may change before the product is taken."""
        lo, self.rows = self.rows, self.rows + len(p.x)
        self.x[lo : self.rows] = p.x
        self.g[lo : self.rows] = p.g

    def value(self, last: Product | None = None) -> np.ndarray:
        """The product over every row kept, and `last`'s rows after them."""
        x, g = self.x[: self.rows], self.g[: self.rows]
        if last is not None and self.fits(last):
            self.add(last)
            x, g = self.x[: self.rows], self.g[: self.rows]
        elif last is not None:
            x, g = np.concatenate((x, last.x)), np.concatenate((g, last.g))
        return x.T @ g


def row_capacity(p: Product, grad_bytes: int) -> int:
    """How many rows of p's shape and dtypes fit in grad_bytes."""
    return grad_bytes // (p.x.shape[1] * p.x.itemsize + p.g.shape[1] * p.g.itemsize)


def deferrable(p: Product, grad_bytes: int) -> bool:
    """NumPy factors whose copies are no larger than the gradient they stand for."""
    return (
        isinstance(p.x, np.ndarray)
        and isinstance(p.g, np.ndarray)
        and len(p.x) <= row_capacity(p, grad_bytes)
    )


def keep_grad_in(leaf: Tensor, home) -> None:
    """Make `home` (an array of the leaf's shape and dtype) hold its gradient from now on: a
    .grad it has is copied in, none at all (and none pending) is zeros, and later backward
    passes add into home. A leaf whose gradient is only pending is left as it is: home is
    not zeroed for it, and its value, once taken, is the leaf's own array (DDP's hook then
    weighs it into the slot). DDP's no_sync calls it at each block's end: the first
    micro-batch's gradients move into their bucket slots, the later ones add up there."""
    if leaf._grad is home:
        return
    if leaf._grad is not None:
        home[...] = leaf._grad
    elif leaf._pending is not None:
        return  # nothing computed yet: the value goes in whole, later
    else:
        home[...] = 0
    leaf._grad = home
