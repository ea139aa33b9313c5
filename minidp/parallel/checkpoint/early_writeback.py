"""A speed trick for a shard's write: the disk starts on each piece as soon as it is written.

The plain write (shards.write_all) hands the kernel the whole shard, then fsync waits while
the disk takes all of it: the copy into the page cache and the disk's work one after the
other. Here the shard goes in its 16 MiB pieces (pieces.py's), and after each one
`posix_fadvise(POSIX_FADV_DONTNEED)` on its byte range: Linux starts writing those dirty
pages back at once (asynchronously, WB_SYNC_NONE) and drops them from the cache once they
are clean. So the disk works while the next pieces are copied and hashed, and the final
fsync waits only for the tail:

    plain   copy p0 p1 p2 p3 .............. fsync [disk p0 p1 p2 p3]
    early   copy p0 p1 p2 p3 ...... fsync [tail]
                 [disk p0 p1 p2 p3]

The hashing threads (pieces.py) run beside the write here; after it in the plain
path, while fsync waits. The file's bytes are the same either way
(tests/test_checkpoint.py), and fsync still makes them durable before the rename: the
advice only moves when the disk starts. `bench checkpoint` measures what it buys a save
(early_writeback_speedup; docs/checkpoints.md has the times, and the write + fsync alone).
On where the OS has posix_fadvise (not macOS) and each rank has a core (`helps`).
"""

import contextlib
import os

from minidp.tools.info import cores_per_rank


def available() -> bool:
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def helps() -> bool:
    """Where it paid, measured: a rank with a core of its own. With more ranks than cores
    the writeback's kernel work competes with the ranks' hashing, and the save was slower
    with it (docs/checkpoints.md)."""
    return cores_per_rank() >= 1


def write(fd: int, pieces: list[list[memoryview]], write_all) -> None:
    """Write the pieces in order with `write_all(fd, piece)` (the plain write), asking the
    kernel to start each one's writeback as soon as it is in the page cache."""
    offset = 0
    for piece in pieces:
        write_all(fd, piece)
        size = sum(part.nbytes for part in piece)
        if size:
            with contextlib.suppress(OSError):  # advice: where refused, the plain write's way
                os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
        offset += size
