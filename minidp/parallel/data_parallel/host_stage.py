"""Collectives on torch tensors, staged through host NumPy buffers (--backend torch).

minidp's collectives (minidp.comm) move NumPy buffers over MPI. A torch tensor, which may
live on a GPU, is reduced in three moves:

    device tensor ──copy──► host buffer (NumPy; pinned memory on CUDA) ──collective──►
    host buffer ──copy──► device tensor

One host buffer per bucket (per key), made on first use and reused every step; pinned
(page-locked) on CUDA so the copies run at full PCIe speed. Every copy is counted
(`copies`, `bytes`, `seconds`) and drawn in the timeline ("stage to host" / "stage to
device" spans on the communication track), so what staging costs is measured, not
guessed. DDP stages CUDA tensors so by default; CPU tensors take the plain way below (a
view, no copy), unless `tricks={"host_stage": True}` asks for the copies on the CPU too.
Device-aware MPI (CUDA-aware Open MPI, MPICH with GPU support) could hand device pointers
to MPI and skip both copies; `device_aware_mpi()` detects it for the record, and
minidp does not rely on it (mpi4py's NumPy buffers are what every MPI takes).

HostStage is a speed trick of DDP's (`tricks={"host_stage": ...}`, ddp.py):
PlainStage is the plain way, a NumPy array from `t.cpu().numpy()` each time (for a CPU
tensor a view of its own memory, no copy at all; for a CUDA tensor a fresh, pageable host
copy) and, unless it is that view, a copy back. The bits are the same
(test_ddp_tricks.py); `bench dp --case tricks --backend torch` measures them side by side.
"""

import time

import numpy as np

from minidp.comm.trace import Timeline
from minidp.engine.backend import backend_torch, is_torch


def device_aware_mpi() -> bool:
    """Whether the MPI library's version line names CUDA (a hint, not a guarantee; False
    when it cannot say). minidp stages through the host either way."""
    from minidp.tools.info import mpi_library  # the comm layer alone imports mpi4py

    try:
        return "cuda" in mpi_library().lower()
    except Exception:  # any failure means: not known to be
        return False


class HostStage:
    """Host NumPy buffers for torch tensors, and the counts of the copies through them."""

    def __init__(self, timeline: Timeline | None = None):
        self.timeline = timeline or Timeline(enabled=False)
        self._buffers: dict = {}
        self.copies = 0  # device->host plus host->device copies, in total
        self.bytes = 0
        self.seconds = 0.0

    def _buffer(self, key, t) -> np.ndarray:
        host = self._buffers.get(key)
        if host is None or host.shape != tuple(t.shape) or host.dtype != _np_dtype(t):
            import torch

            pinned = t.device.type == "cuda"
            host = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=pinned)
            host = backend_torch().host_view(host)  # bfloat16: its 16-bit words, as they are
            self._buffers[key] = host
        return host

    def _count(self, name: str, start: float, nbytes: int) -> None:
        end = time.perf_counter()
        self.copies += 1
        self.bytes += nbytes
        self.seconds += end - start
        self.timeline.add(name, "communication", start, end, bytes=nbytes)

    def to_host(self, t, key) -> np.ndarray:
        """Copy tensor `t` into its host buffer (one per key) and return that buffer."""
        start = time.perf_counter()
        host = self._buffer(key, t)
        backend_torch().from_host(host).copy_(t)  # waits for the device: the buffer is ready after
        self._count(f"stage to host {key}", start, host.nbytes)
        return host

    def to_device(self, host: np.ndarray, t, key) -> None:
        """Copy the host buffer back into tensor `t`, in place."""
        start = time.perf_counter()
        t.copy_(backend_torch().from_host(host))
        self._count(f"stage to device {key}", start, host.nbytes)

    def in_place(self, fn, array, key) -> None:
        """fn(array) for a NumPy array; for a torch tensor, fn on its host copy, copied back."""
        if not is_torch(array):
            fn(array)
            return
        host = self.to_host(array, key)
        fn(host)
        self.to_device(host, array, key)

    def nbytes(self) -> int:
        """Bytes of the host buffers kept for staging (0 on the NumPy path)."""
        return sum(b.nbytes for b in self._buffers.values())

    def record(self) -> dict:
        """The counts for the final record (empty when nothing was staged: NumPy)."""
        if not self.copies:
            return {}
        return {"stage_copies": self.copies, "stage_bytes": self.bytes, "stage_s": self.seconds}


def _np_dtype(t) -> np.dtype:
    return backend_torch().like_dtype(t)


class HostBucket:
    """A bucket's stand-in for a communication hook: the same index and parameters, and
    `data` the host copy of the bucket's flat tensor."""

    def __init__(self, bucket, data: np.ndarray):
        self.index, self.params, self.data = bucket.index, bucket.params, data


class PlainStage(HostStage):
    """Staging without kept buffers: `t.cpu().numpy()` each time, a view for a CPU tensor
    (nothing to copy, either way) and a fresh host copy for a CUDA one."""

    def to_host(self, t, key) -> np.ndarray:
        start = time.perf_counter()
        host = backend_torch().host_view(t.cpu())
        if not _same_memory(host, t):
            self._count(f"stage to host {key}", start, host.nbytes)
        return host

    def to_device(self, host: np.ndarray, t, key) -> None:
        if _same_memory(host, t):  # a view of t itself: the result is already there
            return
        super().to_device(host, t, key)


def _same_memory(host: np.ndarray, t) -> bool:
    return t.device.type == "cpu" and host.__array_interface__["data"][0] == t.data_ptr()
