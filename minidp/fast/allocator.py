"""Memory that stays mapped: tell the C library's allocator to keep what a step frees.

A training step allocates the same arrays every step: activations on the way forward,
gradients on the way back, all freed by the step's end. Where the memory comes from decides
what the next step pays:

    step k:   malloc -> fresh pages -> first write faults each 4 KiB page in
              free   -> glibc gives the pages back to the OS (munmap, or trims the heap's top)
    step k+1: malloc -> fresh pages again -> the same faults again

glibc serves a request of at least M_MMAP_THRESHOLD bytes (128 KiB at start; it grows
to the largest block freed so far, up to 32 MiB) with its own mmap, unmapped again on
free; smaller ones come from the heap, whose top is handed back (trimmed) once more than
M_TRIM_THRESHOLD bytes are free there. The tiny GPT's step frees a few MiB at a time, so
it faulted thousands of times a step, a large share of its time; PyTorch faults far less.
Three settings (mallopt(3)) make glibc keep the memory instead: every block below 32 MiB
from the heap, nothing trimmed below 256 MiB free, and 16 MiB of slack each time the heap
grows. After the first steps the heap holds what a step needs and the faults stop
(docs/memory.md has the numbers).

`keep_freed_memory()` is called once at start-up by minidp's entry points (`python -m
minidp`, its benchmarks); importing minidp as a library changes nothing. Set
MINIDP_KEEP_MEMORY=0 to leave the allocator as it is. Where the C library is not glibc
(macOS, musl, Windows) there is no mallopt to call and nothing is changed: whether the
faults come back each step is then that allocator's choice, and the faults column of
`bench compare` shows it.

The cost: a process keeps up to M_TRIM_THRESHOLD bytes it no longer uses, as PyTorch's
caching allocators do with theirs.
"""

import ctypes
import ctypes.util
import os
import platform

# mallopt(3) parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MiB = 1 << 20
SETTINGS = {  # what keep_freed_memory() sets: parameter -> bytes
    M_MMAP_THRESHOLD: 32 * MiB,  # below this a block comes from the heap (glibc's maximum)
    M_TRIM_THRESHOLD: 256 * MiB,  # give the heap's top back only when this much is free
    M_TOP_PAD: 16 * MiB,  # grow the heap by this much extra each time it grows
}
ENV = "MINIDP_KEEP_MEMORY"


def is_glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"


def keep_freed_memory(environ=os.environ) -> bool:
    """Apply SETTINGS with glibc's mallopt, unless MINIDP_KEEP_MEMORY=0 or the C library is
    not glibc. Returns whether every setting took."""
    if environ.get(ENV, "1") == "0" or not is_glibc():
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(libc.mallopt(param, value) == 1 for param, value in SETTINGS.items())
