"""Deferred weight gradients: a weight's gradient x^T g kept as its factors, and the rows
a leaf keeps of them during gradient accumulation (autograd.py's engine uses both).

Gradient accumulation adds one x_k^T g_k per micro-batch into each weight's .grad: a matrix
product that writes the whole gradient, then an addition that reads and writes it again,
per micro-batch. Inside `defer_weight_grads()` (grad_mode.py; DDP's no_sync enters it) a
leaf keeps copies of the rows x_k and g_k instead, and one product over the stacked rows is
the gradient of the whole slice:

    sum_k x_k^T g_k = [x_1; ...; x_K]^T [g_1; ...; g_K]

Copies, because a loader may refill the input buffer before the product is taken; at most
as many rows as fit in the gradient's own bytes, so deferring never costs more memory than
one more gradient (past that the rows so far are multiplied at once). Megatron-LM saves the
same addition inside its weight-gradient GEMM (--gradient-accumulation-fusion); NumPy's
matmul cannot add into its output, so stacking the rows is how it is saved here.
"""

import numpy as np

__all__ = ["Product", "Rows", "deferrable", "multiplied", "row_capacity"]


class Product:
    """A weight's gradient x^T g, kept as its two factors: x (rows, in), g (rows, out).

    `nn.linear`'s backward returns one for its weight. The engine multiplies it out at once
    (`.value()`) for any tensor but a leaf; a leaf inside `defer_weight_grads()` keeps copies
    of its rows instead, stacked under those of earlier backward passes (a leaf's `Rows`,
    multiplied out whenever it is full), and takes their product in the next backward
    outside the block, or when .grad is read."""

    __slots__ = ("x", "g")

    def __init__(self, x, g):
        self.x, self.g = x, g

    @property
    def shape(self) -> tuple:
        return (self.x.shape[1], self.g.shape[1])

    def value(self):
        return self.x.T @ self.g


def multiplied(g):
    """A gradient as an array: a Product multiplied out."""
    return g.value() if type(g) is Product else g


class Rows:
    """A leaf's deferred gradient: the rows of its Products, copied and stacked, at most as
    many as make the copies no larger than the gradient itself (for one dtype throughout:
    in * out / (in + out) rows), so the deferral never costs more memory than one more
    gradient."""

    def __init__(self, first: Product, grad_bytes: int):
        self.capacity = row_capacity(first, grad_bytes)
        self.x = np.empty((self.capacity, first.x.shape[1]), first.x.dtype)
        self.g = np.empty((self.capacity, first.g.shape[1]), first.g.dtype)
        self.rows = 0

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
