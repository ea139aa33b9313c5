"""One rank's shard on disk: its arrays in the safetensors layout, hashed as they are written.

    shard_00003.safetensors
        8 bytes     N, the length of the header (unsigned, little-endian)
        N bytes     the header, JSON (space-padded so the data starts at a multiple of 8):
                    {"model/wte.weight": {"dtype": "F32", "shape": [65, 32],
                                          "data_offsets": [0, 8320]}, ...,
                     "__metadata__": {"skeleton": "<the tree's JSON (tree.py)>"}}
        data        each array's bytes, C order, little-endian, at its [begin, end) from here

This is the layout Hugging Face's safetensors defines, written by hand: no container, no
per-file checksum of its own, no pickle; `safetensors.numpy.load_file` reads a shard. The
arrays are laid out widest dtype first, so each one starts at a multiple of its itemsize.

Writing costs what the disk costs. The header and the arrays' own memory go to the file
uncopied, by os.writev: in one go (plain), or, with early_writeback.py's speed trick where
each rank has a core, piece by piece with the disk started on each at once. The pieces are
hashed by a thread per core (pieces.py: hashlib releases the GIL on large buffers; a shard
under 4 MiB in line): after the plain write, while fsync waits for the disk; beside the
early one. The manifest records each 16 MiB piece's SHA-256, computed without reading the
file back. The file is written under a temporary name, fsynced and renamed: a crash leaves
no file at the final name that is not whole, and a failed write leaves no temporary one.

Reading checks the size, then each piece's SHA-256 (hashed while the next is read) against
the manifest before it parses anything, then checks the header (every dtype from the
table below, every shape and range inside the file) and takes the arrays as views of the
bytes read (np.frombuffer): data, never code.
"""

import contextlib
import errno
import json
import math
import os
import stat
import struct

import numpy as np

from minidp.engine.precision import is_bfloat16, named_dtype
from minidp.parallel.checkpoint import early_writeback
from minidp.parallel.checkpoint.pieces import (
    PIECE_BYTES,
    Hasher,
    cut,
    hashing_threads,
    piece_count,
)
from minidp.parallel.checkpoint.tree import flatten, unflatten

DTYPES = {  # safetensors' names: the only dtypes a shard holds
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "F16": np.float16, "U32": np.uint32, "I32": np.int32, "F32": np.float32,
    "U64": np.uint64, "I64": np.int64, "F64": np.float64,
}  # fmt: skip
CODES = {np.dtype(t): code for code, t in DTYPES.items()}


def code_of(dtype: np.dtype) -> str | None:
    """safetensors' name of a dtype (mixed precision's bfloat16: "BF16"), or None."""
    return "BF16" if is_bfloat16(dtype) else CODES.get(dtype)


def dtype_of(code: str) -> np.dtype:
    return named_dtype("bfloat16") if code == "BF16" else np.dtype(DTYPES[code])


