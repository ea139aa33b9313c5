"""Offload: the optimizer's state moved out of the process, into a memory-mapped file.

ZeRO-Offload and ZeRO-Infinity (Ren et al. 2021, Rajbhandari et al. 2021) keep the
optimizer's state, the largest of the model states (Adam's moments and, in mixed precision,
the float32 masters: 12 of the 16 bytes a parameter), in a second tier, the CPU's memory
or NVMe, and bring each piece in only for its update. On NumPy there is one memory, so the
second tier here is a file: every state array is a view into a memory-mapped file, and
after each parameter's update its pages are dropped from the process (madvise DONTNEED):

    Offload(optimizer)      init_state, then every state array moved into the file
    optimizer.step()        for each parameter: its state paged in by the first touch
                            (a minor fault per page, from the OS's page cache), updated,
                            then dropped from this process (after_update)

A dropped page of a shared file mapping is not lost: it stays in the OS's page cache,
dirty, and the kernel writes it to the file when it needs the memory. So the process's
resident set no longer holds the state (the OS's peak RSS shows it), at the price of the
page faults each step (and, under memory pressure, the disk). The state's bytes are
reported as `offloaded`, not `optimizer`. Checkpoints read and write the same arrays;
`load_state_dict` puts what it loads back into the file. The state must be NumPy arrays:
an optimizer over torch tensors (--backend torch) is refused with one line.
"""

import mmap
import os
import tempfile

import numpy as np

from minidp.engine.backend import is_torch

PAGE = mmap.PAGESIZE


class Offload:
    """`optimizer`'s per-parameter state arrays in one file under `directory` (a fresh
    temporary one by default), paged out after each parameter's update. `close()` removes
    the file."""

    def __init__(self, optimizer, directory: str | None = None):
        optimizer.init_state()  # every array exists: the file is laid out once
        if any(is_torch(a) for state in optimizer.state for a in state.values()):
            raise TypeError(
                "Offload maps NumPy optimizer state into a file; this optimizer's state is "
                "torch tensors (--backend torch): offload runs on the NumPy backend only"
            )
        self.optimizer = optimizer
        self.entries = [
            [(key, a.shape, a.dtype) for key, a in state.items() if np.ndim(a)]
            for state in optimizer.state
        ]
        self.spans, offset = [], 0
        for entries in self.entries:  # each parameter's block starts on a page
            size = sum(int(np.prod(shape)) * dtype.itemsize for _, shape, dtype in entries)
            self.spans.append((offset, size))
            offset += -(-size // PAGE) * PAGE
        self.nbytes = offset
        fd, self.path = tempfile.mkstemp(prefix="minidp_offload_", dir=directory)
        try:
            os.ftruncate(fd, max(offset, PAGE))
            self.map = mmap.mmap(fd, max(offset, PAGE))
        finally:
            os.close(fd)
        self.file = np.frombuffer(self.map, np.uint8)
        self.place()
        optimizer.after_update = self.page_out
        loads = optimizer.load_state_dict

        def load_state_dict(state: dict) -> None:
            loads(state)
            self.place()  # what was loaded, back into the file

        optimizer.load_state_dict = load_state_dict

    def view(self, i: int) -> list[np.ndarray]:
        """Parameter i's state arrays as views into the file, in `entries` order."""
        out, at = [], self.spans[i][0]
        for _, shape, dtype in self.entries[i]:
            n = int(np.prod(shape)) * dtype.itemsize
            out.append(self.file[at : at + n].view(dtype).reshape(shape))
            at += n
        return out

    def place(self) -> None:
        """Every state array into its place in the file (copied where it is not there)."""
        for i, state in enumerate(self.optimizer.state):
            for (key, _, _), mapped in zip(self.entries[i], self.view(i)):
                if state[key] is not mapped:
                    mapped[...] = state[key]
                    state[key] = mapped
            self.page_out(i)

    def page_out(self, i: int) -> None:
        """Drop parameter i's state pages from this process (the page cache keeps them)."""
        start, size = self.spans[i]
        if size:
            self.map.madvise(mmap.MADV_DONTNEED, start, -(-size // PAGE) * PAGE)

    def close(self) -> None:
        self.optimizer.after_update = None
        for state in self.optimizer.state:  # back in memory: the file goes
            for key, a in state.items():
                if np.ndim(a):
                    state[key] = np.array(a)
        del self.file
        try:
            self.map.close()
        except BufferError:  # a view is still held somewhere: the mapping goes with it
            pass
        os.remove(self.path)
