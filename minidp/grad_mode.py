"""Grad mode, per thread: whether ops record a graph, and whether backward defers weight
gradients (autograd.py re-exports these).

`no_grad()` stops recording in the thread that enters it only, and every new thread starts
with grad enabled (DDP's communication thread never sees another's). `defer_weight_grads()`
is per thread the same way.
"""

import contextlib
import threading
from collections.abc import Iterator


class _GradMode(threading.local):
    """Whether ops record a graph, one flag per thread."""

    enabled = True  # a class attribute: what every thread sees until it sets its own
    defer = False  # inside defer_weight_grads()


_grad_mode = _GradMode()


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Inside this block ops of this thread record no graph (evaluation, optimizer updates).

    Other threads keep their own setting; the previous one comes back on exit, even on error."""
    previous, _grad_mode.enabled = _grad_mode.enabled, False
    try:
        yield
    finally:
        _grad_mode.enabled = previous


def is_grad_enabled() -> bool:
    """Whether ops in this thread record a graph (False inside `no_grad()`)."""
    return _grad_mode.enabled


@contextlib.contextmanager
def defer_weight_grads() -> Iterator[None]:
    """Backward passes in this block leave weight gradients unmultiplied: more will follow.

    Gradient accumulation adds one x_k^T g_k per micro-batch into each weight's .grad: a
    matrix product that writes the whole gradient, then an addition that reads and writes it
    again, per micro-batch. Inside this block a leaf keeps copies of the rows x_k and g_k
    instead (while they take no more memory than its gradient), and the first read of .grad
    multiplies them all at once: sum_k x_k^T g_k = [x_1; ...; x_K]^T [g_1; ...; g_K], one
    product over the stacked rows, which is the gradient of the whole batch. DDP's no_sync()
    enters this block (Megatron-LM fuses the same addition into its weight-gradient GEMM:
    --gradient-accumulation-fusion). See autograd.Product."""
    previous, _grad_mode.defer = _grad_mode.defer, True
    try:
        yield
    finally:
        _grad_mode.defer = previous
