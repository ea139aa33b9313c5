"""ZeRO's gradient shards (stages 2 and 3): reduce-scatter each segment as its gradients are
ready, keep this rank's chunk, drop the rest.

    backward ─ grads of segment 0 ready ─► pack into one staging vector, p.grad = None
                                            └─► reduce_scatter(staging) ─► my chunk of the
                                                 gradient shard (sum over ranks, weighted)
             ─ grads of segment 1 ready ─► ...

Segments are launched in a fixed order (the order backward finishes them, as DDP launches
its buckets in index order), each once every segment before it has gone, so every rank runs
the same collectives in the same order. A rank's loss is the mean over its n_r examples, so
each staging vector is scaled by n_r / B before the sum (Reducer, in
data_parallel/comm_thread.py, as DDP).

What is held: the gradient shard (Ψ/N elements) for the whole step, and the full gradients
of a segment only between its last gradient and its launch (a staging copy then until its
reduce-scatter ends). With a communication thread (stage 2, overlap on) the reduce-scatters
run beside the rest of backward, exactly as DDP's allreduces do (data_parallel/comm_thread.py).
"""

import contextlib
import time

import numpy as np

from minidp import comm
from minidp.comm.trace import Timeline
from minidp.fast.weight_grads import defer_weight_grads
from minidp.parallel.data_parallel.comm_thread import CommThread, Reducer
from minidp.parallel.data_parallel.gil import quick_gil_handover
from minidp.parallel.zero.flat import ShardLayout


class Staged:
    """One segment's gradients packed for its reduce-scatter, and where its chunk goes."""

    def __init__(self, index: int, data: np.ndarray, out: np.ndarray, add: bool = False):
        self.index, self.data, self.out, self.add = index, data, out, add


def reduce_scatter_hook(algo: str):
    """Sum the staging vector over the group; this rank's chunk lands in `out` (or, with
    `staged.add`, is added to it); then the staging vector is dropped (its memory is free as
    soon as the collective ends)."""

    def reduce_scatter_bucket(staged: Staged, group: comm.Group) -> None:
        out = staged.out
        if staged.add:  # a later micro-batch: its sum goes through scratch, then adds
            out = group.scratch.get("zero.accumulate", out.size, out.dtype)
        comm.reduce_scatter(staged.data, op="sum", algo=algo, group=group, out=out)
        if staged.add:
            staged.out += out
        staged.data = None

    reduce_scatter_bucket.algo, reduce_scatter_bucket.label = algo, "reduce_scatter"
    return reduce_scatter_bucket


