"""Data parallelism: every rank holds the whole model, reads its slice of the global batch,
and the ranks average their gradients before each optimizer step (PyTorch DDP, Horovod).

    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25, algo="ring", overlap=True)
    ddp.zero_grad()
    loss = cross_entropy(ddp(x), y)      # forward is the model's own
    loss.backward()                      # buckets' allreduces start while backward runs
    ddp.finish_gradient_sync()           # wait for the last bucket; grads are now averaged
    opt.step()

Buckets (buckets.py). Gradients live in a few flat, contiguous buckets, filled in *reverse*
parameter order (the order backward produces them); once weighed, each `p.grad` is a view
into its bucket, so a bucket is reduced in place with no packing copy, one message per
bucket:

    params   W0 b0 W1 b1 W2 b2            (forward order)
    buckets  [b2 W2 b1] [W1 b0] [W0]      (reverse order, each up to bucket_cap_mb)

The communication hook. Each bucket is reduced by `hook(bucket, group)`, by default an
allreduce(sum) with `algo` (comm_thread.allreduce_hook); `register_comm_hook` swaps in
another (gradient compression), as PyTorch DDP's `register_comm_hook` does.

Overlap. Without it, every bucket is reduced after backward, in `finish_gradient_sync`: all
communication is exposed. With it, each parameter's grad-ready hook (autograd.py) counts
down its bucket; the hook that completes a bucket hands it to a **communication thread**
(comm_thread.py, which says why a thread), which reduces it on its own duplicated group
while the main thread goes on with backward. Communication is CPU work too (copies,
reductions, polling): on a machine with no spare core the thread takes the core from
backward, and overlap costs more than it hides (measured: 0.72 weak-scaling efficiency with
it, 0.90 without, 2 ranks on 2 cores). So `overlap="auto"`, the default, turns it on only
when every rank of the machine has a core to spare (`overlap_helps`); True or False force
it. Buckets are launched in index order (the order backward normally
completes them), each once every bucket before it has gone, as PyTorch's reducer does: so
all ranks run the same collectives in the same order, even when a parameter gets no gradient
on some rank (its bucket then goes at `finish_gradient_sync`, carrying zeros for it).

Which parameters, as PyTorch's DDP treats them:
- *shared* (a tied weight, `fc4.weight = fc2.weight`): `model.parameters()` lists it once,
  so it has one bucket slot and one grad-ready hook; backward sums its uses before the hook.
- *frozen* (`p.requires_grad = False` before wrapping): broadcast from rank 0 with the rest
  at construction, then left alone: no bucket slot, no .grad, no reduction.
- *unused* in a step (no backward since the last sync reached it) on some ranks: its slot is
  still reduced, those ranks adding zeros, so the sum is right and every rank ends with it as
  .grad. Unused on *every* rank: .grad ends None on every rank, so optimizers skip it (no
  weight decay, no moments), as PyTorch with find_unused_parameters=True leaves it. To know
  which, finish_gradient_sync runs one small collective after the buckets: a max-allreduce,
  on `group`, of one int32 flag per parameter, 1 where a backward reached it (PyTorch
  allreduces its local_used_map so). Not inside the buckets: a communication hook may
  change any value it is given (compression), a longer bucket would cut its chunks
  elsewhere (other bits), and `comm_group` carries the gradients only (its byte counts
  are what compression is measured by).

Averaging, with uneven batches. A rank's loss is the mean over its n_r examples. The global
batch mean is sum_r (n_r / B) * mean_r, so before the allreduce(sum) each rank scales its
bucket by n_r / B (`set_batch_share`); with equal slices that is 1 / world, plain averaging.
`no_sync()` skips communication (gradient accumulation): gradients keep adding up in the
buckets (the first micro-batch's, after a zero_grad, in arrays of their own until its block
ends) and the next synchronized backward weighs the total and reduces the buckets. Inside
it, backward defers weight gradients (autograd.defer_weight_grads): a Linear weight whose
micro-batches have few rows (their copies no larger than its gradient) keeps them, and the
synchronized backward multiplies them all in one product, instead of one product and one
addition per micro-batch.
"""

import contextlib
import time
import weakref
import zlib

import numpy as np

from minidp import comm
from minidp.autograd import defer_weight_grads
from minidp.info import cores_per_rank
from minidp.nn import Module
from minidp.parallel.buckets import Bucket, assign_buckets
from minidp.parallel.comm_thread import CommThread, Reducer, allreduce_hook
from minidp.parallel.host_stage import HostStage
from minidp.trace import Timeline


