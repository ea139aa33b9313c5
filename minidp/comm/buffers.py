"""Scratch buffers that a Group owns and reuses from one collective call to the next.

A fresh `np.empty(n)` per call costs a page fault for every 4 KiB page the first time it is
written, which at 16 MiB is thousands of faults and a visible share of the time (MPICH's own
allreduce pays this; `bench collectives` counts faults per call). So each algorithm asks its
group for named slots:

    recv = group.scratch.get("recv", count, dtype)   # a view of a byte buffer kept per slot

The byte buffer behind a slot only ever grows; a call of a size seen before allocates nothing.
Slots belong to one Group, never to the module, so two threads that each run collectives on
their own group (`group.dup()`) never share a buffer.
"""

import numpy as np


class Scratch:
    """Named, grow-only work buffers: `get(slot, count, dtype)` returns a 1-D view."""

    def __init__(self) -> None:
        self._slots: dict[str, np.ndarray] = {}
        self._views: dict[tuple, np.ndarray] = {}  # (slot, count, dtype) -> view, a shortcut

    def get(self, slot: str, count: int, dtype: np.dtype) -> np.ndarray:
        key = (slot, count, dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        nbytes = count * np.dtype(dtype).itemsize
        raw = self._slots.get(slot)
        if raw is None or raw.nbytes < nbytes:
            raw = np.empty(max(nbytes, 64), dtype=np.uint8)  # NumPy aligns it for any dtype
            self._slots[slot] = raw
            self._views = {k: v for k, v in self._views.items() if k[0] != slot}
        if len(self._views) > 256:  # many sizes: start over rather than grow without end
            self._views.clear()
        view = self._views[key] = raw[:nbytes].view(dtype)
        return view

    @property
    def nbytes(self) -> int:
        """Bytes held by all slots together."""
        return sum(raw.nbytes for raw in self._slots.values())

    def clear(self) -> None:
        """Drop every slot (the memory returns to the allocator)."""
        self._slots.clear()
        self._views.clear()
