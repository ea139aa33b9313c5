"""The communication thread: reduces buckets beside backward, on a group of its own.

    main thread (backward)            communication thread
    ─ grad of W2, b2, b1 ready ──┐
                                 └──► work queue ──► hook(bucket 0, group) ──► done queue
    ─ grad of W1, b0 ready ──────┐                                               │
                                 └──► work queue ──► hook(bucket 1, group) ──► done queue
    ─ finish: wait for every "done" ◄────────────────────────────────────────────┘

Why a thread, and not non-blocking messages advanced between backward ops: the collectives
in minidp.comm are ordinary blocking code a reader can follow, and NumPy's BLAS and MPI's
blocking calls release the GIL, so the thread's messages really do proceed beside the
matmuls of the rest of backward. Both threads still take turns holding the GIL for their
Python code: the thread runs inside an `around` context, plainly nothing; DDP and ZeRO pass
gil.py's short switch interval (a speed trick of its own, on by default in DDP's TRICKS).

Nothing here refers back to the DistributedDataParallel that started the thread: the thread
holds only its queues and a `Reducer`, so a DDP that is dropped without `close()` is still
collected, and its finalizer stops the thread (and with it the short switch interval).
"""

import contextlib
import queue
import threading
import time

import numpy as np

from minidp import comm
from minidp.comm.trace import Timeline
from minidp.parallel.data_parallel.buckets import Bucket
from minidp.parallel.data_parallel.host_stage import HostBucket, HostStage, PlainStage
from minidp.tools.info import cores_per_rank


def overlap_helps(group_size: int) -> tuple[bool, str]:
    """What overlap="auto" means here: (on?, why), from the cores each rank can count on.

    The communication thread needs a core of its own to hide anything: with none to spare it
    takes the core from backward (ddp.py's docstring has the measurement)."""
    if group_size == 1:
        return False, "auto: one rank, nothing to communicate"
    share = cores_per_rank()
    if share >= 2:
        return True, f"auto: {share:g} cores per rank, one to spare for communication"
    return False, f"auto: {share:g} cores per rank, none to spare"


def allreduce_hook(algo: str = "auto"):
    """The default communication hook: sum the bucket over the group, in place, with `algo`.

    A hook is any callable `hook(bucket, group)` that leaves in `bucket.data` the sum over
    the group's ranks of what each put there (their gradients, already weighted by n_r / B);
    gradient compression plugs in here (as PyTorch DDP's `register_comm_hook`).
    `sums_in_place` says it is exactly that allreduce (coalesce.py may then reduce
    several buckets in one call)."""

    def allreduce_bucket(bucket: Bucket, group: comm.Group) -> None:
        comm.allreduce(bucket.data, op="sum", algo=algo, group=group, out=bucket.data)

    allreduce_bucket.algo = algo
    allreduce_bucket.sums_in_place = True
    return allreduce_bucket


class Reducer:
    """Reduces one bucket with the hook on `group`, and keeps the time it took.

    A bucket of torch tensors (--backend torch) goes through `stage` (host_stage.py; plainly
    `t.cpu().numpy()`): the hook sees a host NumPy array, and the result goes back."""

    def __init__(self, hook, group: comm.Group, timeline: Timeline, stage: HostStage | None = None):
        self.hook, self.group, self.timeline = hook, group, timeline
        self.stage = stage or PlainStage(timeline)
        self.seconds = 0.0  # time inside the hook, in total (read differences)

    def __call__(self, bucket: Bucket, share: float) -> None:
        start = time.perf_counter()
        device = None if isinstance(bucket.data, np.ndarray) else bucket
        if device is not None:  # a torch tensor: the hook works on its host copy
            bucket = HostBucket(device, self.stage.to_host(device.data, f"bucket {device.index}"))
        if share != 1.0:  # n_r / B (ZeRO's buckets; DDP weighs its own, Bucket.weigh)
            bucket.data *= bucket.data.dtype.type(share)
        size = bucket.data.nbytes  # read first: a hook may drop the bucket's data (ZeRO-2)
        self.hook(bucket, self.group)
        if device is not None:
            self.stage.to_device(bucket.data, device.data, f"bucket {device.index}")
        self.record(f"bucket {bucket.index}", start, size)

    def record(self, what: str, start: float, size: int) -> None:
        """Count the time since start, and put it on the timeline's communication track."""
        end = time.perf_counter()
        self.seconds += end - start
        self.timeline.add(
            f"{getattr(self.hook, 'label', 'allreduce')} {what}",
            "communication",
            start,
            end,
            bytes=size,
            algo=getattr(self.hook, "algo", type(self.hook).__name__),
        )


def reduce_each(reducer: Reducer, buckets: list[Bucket]) -> None:
    """Reduce DDP's weighed buckets (share 1) one by one: the plain way for buckets that go
    together (coalesce.reduce_together is the trick)."""
    for bucket in buckets:
        reducer(bucket, 1.0)


class CommThread:
    """A thread that runs `reducer(bucket, share)` for each submitted bucket, in order,
    inside `around()` (a context; plainly none, DDP passes gil.quick_gil_handover)."""

    def __init__(self, reducer: Reducer, around=contextlib.nullcontext):
        self._work: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._in_flight = 0  # submitted, not yet waited for
        self._thread = threading.Thread(
            target=_serve,
            args=(reducer, self._work, self._done, around),
            daemon=True,
            name="minidp-comm",
        )
        self._thread.start()

    def submit(self, bucket: Bucket, share: float) -> None:
        self._work.put((bucket, share))
        self._in_flight += 1

    def wait(self) -> None:
        """Wait for every submitted bucket; re-raise the error the thread hit, if any.

        Once a bucket fails, the thread reduces no later one (their collectives would pair
        with the wrong buckets of the other ranks): each reports the same error."""
        errors = [self._done.get() for _ in range(self._in_flight)]
        self._in_flight = 0
        if any(errors):
            raise next(e for e in errors if e)

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the thread to end and wait up to `timeout` s. True if it is still stuck (after
        an error elsewhere it may wait on a peer that never comes: the error must still reach
        MPI_Abort in cli/commands.py rather than hang here)."""
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join(timeout)
        return self._thread.is_alive()


def _serve(reducer: Reducer, work: queue.Queue, done: queue.Queue, around) -> None:
    with around():
        failed = None  # after an error, no further bucket is reduced: each reports the error
        while (item := work.get()) is not None:
            if failed is None:
                try:
                    reducer(*item)
                except BaseException as error:  # hand it to the main thread
                    failed = error
            done.put(failed)
