"""The checkpoint format (minidp.parallel.checkpoint): a state tree as arrays and a JSON
skeleton, no pickle; each rank's shard checked against the manifest before it is read; the
manifest as commit marker; a refusal on one rank is a refusal on every rank; resharding a
flat (ZeRO-like) and a tensor-parallel (column) slice over 4, 2 and 1 ranks in one launch."""

import json
import os
import shutil
import tempfile
import warnings

import numpy as np
import pytest

from minidp import comm
from minidp.parallel import checkpoint
from minidp.parallel.checkpoint import CheckpointError, LayoutMismatch, Slice
from minidp.parallel.checkpoint.reshard import to_runs
from minidp.parallel.checkpoint.tree import flatten, unflatten

STATE = {
    "model": {"wte.weight": np.arange(6.0).reshape(2, 3), "scale": np.float32(1.5)},
    "optimizer": {"state": [{"m": np.ones(3, np.float32)}], "step_count": 3, "lr": 0.1 / 3},
    "rounds": {0: 2, (1, "a"): 3},  # int and tuple keys, as the compressors' buckets
    "rng": {"state": 2**127 + 5, "name": "PCG64", "none": None, "pair": (1, 2.5)},
}


def same(a, b) -> None:
    """Trees equal leaf for leaf, arrays bit for bit with their dtype."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert a == b


def test_a_tree_is_named_arrays_and_a_json_skeleton():
    arrays, skeleton = flatten(STATE)
    assert list(arrays) == ["model/wte.weight", "model/scale", "optimizer/state/0/m"]
    same(unflatten(arrays, json.loads(json.dumps(skeleton))), STATE)


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"x": np.array([object()])}, "x: an array of Python objects is not data"),
        ({"x": {1.5: 2}}, "a dict key 1.5 (float)"),
        ({"x": {"y": set()}}, "x/y: a set is not data"),
    ],
)
def test_what_is_not_data_is_refused(bad, words):
    with pytest.raises((TypeError, ValueError)) as error:
        flatten(bad)
    assert words in str(error.value)


def test_runs_compress_an_index():
    assert to_runs(np.array([2, 3, 4, 9, 10])) == [[2, 5], [9, 11]]
    assert Slice.along((4, 6), 1, [0, 1, 4]).as_json()["index"] == [[[0, 4]], [[0, 2], [4, 5]]]


def shared_directory(group) -> str:
    """A fresh directory every rank of `group` names (made by rank 0)."""
    path = tempfile.mkdtemp(prefix="minidp-ckpt-") if group.rank == 0 else ""
    return comm.broadcast_text(path, root=0, group=group)


def remove(root: str, group) -> None:
    """Collective: rank 0 removes `root` once every rank is done with it."""
    comm.barrier(group=group)
    if group.rank == 0:
        shutil.rmtree(root)


def refused_everywhere(work, words: str, kind=CheckpointError) -> None:
    with pytest.raises(kind) as error:
        work()
    assert words in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parallel(nprocs=[2])
def test_save_load_and_every_refusal_on_every_rank():
    group = comm.world()
    root = shared_directory(group)
    path = checkpoint.step_directory(root, 2)
    mine = {**STATE, "rank": group.rank, "own": np.full(3, group.rank)}
    checkpoint.save(mine, path, group, step=2, metadata={"layout": "two ranks"})
    assert checkpoint.latest(root) == path
    same(checkpoint.read(path, group), mine)
    manifest = checkpoint.read_manifest(path)
    assert manifest["world_size"] == 2 and manifest["tensors"]["own"].get("private")

    refused_everywhere(  # ranks that disagree on the step write nothing
        lambda: checkpoint.save(mine, path + "x", group, step=group.rank), "disagree on the step"
    )
    assert not os.path.exists(path + "x")
    blocked = os.path.join(root, "blocked")  # rank 1's shard cannot take its final name
    if group.rank == 0:
        os.makedirs(os.path.join(blocked, "shard_00001.safetensors"))
    comm.barrier(group=group)
    refused_everywhere(
        lambda: checkpoint.save(mine, blocked, group, step=2), "rank 1 cannot write its shard"
    )
    assert not os.path.exists(os.path.join(blocked, checkpoint.MANIFEST))
    odd = {**mine, "own": np.zeros(2, complex)} if group.rank == 1 else mine
    refused_everywhere(  # a dtype a shard does not hold, on one rank: every rank refuses
        lambda: checkpoint.save(odd, path + "c", group, step=2),
        "rank 1 cannot save its state: own: a complex128 array; a checkpoint holds bool",
    )

    told = {"steps": np.int64(2)} if group.rank == 1 else {}  # not JSON, on one rank
    refused_everywhere(  # by each rank before its shard (none waits on rank 0's manifest)
        lambda: checkpoint.save(mine, path + "m", group, step=2, metadata=told),
        "rank 1 cannot save its state: Object of type int64 is not JSON serializable",
    )
    assert not os.path.exists(os.path.join(path + "m", checkpoint.MANIFEST))
    assert group.patient is False  # the refused save's naps end with it (store.patiently)

    shard = os.path.join(path, "shard_00001.safetensors")
    data = open(shard, "rb").read()
    info = manifest["shards"][1]
    if group.rank == 0:  # one bit flipped in rank 1's shard: rank 1 finds it, all refuse
        with open(shard, "r+b") as f:
            f.seek(len(data) // 2)
            f.write(bytes([data[len(data) // 2] ^ 1]))
    comm.barrier(group=group)
    refused_everywhere(  # a small shard: one piece, the whole file
        lambda: checkpoint.read(path, group),
        f"{shard} is corrupt: bytes [0, {len(data)}) (piece 0 of 1) differ from their sha256 "
        f"{info['sha256_pieces'][0]}; expected {len(data)} bytes in pieces of 16777216",
    )
    comm.barrier(group=group)
    if group.rank == 0:
        with open(shard, "wb") as f:
            f.write(data[:100])
    comm.barrier(group=group)
    refused_everywhere(lambda: checkpoint.read(path, group), f"{shard} is truncated")

    other = checkpoint.step_directory(root, 3)  # rank 1 sees another "newest" checkpoint
    checkpoint.save(mine, other, group, step=3)
    refused_everywhere(
        lambda: checkpoint.read(path if group.rank == 0 else other, group),
        "ranks disagree on the step to load, by rank [2, 3]",
    )

    later = checkpoint.step_directory(root, 4)  # a save that never committed
    if group.rank == 0:
        os.makedirs(later)
    comm.barrier(group=group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checkpoint.latest(root) == other
    assert "step_000004 has no manifest.json" in str(caught[0].message)
    refused_everywhere(lambda: checkpoint.read(later, group), "has no manifest.json")
    assert group.patient is False
    remove(root, group)


@pytest.mark.parallel(nprocs=[4])
def test_a_sliced_tensor_reshards_over_4_2_and_1_ranks():
    """A flat vector cut as ZeRO cuts it (two segments, each chunked over the ranks) and a
    (4, 6) weight cut by columns as TP cuts it, saved over 4 ranks and over 2, loaded over
    2, 1 and 4; a rank's own array refused when the layout changes, naming both."""
    world = comm.world()
    flat, weight = np.arange(11.0), np.arange(24.0).reshape(4, 6)
    segments = [(0, 7), (7, 11)]

    def layout(group):
        ranks = [comm.chunk_range(hi - lo, group.size, group.rank) for lo, hi in segments]
        flat_runs = [(lo + a, lo + b) for (lo, _), (a, b) in zip(segments, ranks)]
        columns = np.arange(6).reshape(2, 3)[:, slice(*comm.chunk_range(3, group.size, group.rank))]
        places = {"flat": Slice.flat(11, flat_runs), "w": Slice.along((4, 6), 1, columns.ravel())}
        state = {
            "flat": np.concatenate([flat[a:b] for a, b in flat_runs]),
            "w": weight[:, columns.ravel()],
            "step_count": 7,
        }
        return state, {k: v.as_json() for k, v in places.items()} | {"bias": "replicated"}

    root = shared_directory(world)
    for saved_size, loaded_sizes in ((4, (2, 1)), (2, (4, 1))):
        path = os.path.join(root, f"saved_over_{saved_size}")
        saver = world.split(world.rank // saved_size)
        state, places = layout(saver)
        if world.rank < saved_size:
            checkpoint.save({**state, "bias": np.ones(2)}, path, saver, step=7, layout=places)
        comm.barrier(group=world)
        for size in loaded_sizes:
            group = world.split(world.rank // size) if size < 4 else world
            want, places = layout(group)
            got = checkpoint.read(path, group, layout=places)
            same(got, {**want, "bias": np.ones(2)})
            if size == 1:
                with pytest.raises(LayoutMismatch, match="cannot reshard"):
                    checkpoint.read(path, group)
    path = os.path.join(root, "own")
    checkpoint.save(
        {"own": np.full(2, world.rank)}, path, world, step=1, metadata={"layout": "dp 4"}
    )
    half = world.split(world.rank // 2)
    refused_everywhere(
        lambda: checkpoint.read(path, half, layout={"x": "replicated"}),
        "own saved over dp 4 is each rank's own state (not a slice of one tensor): it loads "
        "only in that layout, not over 2 ranks",
        LayoutMismatch,
    )
    remove(root, world)


@pytest.mark.parallel(nprocs=[2])
def test_replicated_state_is_written_once_and_every_rank_reads_it():
    """What two ranks hold whole and the same (DDP's model) is in rank 0's shard only: the
    manifest names both ranks (`on`) and the one that wrote it (`saved_by`); rank 1's shard
    holds its own state and a skeleton that names the rest. What is declared replicated but
    differs (a mask that drifted) is in both shards, with no `saved_by`: each rank reads its
    own copy back, and a layout that cuts it otherwise takes rank 0's. A read in the same
    layout, a read in another over as many ranks, a load in place and a load over one rank
    each get that; and again after the checkpoint is rewritten as format 4 wrote it (each
    replicated array in every holder's shard, no `saved_by`)."""
    from minidp.parallel.checkpoint.shards import read_shard

    group = comm.world()
    root = shared_directory(group)
    path = os.path.join(root, "once")
    weight = np.arange(4096.0)  # 32 KiB, the same on both ranks
    drift = np.full(5, 0.5 + group.rank, np.float32)  # "replicated", yet not the same
    part = np.arange(3.0) + 3 * group.rank  # this rank's half of a (6,) vector
    mine = {"model": {"w": weight, "mask": drift}, "part": part, "step": 2}
    layout = {"model/w": "replicated", "model/mask": "replicated"}
    halves = {**layout, "part": Slice.flat(6, [(3 * group.rank, 3 * group.rank + 3)]).as_json()}
    checkpoint.save(mine, path, group, step=2, layout=halves)
    manifest = checkpoint.read_manifest(path)
    w, mask = manifest["tensors"]["model/w"], manifest["tensors"]["model/mask"]
    assert w["on"] == mask["on"] == [0, 1] and w["saved_by"] == 0 and "saved_by" not in mask
    held = [read_shard(path, shard)[0] for shard in manifest["shards"]]
    assert sorted(held[0]) == ["model/mask", "model/w", "part"]
    assert sorted(held[1]) == ["model/mask", "part"]
    same(held[group.rank]["model/mask"], drift)
    sizes = [shard["bytes"] for shard in manifest["shards"]]
    assert sizes[0] - sizes[1] >= weight.nbytes > sizes[1]  # once, not twice
    lowest = {"w": weight, "mask": np.full(5, 0.5, np.float32)}  # rank 0's mask
    for version in (5, 4):
        if version == 4:
            as_format_4(path, mine, group)
            assert "model/w" in read_shard(path, checkpoint.read_manifest(path)["shards"][1])[0]
        same(checkpoint.read(path, group), mine)  # rank 1: its shard, and w from rank 0's
        whole = {**layout, "part": Slice.whole([6]).as_json()}  # another layout, 2 ranks
        same(checkpoint.read(path, group, layout=whole), {**mine, "part": np.arange(6.0)})
        into = {"model": {"w": np.zeros_like(weight), "mask": np.zeros_like(drift)}}
        checkpoint.load(into, path, group)
        same(into, {"model": mine["model"]})
        lo, hi = 3 * group.rank, 3 + 2 * group.rank  # the mask cut over the 2 ranks:
        cut = {**whole, "model/mask": Slice.flat(5, [(lo, hi)]).as_json()}  # rank 0's copy
        same(checkpoint.read(path, group, layout=cut)["model"]["mask"], lowest["mask"][lo:hi])
        alone = group.split(group.rank)  # over one rank: w and the lowest holder's mask
        same(
            checkpoint.read(path, alone, layout=whole),
            {**mine, "model": lowest, "part": np.arange(6.0)},
        )
        into = {"model": {"w": np.zeros_like(weight), "mask": np.zeros_like(drift)}}
        checkpoint.load(into, path, alone)
        same(into, {"model": lowest})
    remove(root, group)


def as_format_4(path: str, state, group) -> None:
    """Collective: rewrite the checkpoint at `path` as format 4 wrote it: each rank's shard
    holds every array of its `state` (those replicated too), the manifest no `saved_by`."""
    from minidp.parallel.checkpoint.shards import write_shard
    from minidp.parallel.checkpoint.store import SHARD_KEYS

    comm.barrier(group=group)  # nobody rewrites a shard another rank may still be reading
    info, _ = write_shard(state, path, group.rank)
    every = comm.gather_text(json.dumps(info), root=0, group=group)
    if group.rank == 0:
        manifest = checkpoint.read_manifest(path)
        manifest["format"] = "minidp-checkpoint/4"
        manifest["shards"] = [{k: json.loads(text)[k] for k in SHARD_KEYS} for text in every]
        for tensor in manifest["tensors"].values():
            tensor.pop("saved_by", None)
        with open(os.path.join(path, checkpoint.MANIFEST), "w") as f:
            json.dump(manifest, f)
    comm.barrier(group=group)


def test_latest_orders_steps_by_number(tmp_path):
    from minidp.parallel.checkpoint.store import MANIFEST, latest

    for step in (999999, 1000000):
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / MANIFEST).write_text("{}")
    assert latest(str(tmp_path)).endswith("step_1000000")


def test_a_shard_is_the_safetensors_layout_and_a_malformed_header_is_refused(tmp_path):
    """8 bytes of header length, a JSON header (dtype, shape, data_offsets; the skeleton in
    __metadata__), the raw bytes; a header that lies about its data is refused by name even
    when the manifest's checksum matches it (a file made by hand)."""
    import hashlib
    import struct

    from minidp.parallel.checkpoint.shards import read_shard, write_shard

    info, _ = write_shard(STATE, str(tmp_path), 0)
    data = (tmp_path / info["file"]).read_bytes()
    assert [hashlib.sha256(data).hexdigest()] == info["sha256_pieces"]
    assert len(data) == info["bytes"] and info["piece_bytes"] == 16 << 20
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    assert (8 + length) % 8 == 0 and header["model/wte.weight"] == {
        "dtype": "F64", "shape": [2, 3], "data_offsets": [0, 48]
    }  # fmt: skip
    assert header["model/scale"]["shape"] == [] and "skeleton" in header["__metadata__"]
    same(unflatten(*read_shard(str(tmp_path), info)), STATE)
    for lie, told in (("[2, 3]", "[2, 9]"), ('"F64"', '"X64"')):  # the same length
        bad = data.replace(lie.encode(), told.encode())
        (tmp_path / "bad").write_bytes(bad)
        sha = hashlib.sha256(bad).hexdigest()
        told = {"file": "bad", "bytes": len(bad), "piece_bytes": len(bad), "sha256_pieces": [sha]}
        with pytest.raises(CheckpointError) as error:
            read_shard(str(tmp_path), told)
        words = str(error.value)
        assert f"{tmp_path / 'bad'}: a malformed header (" in words and "\n" not in words
        assert words.endswith(f"expected {len(bad)} bytes in pieces of {len(bad)}"), words


def test_a_failed_write_or_read_leaves_no_thread_and_no_temporary_file(tmp_path, monkeypatch):
    """A shard big enough to be hashed by threads (32 MiB in 4 MiB pieces, 4 threads): when
    its temporary name is taken, the write fails before anything is hashed; when the disk
    fails at fsync, with the pieces hashing, the threads are joined and the temporary file
    removed; when its final name is taken, the temporary file is removed. A load that
    finds a corrupt piece (or a file cut short) joins its threads too."""
    import threading

    from minidp.parallel.checkpoint import pieces
    from minidp.parallel.checkpoint.shards import read_shard, shard_name, write_shard

    monkeypatch.setattr(pieces, "cores_per_rank", lambda: 4.0)  # 4 threads
    hashing = lambda: [t for t in threading.enumerate() if t.name.startswith("minidp-hash")]  # noqa: E731
    state = {"x": np.ones(4 << 20)}
    for taken in (shard_name(0) + ".tmp", shard_name(0)):
        (tmp_path / taken).mkdir()
        before = threading.active_count()
        with pytest.raises(OSError):
            write_shard(state, str(tmp_path), 0, piece_bytes=4 << 20)
        assert threading.active_count() == before and not hashing(), taken
        assert [p.name for p in tmp_path.iterdir()] == [taken]
        (tmp_path / taken).rmdir()

    def failing_disk(fd):
        assert hashing()  # the pieces are hashing (beside the write, or during fsync)
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", failing_disk)
        with pytest.raises(OSError, match="Input/output error"):
            write_shard(state, str(tmp_path), 0, piece_bytes=4 << 20)
    assert not hashing() and list(tmp_path.iterdir()) == []
    info, _ = write_shard(state, str(tmp_path), 0, piece_bytes=4 << 20)
    assert len(info["sha256_pieces"]) == 9 and not hashing()  # 32 MiB and the header
    shard = tmp_path / info["file"]
    data = bytearray(shard.read_bytes())
    data[(5 << 20) + 7] ^= 1  # a bit of piece 1, [4 MiB, 8 MiB)
    shard.write_bytes(data)
    with pytest.raises(CheckpointError) as error:
        read_shard(str(tmp_path), info)
    assert (
        f"{shard} is corrupt: bytes [4194304, 8388608) (piece 1 of 9) differ from their "
        f"sha256 {info['sha256_pieces'][1]}; expected {len(data)} bytes in pieces of 4194304"
    ) == str(error.value)
    assert not hashing()


def test_pieces_are_the_sha256_of_the_files_byte_ranges(tmp_path):
    """Each digest is the SHA-256 of its piece of the file (pieces across the header and
    the arrays, the last one shorter); a manifest entry whose pieces do not add up to its
    size is refused before the file is read."""
    import hashlib

    from minidp.parallel.checkpoint.pieces import cut
    from minidp.parallel.checkpoint.shards import read_shard, write_shard

    info, _ = write_shard(STATE, str(tmp_path), 0, piece_bytes=100)
    data = (tmp_path / info["file"]).read_bytes()
    ranges = range(0, len(data), 100)
    assert info["sha256_pieces"] == [hashlib.sha256(data[i : i + 100]).hexdigest() for i in ranges]
    same(unflatten(*read_shard(str(tmp_path), info)), STATE)
    parts = [memoryview(b"abc"), memoryview(b""), memoryview(b"defgh")]
    assert [[bytes(p) for p in piece] for piece in cut(parts, 3)] == [[b"abc"], [b"def"], [b"gh"]]
    assert [[bytes(p) for p in piece] for piece in cut(parts, 4)] == [[b"abc", b"d"], [b"efgh"]]
    for wrong in ({"piece_bytes": 0}, {"sha256_pieces": info["sha256_pieces"][:-1]}):
        with pytest.raises(CheckpointError, match="its manifest entry does not add up"):
            read_shard(str(tmp_path), {**info, **wrong})


def test_a_manifest_of_an_older_format_is_refused_naming_both(tmp_path):
    (tmp_path / checkpoint.MANIFEST).write_text(json.dumps({"format": "minidp-checkpoint/2"}))
    with pytest.raises(CheckpointError) as error:
        checkpoint.read_manifest(str(tmp_path))
    assert str(error.value) == (
        f"{tmp_path}/manifest.json is minidp-checkpoint/2, "
        "this minidp reads minidp-checkpoint/5 or minidp-checkpoint/4"
    )


def test_a_header_whose_arrays_do_not_tile_the_data_is_refused(tmp_path):
    """The arrays' byte ranges cover the data exactly: a gap, an overlap or bytes past the
    last array are refused, as is an array named like the header's own __metadata__ key."""
    import struct

    from minidp.parallel.checkpoint.shards import parse, write_shard

    def shard(entries: dict, data_bytes: int) -> bytearray:
        header = {**entries, "__metadata__": {"skeleton": "{}"}}
        text = json.dumps(header).encode()
        return bytearray(struct.pack("<Q", len(text)) + text + bytes(data_bytes))

    a = {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}
    assert parse(shard({"a": a}, 8))[0]["a"].tolist() == [0.0]
    cases = {
        "b starts at 16, where 8 was expected": (
            {"a": a, "b": {**a, "data_offsets": [16, 24]}},
            24,
        ),
        "b starts at 0, where 8 was expected": ({"a": a, "b": a}, 8),
        "the arrays hold 8 bytes, the file 16": ({"a": a}, 16),
        "does not hold its shape's bytes": ({"a": {**a, "shape": [2**62, 4]}}, 8),
    }
    for words, (entries, size) in cases.items():
        with pytest.raises(ValueError, match=words):
            parse(shard(entries, size))
    with pytest.raises(CheckpointError, match="an array named __metadata__"):
        write_shard({"__metadata__": np.zeros(1)}, str(tmp_path), 0)


def test_a_manifest_missing_a_shards_fields_is_refused(tmp_path):
    from minidp.parallel.checkpoint.store import FORMAT

    manifest = {"format": FORMAT, "step": 1, "world_size": 1, "tensors": {}}
    for shards in ([{"file": "shard_00000.safetensors", "bytes": 8}], [], "x"):
        (tmp_path / checkpoint.MANIFEST).write_text(json.dumps({**manifest, "shards": shards}))
        with pytest.raises(CheckpointError, match="is incomplete: it needs step, world_size"):
            checkpoint.read_manifest(str(tmp_path))


@pytest.mark.parametrize("early", [False, True])
def test_the_early_writeback_writes_the_plain_writes_bytes(tmp_path, monkeypatch, early):
    """early_writeback.py's trick (the disk started on each piece as it is written, the
    hash beside the write) and the plain write (then the hash, while fsync waits) leave the
    same file and the same digests: 9 MiB in 1 MiB pieces, hashed by 2 threads."""
    from minidp.parallel.checkpoint import early_writeback, pieces, shards

    monkeypatch.setattr(pieces, "cores_per_rank", lambda: 2.0)
    monkeypatch.setattr(early_writeback, "cores_per_rank", lambda: 2.0)
    monkeypatch.setattr(shards, "EARLY_WRITEBACK", early and early_writeback.available())
    advised = []
    if early_writeback.available():  # count the advice the early path gives, one per piece
        fadvise = os.posix_fadvise
        monkeypatch.setattr(os, "posix_fadvise", lambda *a: advised.append(a) or fadvise(*a))
    state = {"x": np.arange(9 << 17, dtype=np.float64), "y": np.ones(3, np.int32)}
    info, _ = shards.write_shard(state, str(tmp_path), 0, piece_bytes=1 << 20)
    assert len(advised) == (10 if shards.EARLY_WRITEBACK else 0)
    data = (tmp_path / info["file"]).read_bytes()
    monkeypatch.setattr(shards, "EARLY_WRITEBACK", False)
    (tmp_path / "plain").mkdir()
    plain, _ = shards.write_shard(state, str(tmp_path / "plain"), 0, piece_bytes=1 << 20)
    assert data == (tmp_path / "plain" / info["file"]).read_bytes() and info == plain
    assert len(info["sha256_pieces"]) == 10  # 9 MiB and the header
    same(unflatten(*shards.read_shard(str(tmp_path), info)), state)


def test_the_saves_group_has_no_fingerprints_and_keeps_the_deadline(monkeypatch):
    """training/resume.py's saves_group: a dup without checks, whose deadline is the one
    the group had (timeout follows checks unless set: 300 s with, none without)."""
    from minidp.cli.training.resume import saves_group

    for timeout in (None, "7"):
        if timeout is None:
            monkeypatch.delenv("MINIDP_TIMEOUT", raising=False)
        else:
            monkeypatch.setenv("MINIDP_TIMEOUT", timeout)
        group = comm.Group(comm.world().comm, checks=True)
        saves = saves_group(group)
        assert saves.checks is False and saves.timeout == group.timeout is not None
        assert saves.timeout == (300 if timeout is None else 7), saves.timeout
        saves.free()
