"""Checkpoints: each rank writes its own shard, rank 0 commits a manifest last.

    from minidp.parallel import checkpoint
    checkpoint.save(state, "run/step_000900", group, step=900)   # collective
    state = checkpoint.load(checkpoint.latest("run"), group)     # the newest complete one

`state` is this rank's tree of dicts, lists, NumPy arrays and plain scalars (a strategy's
state_dict()). Read in this order: tree.py (a tree as named arrays and a JSON skeleton: no
pickle anywhere), shards.py (one rank's safetensors file, hashed as written, checked before it is
read), store.py (save, load, latest, the manifest as commit marker), reshard.py (a
checkpoint saved over one layout cut into another's slices), lock.py (one job at a time in
a folder), preemption.py (SIGTERM and its kin: every rank saves the same step, then stops),
rng.py (the random streams a resumed run must draw on as before).
"""

from minidp.parallel.checkpoint.lock import FolderInUse, folder_lock
from minidp.parallel.checkpoint.preemption import Preemption
from minidp.parallel.checkpoint.reshard import LayoutMismatch, Slice
from minidp.parallel.checkpoint.rng import rng_states, set_rng_states
from minidp.parallel.checkpoint.shards import CheckpointError
from minidp.parallel.checkpoint.store import (
    MANIFEST,
    agreed_manifest,
    latest,
    load,
    read_manifest,
    save,
    step_directory,
    together,
)

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "FolderInUse",
    "LayoutMismatch",
    "Preemption",
    "Slice",
    "agreed_manifest",
    "folder_lock",
    "latest",
    "load",
    "read_manifest",
    "rng_states",
    "save",
    "set_rng_states",
    "step_directory",
    "together",
]
