"""ZeRO stage 3: each layer's weights gathered just before use, and released after it.

Rank r holds only its chunk of every layer (a *unit*: a direct child of the model that owns
parameters, one segment of the flat vector, flat.py). Around each unit's forward:

    forward of unit u:   allgather(u's chunks) ─► slot[u % 2]; p.data = views of the slot
                         out = the unit's own forward
                         p.data = a stand-in (shape kept, one element of memory); the slot
                         is free for unit u + 2
                         out = pre_backward(out): an identity op whose backward gathers u
    backward of unit u:  pre_backward runs before any op of u (they all produce its input):
                         allgather(u's chunks) ─► slot[u % 2] again; p.data = the views
                         u's ops run, reading the slot; when u's last gradient is ready,
                         the unit is reduce-scattered (grads.py) and released

Why two slots, reused, and not a fresh array per gather. The backward closures of u's ops
keep references to the arrays the forward read (`linear` keeps W itself). A fresh array per
gather would stay alive through those closures until backward, and the rank would end up
holding every layer: Ψ again. Writing each gather into the same preallocated slot makes
those references harmless: between u's forward and its backward the slot holds other
layers, and just before u's backward it holds u again, at the same addresses, so every
closure reads the right values. Backward runs the units in reverse, one at a time (all of
u's ops come after every op of u + 1, since u + 1 consumes u's output), so unit u + 2 is done
with slot[u % 2] when u gathers into it. Held at any time: 2 slots of the largest unit.
(PyTorch FSDP gets the same effect by resizing a gathered tensor's storage to zero.)

Parameters outside the children, or shared by two of them (a tied weight), form a unit of
the model itself (minidp.engine.units.units_of), first in forward order: its gather wraps the
model's forward, so it is held through the whole forward (and, gathered again by the
output's pre_backward, through the whole backward), in a third slot of its own; it is
reduce-scattered last.

`gathered_peak` is measured: the largest number of bytes held at once, during any step, by
the distinct live arrays a gather wrote into (followed by weak references), not the formula.
"""

import time
import weakref

import numpy as np

from minidp import comm
from minidp.engine.nn import Module
from minidp.engine.tensor import op
from minidp.parallel.across_ranks import stand_in
from minidp.parallel.zero.flat import ShardLayout, gather_whole


class GatheredUnits:
    """Gather-before-use for every unit of `layout` (whose segments are the units' params).

    `shard`: this rank's parameter chunks (layout.shard_numel elements); the unit modules'
    forwards are wrapped until `unwrap()` or `materialize()`. `outer`: modules[0] is the
    model around the others (units_of's unit of the model itself); it is gathered for the
    whole forward, so into a slot of its own, and the others take turns in two."""

    def __init__(
        self,
        modules: list[Module],
        layout: ShardLayout,
        shard,
        group: comm.Group,
        algo: str,
        outer: bool = False,
    ):
        self.modules, self.layout, self.shard = modules, layout, shard
        self.group, self.algo = group, algo
        largest = max(layout.lengths[outer:], default=0)
        self.slots = [np.empty(largest, shard.dtype) for _ in range(2)]
        if outer:
            self.slots.append(np.empty(layout.lengths[0], shard.dtype))
        self.slot_of = [2] * outer + [u % 2 for u in range(len(modules) - outer)]
        self.gathers = 0  # allgathers run, forward and backward
        self.seconds = 0.0  # time in them, in total
        self._live: dict[int, int] = {}  # id(buffer) -> bytes, for buffers still alive
        self.live_bytes = self.gathered_peak = 0
        for u, module in enumerate(modules):
            module.forward = self._wrap(u, module.forward)  # shadows the class's forward
        for u in range(len(modules)):
            self.release(u)

    # ---- gather and release ------------------------------------------------------------
    def gather(self, u: int) -> None:
        """All of unit u's weights into its slot; the unit's parameters point into it."""
        buffer = self.slots[self.slot_of[u]][: self.layout.lengths[u]]
        mine = self.layout.my_chunk(self.shard, u)
        start = time.perf_counter()
        comm.allgather(mine, algo=self.algo, group=self.group, out=buffer)
        self.seconds += time.perf_counter() - start
        self.gathers += 1
        for p, view in zip(self.layout.segments[u], self.layout.segment_views(buffer, u)):
            p.data = view
        self._follow(buffer if buffer.base is None else buffer.base)

    def release(self, u: int) -> None:
        for p in self.layout.segments[u]:
            p.data = stand_in(p)

    def _follow(self, base: np.ndarray) -> None:
        """Count `base` among the live gathered buffers until it is garbage."""
        if id(base) not in self._live:
            self._live[id(base)] = base.nbytes
            self.live_bytes += base.nbytes
            weakref.finalize(base, self._forget, id(base))
        self.gathered_peak = max(self.gathered_peak, self.live_bytes)

    def _forget(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    def _wrap(self, u: int, forward):
        def gathered_forward(*args, **kwargs):
            self.gather(u)
            try:
                out = forward(*args, **kwargs)
            finally:
                self.release(u)
            # identity forward; its backward gathers u before any of u's own ops runs
            return op(out.data, (out,), lambda g: (self._before_backward(u, g),))

        return gathered_forward

    def _before_backward(self, u: int, g: np.ndarray) -> np.ndarray:
        self.gather(u)
        return g

    # ---- the end ----------------------------------------------------------------------
    def unwrap(self) -> None:
        for module in self.modules:
            vars(module).pop("forward", None)

    def materialize(self) -> None:
        """Collective: every unit gathered into arrays of its own, the forwards unwrapped:
        the model is whole on every rank (for validation and sampling after training)."""
        self.unwrap()
        chunks = [self.layout.my_chunk(self.shard, u) for u in range(len(self.modules))]
        whole = gather_whole(self.layout, chunks, self.group, self.algo)
        for p in (p for segment in self.layout.segments for p in segment):
            p.data = whole[id(p)]
