"""Data parallelism with buckets and overlap (PyTorch DDP, Horovod). Read plain.py
first: the plain version (one allreduce per parameter after backward); this one adds
buckets, then overlap, and plugs its speed tricks in from modules beside it.

    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25, algo="ring", overlap=True)
    ddp.zero_grad()
    loss = cross_entropy(ddp(x), y)      # forward is the model's own
    loss.backward()                      # buckets' allreduces start while backward runs
    ddp.finish_gradient_sync()           # wait for the last bucket; grads are now averaged
    opt.step()

Buckets (buckets.py). Gradients live in a few flat buckets, filled in *reverse* parameter
order (the order backward produces them); once weighed, each `p.grad` is a view into its
bucket, so a bucket is reduced in place, one message per bucket:

    params   W0 b0 W1 b1 W2 b2            (forward order)
    buckets  [b2 W2 b1] [W1 b0] [W0]      (reverse order, each up to bucket_cap_mb)

Hooks. Each parameter's grad-ready hook (engine/tensor.py) weighs its gradient by n_r / B into
its bucket slot the moment it is final, and counts the bucket down. A bucket is reduced by
the communication hook `hook(bucket, group)`, by default an allreduce(sum) with `algo`;
`register_comm_hook` swaps in another (compression).

Overlap. Without it every bucket is reduced in `finish_gradient_sync`, all communication
exposed. With it, the hook that completes a bucket hands it to a communication thread
(comm_thread.py) that reduces it on its own duplicated group while backward goes on. The
thread needs a spare core, else it takes backward's (docs/data_parallel.md), so
`overlap="auto"` turns it on only where every rank has one (`overlap_helps`). Buckets go in
index order, each once those before it have gone (PyTorch's reducer): every rank runs the
same collectives in the same order.

Speed tricks, each a module of its own, on or off in `TRICKS` (or the `tricks` argument);
each gives the plain path's bits (test_ddp_tricks.py), `bench dp --case tricks` measures it:
    shared_memory   shm_arena.py    buckets carved from one shared-memory arena
    coalesce        coalesce.py     buckets that go together reduced in one collective
    quick_gil       gil.py          a short GIL switch interval while the thread runs
    host_stage      host_stage.py   CUDA tensors through kept, pinned host buffers

As PyTorch's DDP: a shared (tied) parameter has one slot, a frozen one none; one unused on
some ranks gets their zeros, on every rank .grad None (unused_params.py). Uneven batches:
the global mean is sum_r (n_r / B) * mean_r, so each rank weighs by n_r / B
(`set_batch_share`). `no_sync()` skips communication (gradient accumulation); `join()`,
ranks with uneven batches (join.py).
"""

import contextlib
import time
import weakref

from minidp import comm
from minidp.comm.trace import Timeline
from minidp.engine.nn import Module
from minidp.fast.weight_grads import defer_weight_grads, keep_grad_in
from minidp.parallel.data_parallel import comm_thread as thread
from minidp.parallel.data_parallel import shm_arena
from minidp.parallel.data_parallel.buckets import Bucket, assign_buckets
from minidp.parallel.data_parallel.coalesce import reduce_together
from minidp.parallel.data_parallel.comm_thread import overlap_helps
from minidp.parallel.data_parallel.gil import quick_gil_handover
from minidp.parallel.data_parallel.host_stage import HostStage, PlainStage
from minidp.parallel.data_parallel.join import join
from minidp.parallel.data_parallel.unused_params import ReachedFlags
from minidp.parallel.same_model import check_same_model

TRICKS = {  # each speed trick, on by default where `bench dp --case tricks` says it pays
    "shared_memory": True,  # shm_arena.py
    "coalesce": True,  # coalesce.py
    "quick_gil": True,  # gil.py
    "host_stage": "cuda",  # host_stage.py: on for CUDA tensors; on the CPU it only adds copies
}


def _weak_hook(method):
    """A grad-ready hook that does not keep its DDP alive (the model outlives the wrapper)."""
    ref = weakref.WeakMethod(method)

    def hook(p):
        bound = ref()
        if bound is not None:
            bound(p)

    return hook


