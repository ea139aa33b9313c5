"""Checkpoints of the pieces, in torch.distributed.checkpoint's shape: every entry of a
state dict knows which slice of which whole tensor this rank holds, so a checkpoint saved
over one layout loads into any other (N -> M ranks, FSDP -> DDP, TP 2 -> 1, 4 pipeline
stages -> 2).

    model_sd, optim_sd = get_state_dict(fsdp, opt)        # what this rank holds, by name
    checkpoint.save({"model": model_sd, "optim": optim_sd}, path, group, step=3)
    ...                                                   # later, any wrapping, any ranks
    model_sd, optim_sd = get_state_dict(ddp, opt)         # what this rank will hold
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.load(state, path, group)                   # filled in place, resharded
    set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

`model` is what you train: a DistributedDataParallel, a FullyShardedDataParallel, or a
module (a TP model, a pipeline stage's part: `RankStages` or `stage.module`). The keys are
the parameters' names in the whole model (a tied weight under each of its names; a TP
layer given `name="fc1."` under that name), so the same key means the same tensor
whichever wrapper saved it. The values:

    an array           the whole tensor, the same on every rank that holds it (DDP's
                       replicas, a frozen parameter, a pipeline stage's own): "replicated"
    Sharded(local, where)   this rank's elements of it: a TP weight's columns
                       (`Slice.along`), FSDP's or ZeRO's range of the flattened parameter
                       (`Slice.flat(p.size, [(lo, hi)])`)

Both are the pieces' own arrays, not copies (as PyTorch's state dicts share storage): a
load in place writes into the model and the optimizer directly, and set_state_dict then
only does what follows a load (FSDP's "grad_op" gathers the whole parameters again). The
optimizer's: {"state": {name: {"m": ..., "v": ..., "step": ...}}, "param_groups": [{"lr",
"hyper", "step_count"}]}, its per-parameter state made (zeros) where no step has run, as
PyTorch's get_state_dict does, so that there is something to load into.

What each rank declares goes into the manifest (store.py): a replicated array with the
ranks that hold it, a slice with its runs; any layout's slices are cut from them
(reshard.py), a flat range and a shaped tensor of the same size being the same tensor.
"""

from typing import NamedTuple

import numpy as np

from minidp.engine.backend import is_torch, to_numpy
from minidp.engine.nn import Module
from minidp.parallel.checkpoint.reshard import Slice
from minidp.parallel.checkpoint.tree import SCALARS
from minidp.parallel.checkpoint.tree import join_path as _join


class Sharded(NamedTuple):
    """This rank's elements `local` of a whole tensor, and which ones they are (`where`)."""

    local: np.ndarray
    where: Slice


class StateDict(dict):
    """A dict of a piece's state whose `layout` says how each array path under it is held
    ("replicated" or a Slice), for what save and load make of it."""

    layout: dict

    def __init__(self, *args, layout=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.layout = dict(layout or {})


def placement_slice(p) -> Slice | None:
    """A TP parameter's slice of the whole (its `placement`), None where it is whole."""
    placement = getattr(p, "placement", None)
    if placement is None or placement.axis is None:
        return None
    shape = list(p.shape)
    shape[placement.axis] = placement.length
    return Slice.along(shape, placement.axis, placement.index)


def whole_name(name: str, p) -> str:
    """The parameter's name in the whole model: a TP layer's `name=` when it was given one
    (its placement's name is then not the bare attribute), else its name here."""
    placement = getattr(p, "placement", None)
    if placement is not None and placement.name and placement.name != name.rsplit(".", 1)[-1]:
        return placement.name
    return name


def model_entries(model) -> list[tuple[str, object, Slice | None]]:
    """(whole name, the Tensor with this rank's elements, their Slice or None: whole), for
    every parameter this rank holds, under each of a tied weight's names."""
    if hasattr(model, "piece_places"):  # FSDP: its pieces, and the frozen parameters whole
        names = {}
        for name, p in model.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        out = [
            (name, piece, Slice.flat(p.size, [(lo, hi)]))
            for piece, (p, lo, hi) in zip(model.parameters(), model.piece_places())
            for name in names[id(p)]
        ]
        frozen = [
            (name, p, None)
            for name, p in model.model.named_parameters(remove_duplicate=False)
            if not p.requires_grad
        ]
        return out + frozen
    module = model
    for attr in ("model", "module"):  # a wrapper (DDP) or a PipelineStage: what it wraps
        inner = getattr(model, attr, None)
        if isinstance(inner, Module) and not isinstance(model, Module):
            module = inner
    return [
        (whole_name(name, p), p, placement_slice(p))
        for name, p in module.named_parameters(remove_duplicate=False)
    ]


def _optimizers(optimizers) -> list:
    if optimizers is None:
        return []
    return list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]


