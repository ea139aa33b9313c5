"""Data parallelism: every rank holds the whole model, reads its slice of the global batch,
and the ranks average their gradients before each optimizer step (PyTorch DDP, Horovod).

    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25, algo="ring", overlap=True)
    ddp.zero_grad()
    loss = cross_entropy(ddp(x), y)      # forward is the model's own
    loss.backward()                      # buckets' allreduces start while backward runs
    ddp.finish_gradient_sync()           # wait for the last bucket; grads are now averaged
    opt.step()

Buckets. Gradients live in a few flat, contiguous buckets, filled in *reverse* parameter
order (the order backward produces them); each `p.grad` is a view into its bucket, so a
bucket is allreduced in place with no packing copy. One large message per bucket instead of
one per parameter pays the α (latency) term once per bucket.

    params   W0 b0 W1 b1 W2 b2            (forward order)
    buckets  [b2 W2 b1] [W1 b0] [W0]      (reverse order, each up to bucket_cap_mb)

Overlap. Without it (`overlap=False`), every bucket is reduced after backward, in
`finish_gradient_sync`: all communication is exposed. With it, each parameter's grad-ready
hook (autograd.py) counts down its bucket; the hook that completes a bucket hands it to a
**communication thread**, which runs the bucket's allreduce on its own duplicated group
while the main thread goes on with backward. We chose a thread
over non-blocking point-to-point advanced between backward ops because the collectives in
minidp.comm are ordinary blocking code a reader can follow; NumPy's BLAS and MPI's blocking
calls release the GIL, so the thread's messages really do proceed beside the matmuls of the
rest of backward (both threads still take turns holding the GIL for their Python code, so
while a thread runs we shorten Python's switch interval from 5 ms to 0.2 ms). On a machine
with no spare core, communication is CPU work too (copies, reductions): overlap then hides
waiting, not work. Buckets are launched in index order (the order backward normally
completes them), each once every bucket before it has gone, as PyTorch's reducer does: so
all ranks run the same collectives in the same order, even when a parameter gets no gradient
on some rank (its bucket then goes at `finish_gradient_sync`, carrying zeros for it).

Averaging, with uneven batches. A rank's loss is the mean over its n_r examples. The global
batch mean is sum_r (n_r / B) * mean_r, so before the allreduce(sum) each rank scales its
bucket by n_r / B (`set_batch_share`); with equal slices that is 1 / world, plain averaging.
`no_sync()` skips communication (gradient accumulation): gradients keep adding up in the
buckets and the next synchronized backward reduces the total.
"""

import contextlib
import queue
import sys
import threading
import time
import zlib

import numpy as np

from minidp import comm
from minidp.nn import Module
from minidp.trace import Timeline

SWITCH_INTERVAL_S = 2e-4  # how often the GIL changes hands while a comm thread runs
_threads = {"running": 0, "saved_interval": 0.0}  # comm threads alive in this process


class ModelMismatch(RuntimeError):
    """The ranks do not hold the same model (names, shapes or parameter count)."""


class Bucket:
    """A flat gradient buffer and the parameters whose .grad are views into it."""

    def __init__(self, index: int, params: list, dtype):
        self.index = index
        self.params = params
        self.data = np.zeros(sum(p.size for p in params), dtype=dtype)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.data[offset : offset + p.size].reshape(p.shape))
            offset += p.size
        self.pending = len(params)

    def attach(self) -> None:
        """Point every parameter's .grad at its slot in this bucket (zero_grad's half)."""
        for p, view in zip(self.params, self.views):
            p.grad = view

    def collect(self) -> None:
        """Before the allreduce: a .grad made elsewhere (after an optimizer's set-to-None
        zero_grad, or assigned by hand) is copied into its slot; no .grad at all is zeros."""
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                view[...] = 0 if p.grad is None else p.grad
                p.grad = view


def describe_model(model: Module) -> list[str]:
    return [f"{name} {tuple(p.shape)} {p.dtype}" for name, p in model.named_parameters()]


def check_same_model(model: Module, group: comm.Group) -> None:
    """Raise ModelMismatch on every rank if any rank's parameter list differs from rank 0's."""
    mine = describe_model(model)
    digest = np.array([zlib.crc32("\n".join(mine).encode()), len(mine)], dtype=np.int64)
    digests = comm.allgather(digest, group=group).reshape(group.size, 2)
    if (digests == digests[0]).all():
        return
    theirs = comm.broadcast_text("\n".join(mine), root=0, group=group).split("\n")
    first = next(
        (i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs))
    )
    firsts = comm.allgather(np.array([first if mine != theirs else -1]), group=group).ravel()
    culprit = int(np.flatnonzero(firsts >= 0)[0])
    index = int(firsts[culprit])
    mine_there = mine[index] if index < len(mine) else "(no parameter)"
    theirs_there = comm.broadcast_text(mine_there, root=culprit, group=group)
    ours = theirs[index] if index < len(theirs) else "(no parameter)"
    raise ModelMismatch(
        f"ranks hold different models: rank {culprit} has {int(digests[culprit, 1])} parameters, "
        f"rank 0 has {int(digests[0, 1])}; first difference at parameter #{index}: "
        f"rank 0 has {ours!r}, rank {culprit} has {theirs_there!r}"
    )


