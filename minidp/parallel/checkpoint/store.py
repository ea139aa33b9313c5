"""save / load / latest: a checkpoint directory, one shard per rank and a manifest written last.

    step_000900/
        shard_00000.safetensors ...             each rank's state (shards.py), replicated once
        manifest.json                           written last, by rank 0: the commit marker

The save, on every rank of `group`:
    1. agree on the step (a gather of each rank's): ranks that disagree write nothing;
    2. saving again into a checkpoint, rank 0 removes its manifest.json and fsyncs the
       directory (the rest wait); the ranks tell rank 0 which arrays they hold whole
       (replicated) and their CRC-32s, and each learns which of its own a lower rank holds
       too, byte for byte: the lowest writes each, once (copies that differ: each holder
       its own; manifest.py); then each rank writes its shard (temporary name,
       fsync, rename), hashing the bytes while the disk works (shards.py; a rank that cannot
       write, or whose state or metadata holds what a shard or JSON cannot, says so in
       step 3, and every rank raises it);
    3. rank 0 gathers every shard's {file, bytes, piece_bytes, sha256_pieces} and what
       each holds of each tensor, writes manifest.json.tmp, fsyncs it, renames it to
       manifest.json and fsyncs the directory and the one above it (PyTorch DCP's
       `.metadata` does the same). No manifest, no checkpoint.
Throughout a save or a load the group's waits nap rather than spin (`patiently`).

The manifest records the world size, the step, the caller's metadata (the config, the mesh),
each shard's size and its pieces' checksums (pieces.py), and for each array path its dtype
and either `replicated` (whole on the ranks `on` names, in the shard of `saved_by`, or in
each of theirs where their copies differed), or its
global shape and what each rank holds (`held`: its index and part, see reshard.py), or
neither: the rank's own (a residual), which only the layout it was saved in loads back.

The load reads the manifest, then (every rank) the shards it needs, each checked against
its size and its pieces' SHA-256 before anything is parsed; any rank's refusal is every
rank's, one line. A manifest names its shards by plain file names: one with a separator or
`..` (a path out of the folder) is refused, and a shard that is not a regular file (a
FIFO, a device, a symbolic link) is refused without blocking on it (shards.open_regular).
With the layout it was saved in, a rank reads its own shard (and the replicated arrays a
lower rank wrote for it, from that rank's shard: reshard.complete); with another, `layout` says
what this rank holds now and reshard.py cuts it from the shards that hold it.
"""

import contextlib
import json
import os
import warnings

import numpy as np

from minidp import comm
from minidp.parallel.checkpoint.manifest import entry, merge, place, place_of, replicas
from minidp.parallel.checkpoint.reshard import LayoutMismatch, complete, cut_tree, describe_layout
from minidp.parallel.checkpoint.shards import CheckpointError, read_shard, state_of, write_shard
from minidp.parallel.checkpoint.state_dict import declared

MANIFEST = "manifest.json"
FORMAT = "minidp-checkpoint/5"  # 5: a replicated array written once ("saved_by"); 4: all
# its ranks wrote it ("on"), read too; 3: the optimizer by index; 2: a SHA-256 per file; 1: .npz
READS = (FORMAT, "minidp-checkpoint/4")
SHARD_KEYS = ("file", "bytes", "piece_bytes", "sha256_pieces")


@contextlib.contextmanager
def patiently(group: comm.Group):
    """The group's waits nap instead of spinning (p2p.py) while a save or load runs: a rank
    that is done waits on others still writing, hashing or reading, and on a machine with
    more ranks than cores its spinning would take their cores (docs/checkpoints.md times a
    save both ways)."""
    patient, group.patient = group.patient, True
    try:
        yield
    finally:
        group.patient = patient


def save(state, path: str, group: comm.Group, *, step: int = 0, layout=None, metadata=None):
    """Collective: write this rank's `state` (a tree of dicts, lists, arrays and scalars;
    get_state_dict's Sharded entries and StateDicts declare how they are held) to
    `path`/shard_NNNNN.safetensors, then rank 0 commits the manifest. `layout`: {array path:
    "replicated" or a Slice (or its JSON)} for what else can be resharded (an array nothing
    declares is the rank's own); `metadata`: any JSON the manifest keeps (the config)."""
    state, layout = declared(state, layout)
    with patiently(group):
        _save(state, path, group, step, layout, metadata)


