"""load: a state dict filled in place from a checkpoint, whatever layout saved it (the other
half of torch.distributed.checkpoint's save / load; state_dict.py makes the state dicts).

Every array of the state dict given (a Sharded entry's local elements) names its tensor by
its path; the manifest says which ranks hold which elements of it; reshard.cut puts this
rank's elements together from those shards (with the layout it was saved in: its own
shard, and each replicated array from the shard of the rank that wrote it) and they are
written into the array, in place. Plain values (an lr, a step count) are set to the saved
ones. Arrays the checkpoint has and the state dict does not are left out; one the state
dict has and the checkpoint does not is an error.
"""

import numpy as np

from minidp import comm
from minidp.parallel.checkpoint.reshard import LayoutMismatch, cut, declared_under
from minidp.parallel.checkpoint.shards import CheckpointError, read_shard
from minidp.parallel.checkpoint.state_dict import declared, fill_scalars
from minidp.parallel.checkpoint.store import agreed_manifest, patiently, together
from minidp.parallel.checkpoint.tree import flatten, scalars


def load(state_dict, path: str, group: comm.Group) -> None:
    """Collective: fill `state_dict` in place from the checkpoint at `path`, whatever
    layout saved it: each array (a Sharded's local elements) is cut from the shards that
    hold its tensor (reshard.py), each plain value set to the saved one. Every array of
    `state_dict` must be in the checkpoint; any rank's refusal is every rank's."""
    with patiently(group):
        manifest = agreed_manifest(path, group)
        cuts, saved_values = together(lambda: _cut(state_dict, path, manifest, group), group)
    for target, value in cuts:  # only once every rank has all it needs: never half loaded
        target[...] = value
    fill_scalars(state_dict, saved_values)


def _cut(state_dict, path: str, manifest: dict, group: comm.Group):
    """([(target array, its value from the checkpoint)], {path: saved plain value})."""
    tree, layout = declared(state_dict)
    targets, _ = flatten(tree)
    own = group.rank if manifest["world_size"] == group.size else None
    reads: dict[int, dict] = {}  # shards read, by rank: their arrays
    skeletons: dict[int, dict] = {}

    def shard(rank: int) -> dict:
        if rank not in reads:
            reads[rank], skeletons[rank] = read_shard(path, manifest["shards"][rank])
        return reads[rank]

    shard(group.rank % manifest["world_size"])
    cuts = []
    for name, target in targets.items():
        if not isinstance(target, np.ndarray):
            raise CheckpointError(f"{name} is a {type(target).__name__}: load fills NumPy arrays")
        saved = manifest["tensors"].get(name)
        if saved is None:
            raise CheckpointError(f"{name} is not in the checkpoint at {path}")
        want = layout.get(name) or declared_under(layout, name)
        if target.ndim == 0:  # a step count under a sliced parameter's prefix: whole
            want = "replicated"
        value = cut(name, saved, want, own, shard, manifest)
        if value.size != target.size:
            raise LayoutMismatch(
                f"{name}: {value.size} elements saved for this rank, {target.size} to load into"
            )
        cuts.append((target, value.reshape(target.shape)))
    saved_values = {}
    for rank in sorted(skeletons):
        saved_values = scalars(skeletons[rank]) | saved_values
    return cuts, saved_values