def optimizer_entries(optimizer, places: dict) -> tuple[object, list[tuple[str, Slice | None]]]:
    """(the minidp optimizer that holds the state, (name, Slice or None) of each of its
    parameters), from `places` ({id(Tensor): (name, Slice)}, the model's entries);
    ZeroRedundancyOptimizer's pieces are its parameters' flat ranges."""
    if hasattr(optimizer, "piece_places"):
        if any(id(p) not in places for p, _, _ in optimizer.piece_places()):
            raise ValueError(
                "the ZeroRedundancyOptimizer's parameters are not the model's (give "
                "get_state_dict the model it steps)"
            )
        if any(places[id(p)][1] is not None for p, _, _ in optimizer.piece_places()):
            raise ValueError(
                "ZeroRedundancyOptimizer over tensor-parallel slices: its ranges are of each "
                "rank's slice, not of the whole tensor, and would not reshard"
            )
        names = [places[id(p)][0] for p, _, _ in optimizer.piece_places()]
        where = [Slice.flat(p.size, [(lo, hi)]) for p, lo, hi in optimizer.piece_places()]
        return optimizer.optimizer, list(zip(names, where))
    missing = [i for i, p in enumerate(optimizer.params) if id(p) not in places]
    if missing:
        raise ValueError(
            f"the optimizer's parameters {missing} are not the model's (give get_state_dict "
            "the wrapper you train: its parameters are what the optimizer steps)"
        )
    return optimizer, [places[id(p)] for p in optimizer.params]


def get_state_dict(model, optimizers=None) -> tuple[StateDict, StateDict]:
    """(model state dict, optimizer state dict) of what this rank holds; see the module
    doc. `optimizers`: one optimizer or a list (a ZeroRedundancyOptimizer too); their
    per-parameter state is made where no step has made it yet."""
    entries = model_entries(model)
    model_sd, layout, places = StateDict(), {}, {}
    owner: dict[str, int] = {}
    for name, tensor, where in entries:
        if owner.setdefault(name, id(tensor.data)) != id(tensor.data):
            raise ValueError(f"two parameters would be saved as {name!r} (two TP layers "
                             "given one name=?): each name must be one tensor")  # fmt: skip
        data = _host(tensor.data)
        model_sd[name] = data if where is None else Sharded(data, where)
        layout[name] = "replicated" if where is None else where
        places.setdefault(id(tensor), (name, where))
    model_sd.layout = layout
    state, optim_layout, groups = {}, {}, []
    for optimizer in _optimizers(optimizers):
        inner, named = optimizer_entries(optimizer, places)
        inner.init_state()
        for (name, where), per_param in zip(named, inner.state):
            state[name] = {
                key: _host(value)
                if where is None or np.ndim(value) == 0
                else Sharded(_host(value), where)
                for key, value in per_param.items()
            }
            optim_layout[f"state/{name}/"] = "replicated" if where is None else where
        groups.append({"lr": inner.lr, "hyper": dict(inner.hyper), "step_count": inner.step_count})
    return model_sd, StateDict({"state": state, "param_groups": groups}, layout=optim_layout)