class DistributedDataParallel:
    """Wrap `model` for data-parallel training over `group` (default: the world)."""

    def __init__(
        self,
        model: Module,
        group: comm.Group | None = None,
        bucket_cap_mb: float = 0.25,
        algo: str = "auto",
        overlap: bool = True,
        timeline: Timeline | None = None,
    ):
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.model = model
        self.group = group or comm.world()
        self.algo, self.overlap = algo, overlap
        self.timeline = timeline or Timeline(enabled=False)
        if algo != "auto" and algo not in comm.ALLREDUCE:  # a local check, before any message
            raise ValueError(
                f"unknown allreduce algo {algo!r}; choose from auto, {', '.join(comm.ALLREDUCE)}"
            )
        check_same_model(model, self.group)
        for p in model.parameters():  # every rank starts from rank 0's weights
            comm.broadcast(p.data, root=0, group=self.group)

        params = model.parameters()[::-1]
        cap = max(1, int(bucket_cap_mb * 2**20))
        groups: list[list] = [[]]
        for p in params:
            if groups[-1] and sum(q.data.nbytes for q in groups[-1]) + p.data.nbytes > cap:
                groups.append([])
            groups[-1].append(p)
        self.buckets = [Bucket(i, ps, params[0].dtype) for i, ps in enumerate(groups)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._unhook = [p.register_grad_ready_hook(self._grad_ready) for p in params]

        self.share = 1.0 / self.group.size  # n_r / B: this rank's weight in the global mean
        self.sync_enabled = True
        self.comm_group = self.group.dup()  # the communication thread's own communicator
        # it waits by napping, not spinning: the compute thread beside it keeps the core
        self.comm_group.patient = overlap
        self.comm_seconds = 0.0  # time spent inside allreduce, in total (read differences)
        self.exposed_seconds = 0.0  # time the main thread waited for communication, in total
        self._work: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._next = 0  # index of the next bucket to launch
        self._thread = None
        if overlap:
            # Two threads share the GIL; by default one may wait 5 ms for the other to let go
            # of it, a convoy that cost 10% of a step here. Hand it over every 0.2 ms instead,
            # while any communication thread runs (the last one to stop restores it).
            if _threads["running"] == 0:
                _threads["saved_interval"] = sys.getswitchinterval()
                sys.setswitchinterval(min(_threads["saved_interval"], SWITCH_INTERVAL_S))
            _threads["running"] += 1
            self._thread = threading.Thread(target=self._serve, daemon=True, name="minidp-comm")
            self._thread.start()
        self.zero_grad()

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def parameters(self):
        return self.model.parameters()

    @property
    def buckets_launched(self) -> int:
        """How many buckets this backward has handed to communication so far (read-only)."""
        return self._next

    # ---- the step's bookkeeping ----------------------------------------------------------
    def set_batch_share(self, local_examples: int, global_examples: int) -> None:
        """This rank averages over local_examples of global_examples: weight n_r / B."""
        self.share = local_examples / global_examples

    def zero_grad(self) -> None:
        """Zero the buckets in place; every .grad is its bucket view again."""
        for bucket in self.buckets:
            bucket.data[...] = 0
            bucket.attach()
        self._rearm()

    def _rearm(self) -> None:
        """Count every bucket's gradients from zero again, for the next backward. (A backward
        that leaves some parameter unused never completes its bucket's count.)"""
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._next = 0  # the next bucket to launch

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside the block reduces them."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous
            self._rearm()

    # ---- communication --------------------------------------------------------------------
    def _grad_ready(self, p) -> None:
        self._bucket_of[id(p)].pending -= 1
        if self.sync_enabled and self.overlap:
            # In index order, as PyTorch's reducer does: a complete bucket waits for those
            # before it, so every rank runs the same allreduces in the same order, even when
            # some parameter gets no gradient on some rank (its bucket goes at the finish).
            while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
                self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        bucket.collect()
        self._next += 1
        if self.overlap:
            self._work.put(bucket)
        else:
            self._allreduce(bucket)

    def _allreduce(self, bucket: Bucket) -> None:
        start = time.perf_counter()
        bucket.data *= bucket.data.dtype.type(self.share)
        comm.allreduce(
            bucket.data, op="sum", algo=self.algo, group=self.comm_group, out=bucket.data
        )
        end = time.perf_counter()
        self.comm_seconds += end - start
        self.timeline.add(
            f"allreduce bucket {bucket.index}",
            "communication",
            start,
            end,
            bytes=bucket.data.nbytes,
            algo=self.algo,
        )

    def _serve(self) -> None:
        while True:
            bucket = self._work.get()
            if bucket is None:
                return
            try:
                self._allreduce(bucket)
                self._done.put(None)
            except BaseException as error:  # hand it to the main thread
                self._done.put(error)

    def finish_gradient_sync(self) -> None:
        """After backward: launch any bucket not yet launched, wait for all of them."""
        if not self.sync_enabled:
            return
        start = time.perf_counter()
        while self._next < len(self.buckets):  # the rest (all of them without overlap)
            self._launch(self.buckets[self._next])
        if self.overlap:
            errors = [self._done.get() for _ in self.buckets]
            if any(errors):
                raise next(e for e in errors if e)
        self.exposed_seconds += time.perf_counter() - start
        self._rearm()

    def close(self) -> None:
        """Stop the communication thread, free its communicator, unhook the model.

        The model can be wrapped again afterwards; `comm_group.counters` stay readable.
        """
        stuck = False
        if self._thread is not None:
            self._work.put(None)
            # bounded: after an error elsewhere the thread may wait on a peer that never comes,
            # and the error must still reach MPI_Abort (cli.py) rather than hang here
            self._thread.join(timeout=10.0)
            stuck = self._thread.is_alive()
            self._thread = None
            _threads["running"] -= 1
            if _threads["running"] == 0:
                sys.setswitchinterval(_threads["saved_interval"])
        if not stuck and not self.comm_group.broken:
            # MPI_Comm_free completes locally in MPICH and Open MPI: safe on an error path too.
            # A group a collective error broke, or a thread still inside one, keeps its own.
            self.comm_group.free()
        for unhook in self._unhook:
            unhook()
        self._unhook = []