class ShardedGradients:
    """Grad-ready hooks that reduce-scatter each segment of `layout` into `shard`.

    `launch_order`: segment indices in the order backward completes them. `overlap`: reduce
    on a communication thread (its own dup of `group`) or inline. `launched(s)`, if given,
    is called once segment s has gone (stage 3 releases the layer's weights there).
    `reduce_each`: what no_sync() means, see there."""

    def __init__(
        self,
        layout: ShardLayout,
        launch_order: list[int],
        shard: np.ndarray,
        group: comm.Group,
        algo: str,
        overlap: bool,
        timeline: Timeline,
        launched=None,
        reduce_each: bool = False,
    ):
        self.launched, self.reduce_each, self.adding = launched, reduce_each, False
        self.layout, self.order, self.shard = layout, launch_order, shard
        self.group = group
        self.reducer = Reducer(reduce_scatter_hook(algo), group, timeline)
        # as DDP's thread, with its short GIL switch interval (data_parallel/gil.py)
        self._thread = CommThread(self.reducer, quick_gil_handover) if overlap else None
        self._segment_of = {id(p): s for s, seg in enumerate(layout.segments) for p in seg}
        params = [p for seg in layout.segments for p in seg]  # flat order
        self._index_of = {id(p): k for k, p in enumerate(params)}
        self._name_of = dict(zip(self._index_of, layout.order))
        # reached[k]: 1 once some backward gave params[k] a gradient (read when its segment
        # was launched); kept across steps until the user of this class resets it
        self.reached = np.zeros(len(params), dtype=np.int32)
        self._unhook = [
            p.register_grad_ready_hook(self._grad_ready) for seg in layout.segments for p in seg
        ]
        self.share = 1.0 / group.size
        self.sync_enabled = True  # False inside no_sync(): gradients stay on the parameters
        self.exposed_seconds = 0.0  # the main thread's time in reductions or waiting for them
        self.rearm()

    def rearm(self) -> None:
        """Count every segment's gradients from zero again, for the next backward."""
        self.pending = [len(seg) for seg in self.layout.segments]
        self._ready: set[int] = set()  # parameters whose gradient this backward finished
        self._next = 0  # position in launch_order of the next segment to go

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation, for all micro-batches but the last. Stage 2: the backwards
        inside leave their gradients summed on the parameters, whole, and the next backward
        outside launches the sums (one reduce-scatter per segment, as DDP). Stage 3
        (`reduce_each`): holding every layer's whole gradients is what it exists to avoid,
        so each micro-batch is reduce-scattered as it goes and the later ones add their
        chunks to the shard (K reduce-scatters per segment, as DeepSpeed's stage 3)."""
        if self.reduce_each:
            yield
            self.finish()
            self.adding = True  # finish() cleared it; the next micro-batches add
            return
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            with defer_weight_grads():  # as DDP's no_sync: one product per weight at the end
                yield
        finally:
            self.sync_enabled = previous
            self.rearm()

    def _grad_ready(self, p) -> None:
        if not self.sync_enabled:
            return
        if id(p) in self._ready:  # its segment may have gone: this gradient would be lost
            raise RuntimeError(
                f"a second backward reached {self._name_of[id(p)]} before its gradients were "
                "reduce-scattered (finish_gradient_sync); accumulate inside no_sync()"
            )
        self._ready.add(id(p))
        self.pending[self._segment_of[id(p)]] -= 1
        while self._next < len(self.order) and self.pending[self.order[self._next]] == 0:
            self._launch(self.order[self._next])

    def _launch(self, s: int) -> None:
        params = self.layout.segments[s]
        staging = np.concatenate(
            [np.zeros(p.size, p.dtype) if p.grad is None else p.grad.ravel() for p in params]
        )
        for p in params:
            if p.grad is not None:
                self.reached[self._index_of[id(p)]] = 1
            p.grad = None  # the full gradient is in the staging vector only, until reduced
        staged = Staged(s, staging, self.layout.my_chunk(self.shard, s), self.adding)
        self._next += 1
        if self._thread is not None:
            self._thread.submit(staged, self.share)
        else:
            start = time.perf_counter()
            self.reducer(staged, self.share)
            self.exposed_seconds += time.perf_counter() - start
        if self.launched is not None:
            self.launched(s)

    # ---- the synchronizer the step skeleton drives (parallel/step.py), as DDP's ------------
    def zero_grad(self) -> None:
        """Nothing to zero: each launch leaves its parameters' .grad None."""

    def set_batch_share(self, local_examples: int, global_examples: int) -> None:
        """This rank averages over local_examples of global_examples: weight n_r / B."""
        self.share = local_examples / global_examples

    def finish_gradient_sync(self) -> None:
        self.finish()

    def finish(self) -> None:
        """After backward: launch what is left (a parameter with no gradient), wait for all."""
        while self._next < len(self.order):
            self._launch(self.order[self._next])
        if self._thread is not None:
            start = time.perf_counter()
            self._thread.wait()
            self.exposed_seconds += time.perf_counter() - start
        self.rearm()
        self.adding = False

    def close(self) -> bool:
        """Stop the thread, unhook the parameters; True if the thread is still stuck (after
        an error elsewhere), so its group must not be freed under it."""
        stuck = self._thread is not None and self._thread.stop()
        self._thread = None
        for unhook in self._unhook:
            unhook()
        self._unhook = []
        return stuck
