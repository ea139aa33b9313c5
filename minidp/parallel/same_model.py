"""Before data parallelism starts: do all ranks hold the same model? One allgather of a
checksum of every parameter's name, shape, dtype, frozen flag and whether it is deferred
(deferred_init); on a difference, every rank raises ModelMismatch naming the first parameter
that differs and the rank that has it (DDP, ZeRO and FSDP check so at construction). Then
`broadcast_parameters` starts every rank from rank 0's weights.
"""

import json
import zlib

import numpy as np

from minidp import comm
from minidp.engine.deferred import Recipe, is_deferred
from minidp.engine.nn import Module


class ModelMismatch(RuntimeError):
    """The ranks do not hold the same model (names, shapes or parameter count)."""


def describe_model(model: Module) -> list[str]:
    """One line per parameter: name, shape, dtype, and whether it is frozen."""
    return [
        f"{name} {tuple(p.shape)} {p.dtype}"
        + ("" if p.requires_grad else " frozen")
        + (" deferred" if is_deferred(p) else "")
        for name, p in model.named_parameters()
    ]


def check_same_model(model: Module, group: comm.Group, deferred_ok: bool = False) -> None:
    """Raise ModelMismatch on every rank if any rank's parameter list differs from rank 0's;
    ValueError on every rank for a model built under deferred_init unless `deferred_ok`
    (the sharding pieces draw each rank's part; the others need the values)."""
    mine = describe_model(model)
    digest = np.array([zlib.crc32("\n".join(mine).encode()), len(mine)], dtype=np.int64)
    digests = comm.allgather(digest, group=group).reshape(group.size, 2)
    if (digests == digests[0]).all():
        if not deferred_ok and any(is_deferred(p) for p in model.parameters()):  # alike
            raise ValueError(
                "the model was built under deferred_init(): draw its values first "
                "(nn.materialize_module(model)), or shard it with FullyShardedDataParallel"
            )
        return
    theirs = comm.broadcast_text("\n".join(mine), root=0, group=group).split("\n")
    first = next(
        (i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs))
    )
    firsts = comm.allgather(np.array([first if mine != theirs else -1]), group=group).ravel()
    culprit = int(np.flatnonzero(firsts >= 0)[0])
    index = int(firsts[culprit])
    mine_there = mine[index] if index < len(mine) else "(no parameter)"
    theirs_there = comm.broadcast_text(mine_there, root=culprit, group=group)
    ours = theirs[index] if index < len(theirs) else "(no parameter)"
    raise ModelMismatch(
        f"ranks hold different models: rank {culprit} has {int(digests[culprit, 1])} parameters, "
        f"rank 0 has {int(digests[0, 1])}; first difference at parameter #{index}: "
        f"rank 0 has {ours!r}, rank {culprit} has {theirs_there!r}"
    )


def broadcast_parameters(params, group: comm.Group) -> None:
    """Collective: every rank's `params` set to rank 0's, as every rank must start from the
    same weights. Each one's values broadcast into its own array; for the deferred ones
    (deferred_init: no values yet, check_same_model agrees which) rank 0's recipes instead,
    a few hundred bytes each (a generator's state), in one message: the weights they draw
    are rank 0's, whichever rank draws which part."""
    deferred = [p for p in params if is_deferred(p)]
    if deferred:
        mine = json.dumps([p.recipe.as_json() for p in deferred]) if group.rank == 0 else ""
        recipes = json.loads(comm.broadcast_text(mine, root=0, group=group))
        for p, recipe in zip(deferred, recipes):
            p.recipe = Recipe.from_json(recipe)
    for p in params:
        if not is_deferred(p):
            comm.broadcast(p.data, root=0, group=group)