def _save(state, path: str, group: comm.Group, step: int, layout, metadata) -> None:
    manifest_path = os.path.join(path, MANIFEST)
    mine = np.array([step, os.path.exists(manifest_path)], dtype=np.int64)
    steps, old = comm.allgather(mine, group=group).reshape(-1, 2).T
    if (steps != steps[0]).any():
        raise CheckpointError(f"ranks disagree on the step to save: {steps.tolist()}")
    if old.any():  # saving again into a checkpoint: it is none until the new one commits,
        if group.rank == 0 and os.path.exists(manifest_path):
            os.remove(manifest_path)
            fsync_directory(path)  # even after a crash: gone for good before a shard changes
        comm.barrier(group=group)
    whole = replicas(state, layout, group)  # the same bytes: only the lowest holder writes
    elsewhere = {name for name, e in whole.items() if e.get("saved_by", group.rank) != group.rank}
    try:  # a full disk on one rank: every rank raises it, none waits for the others
        json.dumps(metadata or {})  # what the manifest cannot hold: refused before any write
        os.makedirs(path, exist_ok=True)
        info, arrays = write_shard(state, path, group.rank, leave_out=elsewhere)
        tensors = {name: entry(layout, name, a) for name, a in arrays.items()} | whole
        mine = json.dumps({**info, "rank": group.rank, "tensors": tensors})
    except OSError as error:
        mine = f"rank {group.rank} cannot write its shard in {path}: {error.strerror}"
    except (TypeError, ValueError) as error:  # what is not data: a set, a complex array
        mine = f"rank {group.rank} cannot save its state: {error}"
    except Exception as error:  # anything else (a thread that cannot start): still a line
        mine = f"rank {group.rank} cannot save its state: {type(error).__name__}: {error}"
    every = comm.gather_text(mine, root=0, group=group)
    verdict = ""
    if group.rank == 0:
        verdict = next((text for text in every if not text.startswith("{")), "")
        if not verdict:
            shards = [json.loads(text) for text in every]
            manifest = {
                "format": FORMAT,
                "step": int(step),
                "world_size": group.size,
                "metadata": metadata or {},
                "shards": [{k: s[k] for k in SHARD_KEYS} for s in shards],
                "tensors": merge([s["tensors"] for s in shards]),
            }
            try:
                _commit(manifest, path)
            except OSError as error:
                verdict = f"cannot write {manifest_path}: {error.strerror}"
    verdict = comm.broadcast_text(verdict, root=0, group=group)  # none returns before the commit
    if verdict:
        raise CheckpointError(verdict)


def _commit(manifest: dict, path: str) -> None:
    """Write manifest.json atomically and durably: temporary name, fsync, rename, fsync the
    directory and the one above it (where a new step directory was made)."""
    final = os.path.join(path, MANIFEST)
    with open(final + ".tmp", "w") as f:
        f.write(json.dumps(manifest))  # one line: json's C encoder (indent= is Python's)
        f.flush()
        os.fsync(f.fileno())
    os.replace(final + ".tmp", final)
    fsync_directory(path)  # the manifest's name and every shard's (renamed in it) on disk
    fsync_directory(os.path.dirname(os.path.abspath(path)))  # and the directory's own


def fsync_directory(path: str) -> None:
    """Make the names in directory `path` durable (a rename or removal in it is not until
    then)."""
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at `path` (local: every rank reads it itself)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} has no {MANIFEST}: not a checkpoint, or one whose save never finished"
        ) from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}/{MANIFEST} cannot be read: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READS:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        reads = " or ".join(READS)
        raise CheckpointError(f"{path}/{MANIFEST} is {found}, this minidp reads {reads}")
    shards = manifest.get("shards")
    fields = ("step", "world_size", "tensors")
    if (
        any(key not in manifest for key in fields)
        or not isinstance(shards, list)
        or len(shards) != manifest["world_size"]
        or any(not isinstance(s, dict) or any(k not in s for k in SHARD_KEYS) for s in shards)
    ):
        raise CheckpointError(
            f"{path}/{MANIFEST} is incomplete: it needs {', '.join(fields)} and, for each of "
            f"world_size shards, {', '.join(SHARD_KEYS)}"
        )
    for index, shard in enumerate(shards):  # a name in this folder, never a path elsewhere
        name = shard["file"]
        plain = isinstance(name, str) and name not in ("", ".", "..")
        if not plain or any(c in name for c in "/\\\0"):
            raise CheckpointError(
                f"{path}/{MANIFEST}: shard {index}'s file {name!r} is not a plain file name "
                "in the checkpoint's folder (a manifest may not point elsewhere)"
            )
    return manifest


