"""Checkpoints: each rank writes its own shard, rank 0 commits a manifest last.

    from minidp.parallel import checkpoint
    model_sd, optim_sd = checkpoint.get_state_dict(ddp, opt)     # what this rank holds
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.save(state, "run/step_000900", group, step=900)   # collective
    checkpoint.load(state, checkpoint.latest("run"), group)      # in place, any layout
    checkpoint.set_state_dict(ddp, opt, model_state_dict=state["model"],
                              optim_state_dict=state["optim"])
    tree = checkpoint.read(path, group)    # a tree as this rank saved it (same layout)

`state` is this rank's tree of dicts, lists, NumPy arrays and plain scalars (a strategy's
state_dict()); state_dict.py's entries say which slice of which tensor each array is.
Read in this order: tree.py (a tree as named arrays and a JSON skeleton: no pickle
anywhere), shards.py (one rank's safetensors file, hashed as written, checked before it is
read), store.py (save, read, latest, the manifest as commit marker), state_dict.py
(the pieces' state dicts: get_state_dict, set_state_dict), in_place.py (load: a state dict
filled in place, any layout), reshard.py (a checkpoint saved
over one layout cut into another's slices), lock.py (one job at a time in a folder),
preemption.py (SIGTERM and its kin: every rank saves the same step, then stops: Preempted), rng.py
(the random streams a resumed run must draw on as before).
"""

from minidp.parallel.checkpoint.in_place import load
from minidp.parallel.checkpoint.lock import FolderInUse, folder_lock
from minidp.parallel.checkpoint.preemption import Preempted, Preemption
from minidp.parallel.checkpoint.reshard import LayoutMismatch, Slice
from minidp.parallel.checkpoint.rng import rng_states, set_rng_states
from minidp.parallel.checkpoint.shards import CheckpointError
from minidp.parallel.checkpoint.state_dict import (
    Sharded,
    StateDict,
    get_state_dict,
    set_state_dict,
)
from minidp.parallel.checkpoint.store import (
    MANIFEST,
    agreed_manifest,
    latest,
    read,
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
    "Preempted",
    "Preemption",
    "Sharded",
    "StateDict",
    "Slice",
    "agreed_manifest",
    "folder_lock",
    "get_state_dict",
    "latest",
    "load",
    "read",
    "read_manifest",
    "rng_states",
    "save",
    "set_rng_states",
    "set_state_dict",
    "step_directory",
    "together",
]
