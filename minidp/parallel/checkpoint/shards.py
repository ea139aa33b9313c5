"""One rank's shard on disk: an .npz of its arrays and its skeleton, hashed as it is written.

    shard_00003.npz     the arrays of rank 3's state (tree.flatten), and "__skeleton__", the
                        tree's JSON as uint8: np.load(..., allow_pickle=False) reads it all

The file is written under a temporary name, fsynced and renamed: a crash leaves no file at
the final name that is not whole. Its SHA-256 and size are taken from the bytes as they go
to disk (a stream zipfile cannot seek back into, so it writes data descriptors), so hashing
costs no second read, and the arrays' bytes go out as they lie in memory, uncopied. The
manifest records both, and `read_shard` checks them before it parses anything: a truncated
or altered file is refused by name with the checksum expected.
"""

import hashlib
import io
import json
import os
import queue
import threading
import zipfile

import numpy as np

from minidp.parallel.checkpoint.tree import flatten, unflatten

SKELETON = "__skeleton__"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded as asked: one line saying why."""


class _HashingStream:
    """A write-only stream that writes to `f` and hashes what passes, in a thread of its own:
    hashlib and the write both release the GIL, so SHA-256 runs beside the disk (and the
    zip's CRC-32) on a spare core. The buffers are the arrays' own memory, not copies,
    alive until `digest()` has joined the thread."""

    def __init__(self, f):
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._hash, daemon=True)
        self.thread.start()

    def _hash(self) -> None:
        while (data := self.pending.get()) is not None:
            self.sha256.update(data)

    def write(self, data) -> int:
        self.pending.put(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> str:
        self.pending.put(None)
        self.thread.join()
        return self.sha256.hexdigest()


def write_npy(member, array: np.ndarray) -> None:
    """np.lib.format.write_array without its copy: the header, then the array's own bytes."""
    array = array if array.flags.c_contiguous else array.copy(order="C")  # 0-d stays 0-d
    header = np.lib.format.header_data_from_array_1_0(array)
    try:
        np.lib.format.write_array_header_1_0(member, header)
    except ValueError:  # a header past 64 KiB (a very long shape): format 2.0
        np.lib.format.write_array_header_2_0(member, header)
    member.write(memoryview(array.reshape(-1)).cast("B") if array.size else b"")


def shard_name(rank: int) -> str:
    return f"shard_{rank:05d}.npz"


def write_shard(state, directory: str, rank: int) -> tuple[dict, dict[str, np.ndarray]]:
    """Write rank's state as directory/shard_NNNNN.npz; return ({file, sha256, bytes}, the
    arrays by path) for the manifest."""
    arrays, skeleton = flatten(state)
    if SKELETON in arrays:
        raise CheckpointError(f"a state may not hold a leaf named {SKELETON!r}")
    text = np.frombuffer(json.dumps(skeleton).encode(), dtype=np.uint8)
    final = os.path.join(directory, shard_name(rank))
    temporary = final + ".tmp"
    with open(temporary, "wb") as f:
        stream = _HashingStream(f)
        with zipfile.ZipFile(stream, "w") as npz:  # what np.savez writes, without pickle
            for name, array in [*arrays.items(), (SKELETON, text)]:
                with npz.open(name + ".npy", "w", force_zip64=True) as member:
                    write_npy(member, np.asarray(array))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, final)
    info = {"file": shard_name(rank), "sha256": stream.digest(), "bytes": stream.size}
    return info, arrays


def read_shard(directory: str, info: dict) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays by path, skeleton) of one shard, after its size and SHA-256 match `info`."""
    path = os.path.join(directory, info["file"])
    expected = f"expected {info['bytes']} bytes with sha256 {info['sha256']}"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read it ({error.strerror}); {expected}") from None
    if len(data) != info["bytes"]:
        raise CheckpointError(f"{path} is truncated or grown: {len(data)} bytes, {expected}")
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CheckpointError(f"{path} is corrupt: its sha256 differs, {expected}")
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    skeleton = json.loads(arrays.pop(SKELETON).tobytes().decode())
    return arrays, skeleton


def state_of(arrays: dict, skeleton: dict):
    """The state tree of a shard read back (tree.unflatten)."""
    return unflatten(arrays, skeleton)