class DistributedDataParallel:
    """Wrap `model` for data-parallel training over `group` (default: the world).

    `overlap`: "auto" (on when every rank has a spare core, see `overlap_helps`), True or
    False; `ddp.overlap` says what was chosen and `ddp.overlap_reason` why. Use it as a
    context manager, or call `close()`, to stop its communication thread. Freeze parameters
    (requires_grad = False) before wrapping: DDP reads which are trainable once, here.
    `tricks`: {name: on?} over TRICKS, for this DDP (`ddp.tricks` says what ran)."""

    def __init__(
        self,
        model: Module,
        group: comm.Group | None = None,
        bucket_cap_mb: float = 0.25,
        algo: str = "auto",
        overlap: bool | str = "auto",
        timeline: Timeline | None = None,
        tricks: dict[str, bool | str] | None = None,
    ):
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if overlap not in (True, False, "auto"):
            raise ValueError(f"overlap must be True, False or 'auto', got {overlap!r}")
        unknown = sorted(set(tricks or {}) - set(TRICKS))
        if unknown:
            raise ValueError(f"unknown tricks {unknown}; choose from {', '.join(TRICKS)}")
        self.tricks = {**TRICKS, **(tricks or {})}
        self.model, self.group, self.algo = model, group or comm.world(), algo
        if algo != "auto" and algo not in comm.ALLREDUCE:  # a local check, before any message
            raise ValueError(
                f"unknown allreduce algo {algo!r}; choose from auto, {', '.join(comm.ALLREDUCE)}"
            )
        if overlap == "auto":
            self.overlap, self.overlap_reason = overlap_helps(self.group.size)
        else:
            self.overlap, self.overlap_reason = overlap, "forced"
        check_same_model(model, self.group)  # frozen ones too: what follows is alike everywhere
        # the trainable ones, in the order backward produces their gradients
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        if not params:
            raise ValueError("DistributedDataParallel: model has no parameter that requires grad")
        # torch tensors go through host buffers (host_stage.py), or the plain way
        staged = self.tricks["host_stage"]
        if staged == "cuda":  # pinned buffers pay on a GPU; on the CPU the plain way is a view
            staged = any(getattr(p.data, "is_cuda", False) for p in model.parameters())
        self.tricks["host_stage"] = staged
        self.stage = (HostStage if staged else PlainStage)(timeline)
        for i, p in enumerate(model.parameters()):  # every rank starts from rank 0's weights
            self.stage.in_place(
                lambda a: comm.broadcast(a, root=0, group=self.group), p.data, f"param {i}"
            )

        self.comm_group = self.group.dup()  # communication's own communicator
        # with overlap it waits by napping, not spinning: the compute thread keeps the core
        self.comm_group.patient = self.overlap

        self._names = {id(p): name for name, p in model.named_parameters()}  # for errors
        cap = max(1, int(bucket_cap_mb * 2**20))
        self.arena = None  # the buckets' memory: plain arrays, or carved from shared memory
        if self.tricks["shared_memory"]:
            self.arena = shm_arena.shared_arena(params, algo, self.comm_group)
        zeros = None if self.arena is None else shm_arena.carve(self.arena)
        self.buckets = assign_buckets(params, cap, zeros)
        self._reached = ReachedFlags(params)  # for .grad None where no rank reached one
        slots = [(b, i) for b in self.buckets for i in range(len(b.params))]  # params' order
        self._slot_of = {id(p): (b, i, k) for k, (p, (b, i)) in enumerate(zip(params, slots))}
        # a grad-ready hook on every parameter: weigh, count down, launch (with overlap)
        hook = _weak_hook(self._grad_ready)
        self._unhook = [p.register_grad_ready_hook(hook) for p in params]

        self.share = 1.0 / self.group.size  # n_r / B: this rank's weight in the global mean
        self.sync_enabled = True
        self.reducer = thread.Reducer(
            thread.allreduce_hook(algo), self.comm_group, timeline or Timeline(False), self.stage
        )
        self.exposed_seconds = 0.0  # time the main thread waited for communication, in total
        self._next = 0  # index of the next bucket to launch
        self._join = None  # inside join(): join.Joining
        around = quick_gil_handover if self.tricks["quick_gil"] else contextlib.nullcontext
        self._thread = thread.CommThread(self.reducer, around) if self.overlap else None
        # a DDP dropped without close() must not leave its thread (and GIL setting) behind
        self._stop_thread = weakref.finalize(self, _stop, self._thread)
        for bucket in self.buckets:  # every .grad starts as its (zero) slot in a bucket
            bucket.attach()
        self._rearm()

    def __call__(self, *args, **kwargs):
        if self._join is not None:  # inside join(): the syncing forward agrees first
            self._join.before_forward(args)
        return self.model(*args, **kwargs)

    def join(self):  # `with ddp.join():` around a loop of uneven batches (join.py)
        return join(self)

    def __enter__(self) -> "DistributedDataParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def parameters(self):
        return self.model.parameters()

    def register_comm_hook(self, hook) -> None:
        """Reduce each bucket with `hook(bucket, group)` instead of the allreduce: it must
        leave in bucket.data the sum over the group of every rank's (weighted) bucket."""
        self.reducer.hook = hook

    @property
    def comm_seconds(self) -> float:
        """Time spent reducing buckets, in total (read differences)."""
        return self.reducer.seconds

    def reset_timers(self) -> None:
        """Count communication and exposed time from zero again (after a warm-up, say)."""
        self.reducer.seconds = self.exposed_seconds = 0.0

    @property
    def buckets_launched(self) -> int:
        """How many buckets this backward has handed to communication so far."""
        return self._next

    # ---- the step's bookkeeping ----------------------------------------------------------
    def set_batch_share(self, local_examples: int, global_examples: int) -> None:
        """This rank averages over local_examples of global_examples: weight n_r / B."""
        self.share = local_examples / global_examples

    def zero_grad(self) -> None:
        """Set every .grad to None (PyTorch's set_to_none): the synchronized backward's hook
        then multiplies each new gradient into its slot in one pass (Bucket.weigh), where
        zeroed buckets would cost two (zero, then add)."""
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None
        self._reached.clear()  # what earlier backward passes reached is gone with it
        self._rearm()

    def _rearm(self) -> None:
        """Count every bucket's gradients from zero again, for the next backward."""
        for bucket in self.buckets:
            bucket.rearm()
        self._next = 0  # the next bucket to launch

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside the block reduces them.

        The block's end moves each gradient into its bucket slot (weight_grads.keep_grad_in),
        where later micro-batches add up in place; one no micro-batch reached gets its slot,
        zeroed (until the sync: None there if no rank's backward reached it either)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            with defer_weight_grads():  # more backward passes come before .grad is read
                yield
        finally:
            self.sync_enabled = previous
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    keep_grad_in(p, view)
            self._rearm()

    # ---- communication --------------------------------------------------------------------
    def _grad_ready(self, p) -> None:
        bucket, i, k = self._slot_of[id(p)]
        self._reached.mark(k)
        if not self.sync_enabled:  # under no_sync: gradients keep adding up, unweighed
            return
        if bucket.weighed[i]:  # weighed (maybe reduced already): this gradient comes too late
            raise RuntimeError(
                f"DistributedDataParallel: a second backward reached {self._names[id(p)]} "
                "before finish_gradient_sync(); call it after each backward, or accumulate "
                "micro-batches inside ddp.no_sync()"
            )
        bucket.pending -= 1
        bucket.weigh(i, self.share)  # n_r / B, now, while the gradient is in cache
        # in index order: a complete bucket waits for those before it (a parameter with no
        # gradient on some rank leaves its bucket to the finish, carrying zeros for it)
        while (
            self.overlap
            and self._next < len(self.buckets)
            and self.buckets[self._next].pending == 0
        ):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        self._collect(bucket)
        self._next += 1
        self._thread.submit(bucket, 1.0)

    def _collect(self, bucket: Bucket) -> None:
        """Weigh the slots no hook has weighed (a .grad set by hand counts as reached)."""
        for p in bucket.collect(self.share):
            self._reached.mark(self._slot_of[id(p)][2])

    def finish_gradient_sync(self) -> None:
        """After backward: launch any bucket not yet launched, wait for all of them; then a
        parameter no rank's backward reached gets .grad None. Each gradient was weighed into
        its bucket as backward finished it: change no .grad between backward and this call."""
        if not self.sync_enabled:
            return
        start = time.perf_counter()
        if self._thread is None:  # no overlap: every bucket goes now
            for bucket in self.buckets:
                self._collect(bucket)
            reduce_all = reduce_together if self.tricks["coalesce"] else thread.reduce_each
            reduce_all(self.reducer, self.buckets)
        else:  # the buckets the hooks have not launched yet, then wait for all
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
            self._thread.wait()
        self._reached.drop_unreached(self.group)
        self.exposed_seconds += time.perf_counter() - start
        self._rearm()

    def close(self) -> None:
        """Stop the communication thread, free its communicator, unhook the model.

        The model can be wrapped again afterwards; `comm_group.counters` stay readable."""
        stuck = self._stop_thread()  # runs once: later calls return None
        self._thread = None
        if not stuck and self.arena is not None:  # gradients move out, memory goes back
            shm_arena.release(self.arena, self.buckets, self.comm_group)
            self.arena = None
        if not stuck and not self.comm_group.broken:
            # MPI_Comm_free completes locally in MPICH and Open MPI: safe on an error path too.
            # A group a collective error broke, or a thread still inside one, keeps its own.
            self.comm_group.free()
        for unhook in self._unhook:
            unhook()
        self._unhook = []


def _stop(comm_thread) -> bool:
    """Stop the communication thread, if any; True if it is still stuck."""
    return comm_thread is not None and comm_thread.stop()
