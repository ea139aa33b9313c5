"""What the manifest says of each array: how it is held, by which ranks, in whose shard.

    "model/fc1.weight": {"dtype": "<f4", "ndim": 2, "replicated": true,
                         "on": [0, 1, 2, 3], "saved_by": 0}          whole on every rank
    "strategy/shard":   {"dtype": "<f8", "ndim": 1, "shape": [6512],
                         "held": [{"index": [[[0, 1628]]]}, ...]}    a slice per rank
    "strategy/residual": {"dtype": "<f4", "ndim": 1, "private": true}  each rank's own

**Replicated state is written once.** Under data parallelism every rank holds the same
model and optimizer state; writing it from each of P ranks would put P identical copies on
disk (the same SHA-256 P times). As PyTorch's DCP does (its planner's dedup), the lowest
rank holding each replicated array writes it and the others leave it out of their shard:
their shard's skeleton still names it, and the manifest's `saved_by` says whose shard
holds it. `on` still lists every rank that held it, so a load over the layout it was saved
in knows the layout is the same, and takes the array from the `saved_by` shard
(reshard.holder). A DP checkpoint over P ranks thus holds the model's bytes once: shard 0
the model and moments, shards 1..P-1 only their skeletons and private state.

Only the same bytes are written once. The ranks exchange each replicated array's dtype,
shape and CRC-32 (zlib, over its bytes), not its name alone: an array declared replicated
whose holders' copies differ (a layout's mistake, a mask that drifted, ranks that
diverged) is written by every holder, as in format 4, and its entry has no `saved_by`:
each holder reads its own copy back; a load that cuts it into another layout takes the
lowest holder's (reshard.holder). A wrong "replicated" costs disk, never state.
"""

import json
import zlib

import numpy as np

from minidp import comm
from minidp.engine.precision import dtype_name as named
from minidp.parallel.checkpoint.reshard import declared_under
from minidp.parallel.checkpoint.tree import flatten


def place(layout, name: str, ndim: int) -> dict:
    """What `layout` says of array `name`; under a prefix, a 0-d array (a step count) is the
    same on every rank: replicated."""
    where = (layout or {}).get(name)
    if where is None and (where := declared_under(layout or {}, name)) is not None and not ndim:
        where = "replicated"
    return {"replicated": True} if where == "replicated" else {"slice": where} if where else {}


def place_of(tensor: dict, rank: int) -> dict:
    """What a manifest entry says `rank` held, as `place` says it of a layout."""
    if tensor.get("replicated"):  # on this rank's shard, or not there (another's expert)
        return {"replicated": True} if rank in tensor.get("on", [rank]) else {}
    if "held" in tensor:
        return {"slice": {"shape": tensor["shape"], **tensor["held"][rank]}}
    return {}


def entry(layout, name: str, array) -> dict:
    """Array `name`'s entry in a rank's part of the manifest: dtype, ndim and its place."""
    array = np.asarray(array)
    # "<f4" and the like; bfloat16 by name (its .str, "<V2", reads back as raw bytes)
    return {"dtype": named(array.dtype), "ndim": array.ndim, **place(layout, name, array.ndim)}


def replicas(state, layout, group: comm.Group) -> dict[str, dict]:
    """Collective: {path: entry} of this rank's replicated arrays, each with `saved_by`,
    the lowest rank of `group` that holds it, where every holder's copy has the same dtype,
    shape and CRC-32 (that rank writes it; the others leave it out of their shard); none
    where they differ (each holder writes its own). A state that cannot be flattened counts
    as holding none: write_shard says why."""
    try:
        arrays, _ = flatten(state)
        mine = {n: entry(layout, n, a) for n, a in arrays.items()}
        mine = {n: e for n, e in mine.items() if e.get("replicated")}
        marks = {n: [e["dtype"], np.shape(arrays[n]), crc32(arrays[n])] for n, e in mine.items()}
    except Exception:  # never leave the others waiting in the gather: write_shard says why
        mine, marks = {}, {}
    every = comm.gather_text(json.dumps(marks), root=0, group=group)
    every = json.loads(comm.broadcast_text(json.dumps(every or []), root=0, group=group))
    every = [json.loads(text) for text in every]
    for name, e in mine.items():
        copies = [(rank, held[name]) for rank, held in enumerate(every) if name in held]
        if all(mark == copies[0][1] for _, mark in copies):  # the same bytes: written once
            e["saved_by"] = copies[0][0]
    return mine


def crc32(array) -> int:
    """zlib's CRC-32 of the array's bytes (C order): a few GB/s, cheap beside the SHA-256
    the shard's pieces get anyway."""
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def merge(per_rank: list[dict]) -> dict:
    """{path: {dtype, ndim, and replicated with on (the ranks that hold it) and saved_by
    (the one whose shard has it; none if their copies differ), or shape and held: [{index,
    part} of rank r, or None]}}."""
    merged = {}
    for rank, tensors in enumerate(per_rank):
        for name, t in tensors.items():
            entry = merged.setdefault(name, {"dtype": t["dtype"], "ndim": t["ndim"]})
            if t.get("replicated"):
                entry["replicated"] = True
                entry.setdefault("on", []).append(rank)  # the ranks that hold it whole
                if "saved_by" in t:  # the lowest holder, the one that wrote it (the same
                    entry["saved_by"] = t["saved_by"]  # on each); none: each holder did
            elif t.get("slice"):
                entry["shape"] = t["slice"]["shape"]
                held = {k: v for k, v in t["slice"].items() if k != "shape"}  # index, part
                entry.setdefault("held", [None] * len(per_rank))[rank] = held
            else:
                entry["private"] = True
    return merged
