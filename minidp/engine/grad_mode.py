"""Grad mode, per thread: whether ops record a graph (tensor.py re-exports these).

`no_grad()` stops recording in the thread that enters it only, and every new thread starts
with grad enabled (DDP's communication thread never sees another's).
"""

import contextlib
import threading
from collections.abc import Iterator


class _GradMode(threading.local):
    """Whether ops record a graph, one flag per thread."""

    enabled = True  # a class attribute: what every thread sees until it sets its own


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
