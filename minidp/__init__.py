"""minidp: distributed training from scratch, in NumPy and mpi4py, small enough to read.

    import minidp
    x = minidp.Tensor([[1.0, 2.0]], requires_grad=True)
    (x * x).sum().backward()          # x.grad == 2 x

Modules, bottom up: chunks (how a vector is cut into one piece per rank), autograd (Tensor,
backward, op), tensor_ops (Tensor's arithmetic, reductions, shapes), ops (matmul,
nonlinearities, losses), weight_grads (deferred weight gradients, a speed trick), nn (layers),
gpt (the GPT, re-exported by nn), optim, data, log (print0: printing from rank 0), config;
then, on MPI: comm (hand-written collectives), trace (the Timeline of what each rank did),
parallel (the training strategies), train. Everything below
comm imports without MPI. Public: what these modules document, except names that start
with "_" (minidp.comm's docstring says which of its modules are public).

A new op (a communication op of a parallel scheme, say) is written with `minidp.op`, the
public `minidp.autograd.op`; autograd.py's docstring states its contract.
"""

from minidp import autograd, functional, nn, optim
from minidp.autograd import Tensor, is_grad_enabled, no_grad, op
from minidp.functional import (
    concatenate,
    cross_entropy,
    dropout,
    mse,
    split,
    stack,
    where,
)
from minidp.weight_grads import Product, defer_weight_grads

__version__ = "0.1.0"

__all__ = [
    "Tensor",
    "op",
    "no_grad",
    "is_grad_enabled",
    "defer_weight_grads",
    "Product",
    "autograd",
    "nn",
    "functional",
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