class ModelMismatch(RuntimeError):
    """The ranks do not hold the same model (names, shapes or parameter count)."""


def describe_model(model: Module) -> list[str]:
    """One line per parameter: name, shape, dtype, and whether it is frozen."""
    return [
        f"{name} {tuple(p.shape)} {p.dtype}" + ("" if p.requires_grad else " frozen")
        for name, p in model.named_parameters()
    ]


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


def overlap_helps(group_size: int) -> tuple[bool, str]:
    """What overlap="auto" means here: (on?, why), from the cores each rank can count on.

    The communication thread needs a core of its own to hide anything: with none to spare it
    takes the core from backward (see the module docstring for the measurement)."""
    if group_size == 1:
        return False, "auto: one rank, nothing to communicate"
    share = cores_per_rank()
    if share >= 2:
        return True, f"auto: {share:g} cores per rank, one to spare for communication"
    return False, f"auto: {share:g} cores per rank, none to spare"


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
    (requires_grad = False) before wrapping: DDP reads which are trainable once, here."""

    def __init__(
        self,
        model: Module,
        group: comm.Group | None = None,
        bucket_cap_mb: float = 0.25,
        algo: str = "auto",
        overlap: bool | str = "auto",
        timeline: Timeline | None = None,
    ):
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if overlap not in (True, False, "auto"):
            raise ValueError(f"overlap must be True, False or 'auto', got {overlap!r}")
        self.model = model
        self.group = group or comm.world()
        self.algo = algo
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
        self.stage = HostStage(timeline)  # torch tensors go through host buffers (host_stage.py)
        for i, p in enumerate(model.parameters()):  # every rank starts from rank 0's weights
            self.stage.in_place(
                lambda a: comm.broadcast(a, root=0, group=self.group), p.data, f"param {i}"
            )

        self.comm_group = self.group.dup()  # communication's own communicator
        # with overlap it waits by napping, not spinning: the compute thread keeps the core
        self.comm_group.patient = self.overlap

        self._names = {id(p): name for name, p in model.named_parameters()}  # for errors
        cap = max(1, int(bucket_cap_mb * 2**20))
        self.arena = self._shared_arena(params)
        self.buckets = assign_buckets(
            params, cap, None if self.arena is None else _carve(self.arena)
        )
        self._params = params
        # _reached[k]: 1 once a backward (no_sync's too) has reached params[k] since the sync
        self._reached = np.zeros(len(params), dtype=np.int32)
        slots = [(b, i) for b in self.buckets for i in range(len(b.params))]  # params' order
        self._slot_of = {id(p): (b, i, k) for k, (p, (b, i)) in enumerate(zip(params, slots))}
        # A grad-ready hook on every parameter: it weighs each gradient into its bucket the
        # moment it is final (hot in cache), and with overlap launches complete buckets.
        hook = _weak_hook(self._grad_ready)
        self._unhook = [p.register_grad_ready_hook(hook) for p in params]

        self.share = 1.0 / self.group.size  # n_r / B: this rank's weight in the global mean
        self.sync_enabled = True
        self.reducer = Reducer(
            allreduce_hook(algo), self.comm_group, timeline or Timeline(False), self.stage
        )
        self.exposed_seconds = 0.0  # time the main thread waited for communication, in total
        self._next = 0  # index of the next bucket to launch
        self._thread = CommThread(self.reducer) if self.overlap else None
        # a DDP dropped without close() must not leave its thread (and GIL setting) behind
        self._stop_thread = weakref.finalize(self, _stop, self._thread)
        for bucket in self.buckets:  # every .grad starts as its (zero) slot in a bucket
            bucket.attach()
        self._rearm()

    def _shared_arena(self, params) -> np.ndarray | None:
        """One array for all buckets in memory every rank reads (comm/shm.py), when they are
        reduced by loads (algo "shm", or "auto" with every rank on one machine and room in
        /dev/shm), so the allreduce copies nothing in or out; else None (plain buckets)."""
        if self.algo not in ("auto", "shm") or self.comm_group.size == 1:
            return None
        if not isinstance(params[0].data, np.ndarray):  # torch tensors stage through the host
            return None
        if self.algo == "auto" and not comm.on_one_machine(self.comm_group):
            return None  # the same answer on every rank
        count = sum(p.size for p in params)
        return comm.shared_zeros(
            count, params[0].dtype, self.comm_group, if_room=self.algo == "auto"
        )

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

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
        """Set every .grad to None (PyTorch's set_to_none): each gradient backward computes
        is then its own array (or, under `no_sync()`, a deferred weight's kept rows), and the
        synchronized backward's hook multiplies it into its bucket slot in one pass
        (Bucket.weigh), where zeroed buckets would cost a pass to zero them and one to add
        into them."""
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None
        self._reached[:] = 0  # what earlier backward passes reached is gone with it
        self._rearm()

    def _rearm(self) -> None:
        """Count every bucket's gradients from zero again, for the next backward. (A backward
        that leaves some parameter unused never completes its bucket's count.) What has been
        reached is counted on, until a sync or zero_grad."""
        for bucket in self.buckets:
            bucket.rearm()
        self._next = 0  # the next bucket to launch

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside the block reduces them.

        After a zero_grad, the block's first backward leaves each gradient in an array of its
        own (a deferred weight: its rows), and the block's end moves it into its bucket slot
        (Tensor.keep_grad_in), where later micro-batches add up in place: one pass, where
        pointing every .grad at a zeroed slot first would cost two (zero, then add). A
        parameter no micro-batch reached gets its slot, zeroed, as its .grad (until the sync:
        None there if no rank's backward reached it either)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            with defer_weight_grads():  # more backward passes come before .grad is read
                yield
        finally:
            self.sync_enabled = previous
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    p.keep_grad_in(view)
            self._rearm()

    # ---- communication --------------------------------------------------------------------
    def _grad_ready(self, p) -> None:
        bucket, i, k = self._slot_of[id(p)]
        self._reached[k] = 1
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
        # In index order, as PyTorch's reducer does: a complete bucket waits for those
        # before it, so every rank runs the same reductions in the same order, even when
        # some parameter gets no gradient on some rank (its bucket goes at the finish).
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
        """Weigh the slots no hook has weighed (unused parameters, or a .grad set by hand:
        that one counts as reached)."""
        for p in bucket.collect(self.share):
            self._reached[self._slot_of[id(p)][2]] = 1

    def finish_gradient_sync(self) -> None:
        """After backward: launch any bucket not yet launched, wait for all of them.

        A gradient is weighed by n_r / B into its bucket the moment backward finishes it
        (its grad-ready hook), so change no .grad between a synchronized backward and this
        call (add a regularizer before backward, or under no_sync). Then a parameter no
        rank's backward reached since the last sync gets .grad None (the module docstring)."""
        if not self.sync_enabled:
            return
        start = time.perf_counter()
        if self._thread is None:  # no overlap: every bucket goes now, in one call
            for bucket in self.buckets:
                self._collect(bucket)
            self.reducer.many(self.buckets)
        else:  # the buckets the hooks have not launched yet, then wait for all
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
            self._thread.wait()
        self._drop_unreached()
        self.exposed_seconds += time.perf_counter() - start
        self._rearm()

    def _drop_unreached(self) -> None:
        """.grad = None for each parameter that no rank's backward reached since the last
        sync: one max-allreduce of the reached flags, on `group`."""
        if self.group.size > 1:
            comm.allreduce(self._reached, op="max", group=self.group, out=self._reached)
        for k in np.flatnonzero(self._reached == 0):
            self._params[k].grad = None
        self._reached[:] = 0

    def close(self) -> None:
        """Stop the communication thread, free its communicator, unhook the model.

        The model can be wrapped again afterwards; `comm_group.counters` stay readable."""
        stuck = self._stop_thread()  # runs once: later calls return None
        self._thread = None
        if not stuck and self.arena is not None:  # the gradients move out; the memory goes
            for bucket in self.buckets:  # back to the pool, for the next DDP (no MPI call)
                bucket.detach()
            comm.release_shared(self.arena, self.comm_group)
            self.arena = None
        if not stuck and not self.comm_group.broken:
            # MPI_Comm_free completes locally in MPICH and Open MPI: safe on an error path too.
            # A group a collective error broke, or a thread still inside one, keeps its own.
            self.comm_group.free()
        for unhook in self._unhook:
            unhook()
        self._unhook = []


def _carve(arena: np.ndarray):
    """zeros(count, dtype) for assign_buckets: the arena's next `count` elements, in order."""
    taken = [0]

    def zeros(count, dtype):
        taken[0] += count
        return arena[taken[0] - count : taken[0]]

    return zeros


def _stop(thread: CommThread | None) -> bool:
    """Stop the communication thread, if any; True if it is still stuck."""
    return thread is not None and thread.stop()
