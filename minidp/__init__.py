"""minidp: distributed training from scratch, in NumPy and mpi4py, small enough to read.

    import minidp
    x = minidp.Tensor([[1.0, 2.0]], requires_grad=True)
    (x * x).sum().backward()          # x.grad == 2 x

Modules: autograd (Tensor, backward), ops (nonlinearities, losses), nn (layers up to GPT),
optim, data, comm (hand-written collectives), parallel (the training strategies), train.
"""

from minidp import nn, ops, optim
from minidp.autograd import Tensor, is_grad_enabled, no_grad
from minidp.ops import (
    concatenate,
    cross_entropy,
    dropout,
    mse,
    split,
    stack,
    where,
)

__version__ = "0.1.0"

__all__ = [
    "Tensor",
    "no_grad",
    "is_grad_enabled",
    "nn",
    "ops",
    "optim",
    "concatenate",
    "stack",
    "split",
    "where",
    "dropout",
    "cross_entropy",
    "mse",
    "__version__",
]