def read(path: str, group: comm.Group, layout=None, here: str = ""):
    """Collective: this rank's state from the checkpoint at `path`, as its tree was saved
    (load() fills a state dict in place instead). Saved over as many ranks
    with the same layout, each rank reads its own shard; otherwise `layout` ({array path:
    "replicated" or a Slice's JSON}, what this rank holds now) says what to cut from the
    shards (reshard.py), and what cannot be resharded is refused naming both layouts
    (`here`: this run's, in words; "N ranks" unless given)."""
    with patiently(group):
        manifest = agreed_manifest(path, group)
        here = here or f"{group.size} ranks"
        return together(lambda: _load(path, manifest, group, layout, here), group)


def agreed_manifest(path: str, group: comm.Group) -> dict:
    """Collective: the manifest at `path` (each rank's own `path`), refused on every rank if
    any rank cannot read its own, or if they are of different steps (ranks that each found
    "the newest" checkpoint on a filesystem that showed them different ones)."""
    with patiently(group):
        manifest = together(lambda: read_manifest(path), group)
        steps = comm.allgather(np.array([manifest["step"]], dtype=np.int64), group=group)
    steps = steps.ravel()
    if (steps != steps[0]).any():
        raise CheckpointError(
            f"ranks disagree on the step to load, by rank {steps.tolist()} "
            f"(here {path}, step {manifest['step']})"
        )
    return manifest


def _load(path: str, manifest: dict, group: comm.Group, layout, here: str):
    shards, saved = manifest["shards"], manifest["world_size"]
    own = group.rank if saved == group.size else None
    if own is not None and (
        layout is None
        or all(
            place(layout, n, t["ndim"]) == place_of(t, own) for n, t in manifest["tensors"].items()
        )
    ):
        arrays, skeleton = read_shard(path, shards[own])  # and what lower ranks wrote for it
        return state_of(complete(arrays, skeleton, manifest, path, {own: arrays}), skeleton)
    if not layout:
        raise LayoutMismatch(
            f"{path} was saved over {describe_layout(manifest)}; {here} says nothing of how "
            "its state is cut: cannot reshard"
        )
    return cut_tree(path, manifest, layout, here, group.rank, own)  # reshard.py


def together(work, group: comm.Group):
    """Run `work` on every rank; if it raises on any (a CheckpointError, or any other
    Exception, turned into one), raise it on every rank (the first rank's line), so no rank
    goes on to load while another refused."""
    try:
        result, line = work(), ""
    except CheckpointError as error:
        result, line = None, f"{type(error).__name__}\t{error}"
    except Exception as error:  # any other failure is a refusal too, on every rank
        result, line = None, f"CheckpointError\t{type(error).__name__}: {error}"
    lines = comm.gather_text(line, root=0, group=group)
    first = next((text for text in lines if text), "") if group.rank == 0 else ""
    first = comm.broadcast_text(first, root=0, group=group)
    if first:
        kind, message = first.split("\t", 1)
        raise (LayoutMismatch if kind == LayoutMismatch.__name__ else CheckpointError)(message)
    return result


def latest(directory: str) -> str | None:
    """The newest complete checkpoint (step_NNNNNN with a manifest) in `directory`, or None;
    a step directory without a manifest is skipped with a warning (its save never finished)."""
    if not os.path.isdir(directory):
        return None
    steps = sorted(  # by number: step_1000000 is newer than step_999999
        (n for n in os.listdir(directory) if n.startswith("step_") and n[5:].isdigit()),
        key=lambda name: int(name[5:]),
        reverse=True,
    )
    for name in steps:
        candidate = os.path.join(directory, name)
        if os.path.exists(os.path.join(candidate, MANIFEST)):
            return candidate
        warnings.warn(f"{candidate} has no {MANIFEST} (an unfinished save): skipped", stacklevel=2)
    return None


def step_directory(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:06d}")
