"""A shard's bytes hashed in fixed pieces, by a few threads at once.

One SHA-256 over a whole file is one core's work (even with the processor's SHA
instructions), longer than writing the same bytes durably (docs/checkpoints.md): a save
hashed so can never run at the disk's rate. So the manifest records, for each shard, the
SHA-256 of each PIECE_BYTES piece of the file (the last one shorter), and the pieces are
hashed by up to one thread per core this rank has, while the disk works
(shards.write_shard; hashlib releases the GIL on buffers this large):

    file    |<-- piece 0 -->|<-- piece 1 -->|<-- piece 2 -->|<- 3 ->|
    bytes    header + arrays, in file order (a piece may span several arrays)
    digests  ["9f86d0...", "60303a...", "fd61a0...", "a4e624..."]

A piece is a list of slices of the buffers the file is written from: nothing is copied.
Loading recomputes the pieces the same way and names the first one that differs, by its
byte range, with the SHA-256 it should have.
"""

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor

from minidp.tools.info import cores_per_rank

PIECE_BYTES = 16 << 20  # 16 MiB: a few per thread in a 100 MB shard, each still long to hash
THREAD_BYTES = 4 << 20  # below this a shard is hashed in line: a thread's start costs more


def cut(buffers: list[memoryview], piece_bytes: int) -> list[list[memoryview]]:
    """The bytes of `buffers` (each 1-d, of bytes), one after another, as pieces of
    `piece_bytes`, each a list of slices of them; at least one piece (empty for no bytes)."""
    pieces, current, room = [], [], piece_bytes
    for buffer in buffers:
        start = 0
        while start < buffer.nbytes:
            take = min(room, buffer.nbytes - start)
            current.append(buffer[start : start + take])
            start, room = start + take, room - take
            if room == 0:
                pieces.append(current)
                current, room = [], piece_bytes
    if current or not pieces:
        pieces.append(current)
    return pieces


def piece_count(size: int, piece_bytes: int) -> int:
    """How many pieces a file of `size` bytes has (one for an empty file)."""
    return max(1, -(-size // piece_bytes))


def digest(piece: list[memoryview]) -> str:
    """The SHA-256 of a piece's bytes, in hex."""
    sha256 = hashlib.sha256()
    for part in piece:
        sha256.update(part)
    return sha256.hexdigest()


def hashing_threads(size: int, piece_bytes: int) -> int:
    """Threads to hash `size` bytes: none (in line) for a small shard, else one per core
    this rank can count on, at least one, and no more than there are pieces. The writer
    mostly waits for the disk while they run (shards.write_shard)."""
    if size < THREAD_BYTES:
        return 0
    return max(1, min(int(cores_per_rank()), piece_count(size, piece_bytes)))


class Hasher:
    """Pieces hashed in the background: `add` them as their bytes are ready (all at once
    before a write, one by one as a read fills them), `digests()` waits for them all.
    A context manager: leaving it, however, cancels what has not started and joins every
    thread, so none outlives the save or load that made it."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(threads, "minidp-hash") if threads else None
        self.pending: list[Future | str] = []

    def add(self, piece: list[memoryview]) -> None:
        self.pending.append(self.pool.submit(digest, piece) if self.pool else digest(piece))

    def add_all(self, pieces: list[list[memoryview]]) -> None:
        for piece in pieces:
            self.add(piece)

    def digests(self) -> list[str]:
        return [p if isinstance(p, str) else p.result() for p in self.pending]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.pool:
            self.pool.shutdown(wait=True, cancel_futures=True)
