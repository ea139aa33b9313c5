"""A tensor-parallel plan for a model you built, in PyTorch's names:

    from minidp.parallel.tensor_parallel import ColwiseParallel, RowwiseParallel, gather_full
    model = parallelize_module(model, tp_group, {
        "fc1": ColwiseParallel(),                      # its output features split
        "fc2": RowwiseParallel(),                      # its input features; outputs summed
        "blocks.0.attn.qkv": ColwiseParallel(),        # an attention's heads
        "blocks.0.attn.proj": RowwiseParallel(),
    })
    ...train...
    whole = gather_full(model)                         # {name: whole array}, every rank

Each planned name (dotted, nested) must be an nn.Linear; it is replaced in its parent by the
layer of layers.py built from it, so every rank keeps its slice of the same weights:

    ColwiseParallel   ColumnParallelLinear: W[:, cols_r], b[cols_r]; the input passes
                      through f (copy forward, allreduce of its gradient backward); the
                      output stays split along its last axis
    RowwiseParallel   RowParallelLinear: W[rows_r, :]; takes an input split along its last
                      axis (a Colwise layer's output), its outputs summed over the group (g),
                      then the bias, whole on every rank, added once

Which slice rank r holds (chunk_range: contiguous, sizes differing by at most one):

    features n over p ranks    rank r holds [r n // p ... (r + 1) n // p), the first n % p
                               ranks one more
    an attention's qkv         a Linear named "qkv" in a module with `n_head` (q, k and v side
                               by side, C features each): rank r holds its heads' features in
                               each of the three, and the module's n_head becomes the rank's
                               own head count (PyTorch asks you to divide it yourself). A
                               fused q/k/v Linear by another name would be cut as plain
                               features: name it qkv, or plan separate q, k, v Linears

Between a Colwise and a Rowwise layer only elementwise work may run (an activation): what
reads the whole feature axis (a LayerNorm) must come before the Colwise or after the
Rowwise one. Every parameter keeps a `placement` (its whole name, the axis it is split
along, its indices): checkpoint.get_state_dict saves the slices under the whole names, and
gather_full puts the whole model back. Dropout between the split layers is not made
per-rank here (TensorParallelGPT does it): plan models without dropout there.
"""

import numpy as np

from minidp import comm
from minidp.engine import nn
from minidp.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    head_features,
)


class ColwiseParallel:
    """Split a Linear's output features over the group (ColumnParallelLinear)."""

    def apply(self, full: nn.Linear, group: comm.Group, name: str, parent) -> nn.Module:
        columns = None
        n_head = getattr(parent, "n_head", None)
        C = full.weight.shape[1] // 3
        if name.rsplit(".", 2)[-2] == "qkv" and n_head and full.weight.shape[1] == 3 * C:
            features = head_features(n_head, C // n_head, group)  # this rank's heads
            columns = np.concatenate([features, C + features, 2 * C + features])
            layer = ColumnParallelLinear(full, group, name=name, columns=columns)
            parent.n_head = n_head // group.size  # last: once the layer is built
            return layer
        return ColumnParallelLinear(full, group, name=name, columns=columns)


class RowwiseParallel:
    """Split a Linear's input features over the group (RowParallelLinear): its input is a
    Colwise layer's split output; its outputs are summed over the group."""

    def apply(self, full: nn.Linear, group: comm.Group, name: str, parent) -> nn.Module:
        return RowParallelLinear(full, group, name=name)


def parallelize_module(model: nn.Module, group: comm.Group, plan: dict) -> nn.Module:
    """Replace each Linear named in `plan` ({dotted name: ColwiseParallel() or
    RowwiseParallel()}) by its parallel layer over `group`; returns `model`. Every rank
    must build `model` alike (one seed) and pass the same plan."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a minidp.nn.Module, got {type(model).__name__}")
    planned = []  # every entry checked first: a bad plan changes nothing
    for name, style in plan.items():
        if not isinstance(style, ColwiseParallel | RowwiseParallel):
            raise TypeError(f"plan[{name!r}] must be ColwiseParallel() or RowwiseParallel()")
        *path, attr = name.split(".")
        parent = model
        for part in path:
            parent = _child(parent, part, name)
        full = _child(parent, attr, name)
        if not isinstance(full, nn.Linear):
            raise TypeError(f"plan[{name!r}]: {type(full).__name__} is not an nn.Linear")
        mine = {id(p) for p in full.parameters()}
        prefix = name + "."
        shared = [n for n, p in model.named_parameters(remove_duplicate=False)
                  if id(p) in mine and not n.startswith(prefix)]  # fmt: skip
        if shared:  # its slices are copies: the other user would lose the tie
            raise ValueError(f"plan[{name!r}]: its parameters are shared with {shared}")
        n_head = getattr(parent, "n_head", None)
        if attr == "qkv" and n_head and (full.weight.shape[1] // 3) % n_head:
            raise ValueError(f"plan[{name!r}]: its {full.weight.shape[1]} features do not "
                             f"split into q, k, v of {n_head} heads")  # fmt: skip
        planned.append((name, style, parent, attr, full))
    for name, style, parent, attr, full in planned:
        layer = style.apply(full, group, name + ".", parent)
        if isinstance(parent, list):
            parent[int(attr)] = layer
        else:
            setattr(parent, attr, layer)
    model.tp_group = group
    return model


def _child(parent, part: str, name: str):
    child = parent[int(part)] if part.isdigit() and isinstance(parent, list) else None
    child = child if child is not None else getattr(parent, part, None)
    if child is None:
        raise ValueError(f"plan names {name!r}: the model has no {part!r} there")
    return child


def gather_full(model: nn.Module) -> dict[str, np.ndarray]:
    """Collective over the model's TP group: {whole name: whole array} of every parameter,
    on every rank (what a plain copy of the model loads with load_state_dict)."""
    group = getattr(model, "tp_group", None)
    if group is None:
        raise ValueError("gather_full: the model was not parallelized (parallelize_module)")
    whole = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        place = getattr(p, "placement", None)
        if place is None or place.axis is None:
            whole[name] = np.array(p.data)
            continue
        shape = list(p.shape)
        shape[place.axis] = place.length
        full = np.zeros(shape, p.dtype)  # my slice in zeros; the sum over the group fills in
        index = [slice(None)] * full.ndim  # the rest (adding zeros is exact)
        index[place.axis] = place.index
        full[tuple(index)] = p.data
        whole[name] = comm.allreduce(full, group=group)
    return whole