METADATA = "__metadata__"
EARLY_WRITEBACK = early_writeback.available()  # the speed trick of early_writeback.py


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded as asked: one line saying why."""


def shard_name(rank: int) -> str:
    return f"shard_{rank:05d}.safetensors"


def header_and_data(arrays: dict[str, np.ndarray], skeleton: dict) -> tuple[bytes, list]:
    """(the 8-byte length and the header, the arrays' bytes in file order as memoryviews)."""
    if METADATA in arrays:  # the header's own key: the array would be lost on load
        raise CheckpointError(f"an array named {METADATA}: a name the shard's header keeps")
    header, data, offset = {}, [], 0
    for name in sorted(arrays, key=lambda n: -arrays[n].dtype.itemsize):  # stable: widest first
        array = arrays[name]
        header[name] = {
            "dtype": code_of(array.dtype),
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        data.append(memoryview(array.reshape(-1).view(np.uint8)))
        offset += array.nbytes
    header[METADATA] = {"skeleton": json.dumps(skeleton)}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts at a multiple of 8 (8 + len(text))
    return struct.pack("<Q", len(text)) + text, data


def as_stored(name: str, array: np.ndarray) -> np.ndarray:
    """`array` as a shard stores it: C order, little-endian, a dtype of the table."""
    array = np.asarray(array)  # a NumPy scalar: a 0-d array (np.ascontiguousarray: 1-d)
    array = array if array.flags.c_contiguous else array.copy(order="C")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if code_of(array.dtype) is None:
        raise CheckpointError(
            f"{name}: a {array.dtype} array; a checkpoint holds {', '.join(map(str, CODES))}"
        )
    return array


def write_shard(
    state, directory: str, rank: int, piece_bytes: int = PIECE_BYTES, leave_out=()
) -> tuple[dict, dict[str, np.ndarray]]:
    """Write rank's state as directory/shard_NNNNN.safetensors, but for the arrays named in
    `leave_out` (replicated ones a lower rank writes: the skeleton still names them); return
    ({file, bytes, piece_bytes, sha256_pieces}, the arrays written, by path) for the manifest."""
    arrays, skeleton = flatten(state)
    arrays = {name: as_stored(name, a) for name, a in arrays.items() if name not in leave_out}
    head, data = header_and_data(arrays, skeleton)
    buffers = [memoryview(head), *data]
    final = os.path.join(directory, shard_name(rank))
    temporary = final + ".tmp"
    size = sum(buffer.nbytes for buffer in buffers)
    pieces = cut(buffers, piece_bytes)
    with Hasher(hashing_threads(size, piece_bytes)) as hasher:  # joined, whatever happens
        try:
            with open(temporary, "wb", buffering=0) as f:
                if EARLY_WRITEBACK and len(pieces) > 1 and early_writeback.helps():
                    hasher.add_all(pieces)  # hashed while written, the disk started early
                    early_writeback.write(f.fileno(), pieces, write_all)
                else:
                    write_all(f.fileno(), buffers)  # into the page cache, then hashed
                    hasher.add_all(pieces)  # while fsync waits for the disk
                os.fsync(f.fileno())
            os.replace(temporary, final)
        except BaseException:
            with contextlib.suppress(OSError):  # none made, or not ours (a directory): as it is
                os.remove(temporary)
            raise
        digests = hasher.digests()
    info = {"file": shard_name(rank), "bytes": size, "piece_bytes": piece_bytes}
    return {**info, "sha256_pieces": digests}, arrays


def write_all(fd: int, pieces: list[memoryview]) -> None:
    """Write the pieces one after another, uncopied: os.writev, a system call for up to
    IOV_MAX of them, again from where the kernel stopped if it took fewer bytes."""
    pieces = [piece for piece in pieces if piece.nbytes]
    first = 0
    while first < len(pieces):
        written = os.writev(fd, pieces[first : first + os.sysconf("SC_IOV_MAX")])
        while first < len(pieces) and written >= pieces[first].nbytes:
            written -= pieces[first].nbytes
            first += 1
        if written:  # a piece cut short: its rest next
            pieces[first] = pieces[first][written:]


def read_shard(directory: str, info: dict) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays by path, skeleton) of one shard, after its size and each piece's SHA-256
    match `info`; the pieces hash while the next ones are read."""
    path = os.path.join(directory, info["file"])
    size, piece_bytes, digests = info["bytes"], info["piece_bytes"], info["sha256_pieces"]
    expected = f"expected {size} bytes in pieces of {piece_bytes}"
    if not (isinstance(piece_bytes, int) and piece_bytes > 0) or len(digests) != piece_count(
        size, piece_bytes
    ):
        raise CheckpointError(f"{path}: its manifest entry does not add up, {expected}")
    try:
        with open_regular(path) as f, Hasher(hashing_threads(size, piece_bytes)) as hasher:
            found = os.fstat(f.fileno()).st_size
            if found != size:
                raise CheckpointError(f"{path} is truncated or grown: {found} bytes, {expected}")
            data = bytearray(size)  # writable: the arrays are views of it
            for piece in cut([memoryview(data)], piece_bytes):
                if any(f.readinto(part) != part.nbytes for part in piece):
                    raise CheckpointError(f"{path} is truncated while read, {expected}")
                hasher.add(piece)
            found = hasher.digests()
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read it ({error.strerror}); {expected}") from None
    for index, (mine, theirs) in enumerate(zip(found, digests)):
        if mine != theirs:
            begin, end = index * piece_bytes, min(size, (index + 1) * piece_bytes)
            raise CheckpointError(
                f"{path} is corrupt: bytes [{begin}, {end}) (piece {index} of {len(digests)}) "
                f"differ from their sha256 {theirs}; {expected}"
            )
    try:
        return parse(data)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path}: a malformed header ({error}); {expected}") from None


def open_regular(path: str):
    """`path` opened for reading if it is a regular file; CheckpointError for anything else
    (a FIFO or a device would block or never end; a symbolic link may lead anywhere). The
    open itself never blocks (O_NONBLOCK) nor follows a link (O_NOFOLLOW)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symbolic link: a shard is a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file: a shard is one")
    return os.fdopen(fd, "rb")


def parse(data: bytearray) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and skeleton of a shard's bytes; ValueError if the header does not hold."""
    if len(data) < 8:
        raise ValueError("shorter than its 8-byte length")
    (length,) = struct.unpack_from("<Q", data)
    if length > len(data) - 8:
        raise ValueError(f"a header of {length} bytes in a file of {len(data)}")
    header = json.loads(bytes(data[8 : 8 + length]))
    if not isinstance(header, dict) or not isinstance(header.get(METADATA), dict):
        raise ValueError(f"no JSON object with a {METADATA} (a minidp shard's skeleton)")
    skeleton = json.loads(header.pop(METADATA)["skeleton"])
    start, arrays, ranges = 8 + length, {}, []
    for name, entry in header.items():
        dtype = dtype_of(entry["dtype"])
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if not all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)):
            raise ValueError(f"{name}: shape {shape}, offsets {begin}, {end}")
        if end - begin != math.prod(shape) * dtype.itemsize:  # exact: no int64 wrap-around
            raise ValueError(f"{name}: {entry} does not hold its shape's bytes")
        ranges.append((begin, end, name))
    covered = 0  # the arrays tile the data, no gap, no overlap, to the file's end
    for begin, end, name in sorted(ranges):
        if begin != covered:
            raise ValueError(f"{name} starts at {begin}, where {covered} was expected")
        covered = end
    if covered != len(data) - start:
        raise ValueError(f"the arrays hold {covered} bytes, the file {len(data) - start}")
    for begin, end, name in ranges:
        entry = header[name]
        raw = np.frombuffer(data, np.uint8, end - begin, start + begin)
        arrays[name] = raw.view(dtype_of(entry["dtype"])).reshape(tuple(entry["shape"]))
    return arrays, skeleton


def state_of(arrays: dict, skeleton: dict):
    """The state tree of a shard read back (tree.unflatten)."""
    return unflatten(arrays, skeleton)