def set_state_dict(model, optimizers=None, *, model_state_dict=None, optim_state_dict=None):
    """Put these state dicts (get_state_dict's, loaded) into `model` and `optimizers`:
    each entry copied into the piece's array unless it is that array already (a load in
    place), then what follows a load (FSDP "grad_op": the whole parameters gathered again
    before the next forward)."""
    entries = model_entries(model)
    if model_state_dict is not None:
        for name, tensor, _ in entries:
            if name not in model_state_dict:
                raise KeyError(f"model_state_dict has no {name!r}")
            _copy_into(tensor.data, model_state_dict[name], name)
        if hasattr(model, "state_loaded"):
            model.state_loaded()
    if optim_state_dict is None:
        return
    places = {}
    for name, tensor, where in entries:
        places.setdefault(id(tensor), (name, where))
    groups = optim_state_dict["param_groups"]
    for optimizer, group in zip(_optimizers(optimizers), groups, strict=True):
        inner, named = optimizer_entries(optimizer, places)
        inner.init_state()
        for (name, _), per_param in zip(named, inner.state):
            saved = optim_state_dict["state"][name]
            for key, value in saved.items():
                if np.ndim(per_param.get(key, value)) == 0:
                    per_param[key] = np.array(value[0] if isinstance(value, Sharded) else value)
                else:
                    _copy_into(per_param[key], value, f"{name}/{key}")
        inner.lr, inner.hyper = group["lr"], dict(group["hyper"])
        inner.step_count = group["step_count"]


def _host(a):
    """A NumPy array as it is (the piece's own); a torch tensor (--backend torch) as a host
    copy, which set_state_dict copies back."""
    return np.array(to_numpy(a)) if is_torch(a) else a


def _copy_into(target, value, name: str) -> None:
    """`value` (an array, or a Sharded's local elements) into `target`, in place."""
    local = value.local if isinstance(value, Sharded) else value
    if local is target:
        return
    local = np.asarray(local)
    if tuple(local.shape) != tuple(target.shape):
        raise ValueError(f"{name}: {local.shape} to load into {tuple(target.shape)}")
    if is_torch(target):  # --backend torch: onto the tensor's device
        target.copy_(target.new_tensor(local))
    else:
        target[...] = local


def declared(state, layout=None) -> tuple[object, dict]:
    """(the tree with each Sharded as its local array, {array path: "replicated" or a
    Slice's JSON}): what the Sharded leaves and the StateDicts' layouts declare, under
    their paths, then `layout`'s own entries."""
    found: dict = {}

    def walk(x, path: str):
        if isinstance(x, Sharded):
            found[path] = x.where
            return x.local
        if isinstance(x, dict):
            for key, where in getattr(x, "layout", {}).items():
                found.setdefault(_join(path, key), where)
            return {k: walk(v, _join(path, k)) for k, v in x.items()}
        if isinstance(x, list | tuple):
            items = [walk(v, _join(path, i)) for i, v in enumerate(x)]
            return items if isinstance(x, list) else tuple(items)
        return x

    tree = walk(state, "")
    found |= layout or {}
    return tree, {k: w.as_json() if isinstance(w, Slice) else w for k, w in found.items()}


def fill_scalars(state, saved: dict) -> None:
    """Each plain value of `state` (a number, a string; not an array) set, in place, to
    `saved`'s at its path (a tuple is rebuilt in its parent)."""

    def walk(x, path: str):
        if isinstance(x, SCALARS):
            return saved.get(path, x)
        if isinstance(x, dict):
            for k in list(x):
                x[k] = walk(x[k], _join(path, k))
        elif isinstance(x, list):
            for i in range(len(x)):
                x[i] = walk(x[i], _join(path, i))
        elif isinstance(x, tuple) and not isinstance(x, Sharded):
            return tuple(walk(v, _join(path, i)) for i, v in enumerate(x))
        return x

    walk(state, "")
