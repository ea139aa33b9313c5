"""Resharding on load: cut what this rank holds now from what each rank held when saved.

Every array a rank holds is a *slice* of one global tensor: for each dimension, the global
indices it holds, written as runs [lo, hi) (a contiguous chunk is one run, a ZeRO shard one
run per segment, a tensor-parallel weight the heads' columns it owns):

    global (8,)      0 1 2 3 4 5 6 7
    saved, 2 ranks   r0: [[0, 4]]      r1: [[4, 8]]
    loaded, 4 ranks  r0: [[0, 2]]  r1: [[2, 4]]  r2: [[4, 6]]  r3: [[6, 8]]

    rank 1 now: its indices {2, 3} meet saved rank 0's {0..3} at positions 2, 3 there and
    0, 1 here: out[0:2] = shard_0[2:4]; no other shard meets them; all covered.

For each dimension d the intersection of the index sets gives the positions in the source
and in the destination (np.intersect1d), and out[np.ix_(p_d ...)] = src[np.ix_(q_d ...)].
A replicated array is held whole by one shard (and whole here, unless this rank declares a
slice of it); a declaration may name a prefix ("optimizer/state/3/": every array under it,
the moments made at the first step, unknown before it); a rank's own state (a residual, an RNG) has
no slice, and a layout that needs it elsewhere is refused, naming both layouts. Padding is
never state: what each rank saves is exactly the elements it owns.
"""

import numpy as np

from minidp.engine.precision import named_dtype
from minidp.parallel.checkpoint.shards import CheckpointError, read_shard
from minidp.parallel.checkpoint.tree import leaves, put, unflatten


class LayoutMismatch(CheckpointError):
    """A checkpoint whose layout cannot be cut into this run's."""


class Slice:
    """What one rank holds of a global tensor of `shape`: per dimension, runs [lo, hi).
    `part` names which tensor where ranks hold slices of different ones under one name
    (ZeRO over TP: chunks of TP shard t's flat vector): only slices of one part meet."""

    def __init__(self, shape, runs, part: str = ""):
        self.shape, self.part = [int(n) for n in shape], part
        self.runs = [[[int(lo), int(hi)] for lo, hi in dim] for dim in runs]
        if len(self.runs) != len(self.shape):
            raise ValueError(f"a slice of a {len(self.shape)}-d tensor with {len(runs)} dims")

    @classmethod
    def whole(cls, shape) -> "Slice":
        return cls(shape, [[[0, n]] for n in shape])

    @classmethod
    def flat(cls, numel: int, runs, part: str = "") -> "Slice":
        """Ranges of a flat vector of `numel` elements (ZeRO's shard: one per segment)."""
        return cls([numel], [list(runs)], part)

    @classmethod
    def along(cls, shape, axis: int, index) -> "Slice":
        """The indices `index` of dimension `axis`, whole along the others (a TP weight)."""
        runs = [[[0, n]] for n in shape]
        runs[axis] = to_runs(np.asarray(index))
        return cls(shape, runs)

    def as_json(self) -> dict:
        return {
            "shape": self.shape,
            "index": self.runs,
            **({"part": self.part} if self.part else {}),
        }


def to_runs(index: np.ndarray) -> list[list[int]]:
    """[2, 3, 4, 9, 10] -> [[2, 5], [9, 11]]."""
    if index.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [index.size]])
    return [[int(index[s]), int(index[e - 1]) + 1] for s, e in zip(starts, ends)]


def indices(runs) -> np.ndarray:
    return np.concatenate([np.arange(lo, hi) for lo, hi in runs] or [np.zeros(0, np.int64)])


def describe_layout(manifest: dict) -> str:
    return manifest["metadata"].get("layout") or f"{manifest['world_size']} ranks"


def declared_under(layout: dict, name: str):
    """The declaration of the longest prefix of `name` ending in "/" (an optimizer's state
    of one parameter, "optimizer/state/3/", before its first step has made the arrays)."""
    parts = name.split("/")
    for end in range(len(parts) - 1, 0, -1):  # "a/b/c": "a/b/", then "a/"
        if (prefix := "/".join(parts[:end]) + "/") in layout:
            return layout[prefix]
    return None


def holder(saved: dict, own=None) -> int:
    """The rank whose shard holds the replicated array of manifest entry `saved` for rank
    `own` of the layout saved, holding it whole again (None: for any other): the one that
    wrote it (`saved_by`, the lowest of `on`: manifest.py). Without `saved_by` every holder
    wrote its own copy (their copies differed, or format 4): `own`'s, if it held one; else
    the lowest holder's, so every rank cuts its slice from one copy."""
    if "saved_by" in saved:
        return saved["saved_by"]
    return own if own in saved["on"] else saved["on"][0]


def complete(arrays: dict, skeleton: dict, manifest: dict, path: str, reads: dict) -> dict:
    """A shard's `arrays` with every array its skeleton names: those it left to the lower
    rank that wrote them (replicated) read from that rank's shard (`reads`: shards read so
    far, by rank, filled in as needed)."""
    for name in leaves(skeleton):
        if name not in arrays:
            source = holder(manifest["tensors"][name])
            if source not in reads:
                reads[source] = read_shard(path, manifest["shards"][source])[0]
            arrays[name] = reads[source][name]
    return arrays


def assemble(name, manifest: dict, layout: dict, here_words: str, path: str, reads: dict, own):
    """This rank's array `name` cut from the shards that hold it (`reads`: shards read so far,
    by rank, filled in as needed; `here_words`: this run's layout, for a refusal; `own`:
    this rank's shard where the world size is the one saved, else None). Raises
    LayoutMismatch if it cannot be."""
    saved = manifest["tensors"][name]
    where = f"{name} saved over {describe_layout(manifest)}"
    if not saved.get("replicated") and "held" not in saved:
        raise LayoutMismatch(
            f"{where} is each rank's own state (not a slice of one tensor): it loads only in "
            f"that layout, not over {here_words}"
        )
    here = layout.get(name) or declared_under(layout, name)
    if saved.get("replicated"):  # whole in one shard: the one that wrote it
        source = holder(saved, None if isinstance(layout.get(name), dict) else own)
        if source not in reads:
            reads[source] = read_shard(path, manifest["shards"][source])[0]
        whole = reads[source][name]
        if not isinstance(layout.get(name), dict):  # held whole here too
            return whole
        holders = [(source, Slice.whole(whole.shape).as_json()["index"])]
        shape = list(whole.shape)
    elif here is None:
        raise LayoutMismatch(f"{where}: {here_words} does not say how it holds it")
    else:
        shape = saved["shape"]
        part = here.get("part", "") if isinstance(here, dict) else ""
        holders = [
            (r, held["index"])
            for r, held in enumerate(saved["held"])
            if held is not None and held.get("part", "") == part
        ]
    want = Slice.whole(shape).as_json() if here == "replicated" else here
    if want["shape"] != shape:
        raise LayoutMismatch(f"{where} is {shape} globally, over {here_words} {want['shape']}")
    mine = [indices(runs) for runs in want["index"]]
    out = np.empty([len(i) for i in mine], dtype=named_dtype(saved["dtype"]))
    covered = np.zeros(out.shape, dtype=bool)
    for rank, index in holders:
        theirs = [indices(runs) for runs in index]
        meet = [
            np.intersect1d(a, b, assume_unique=True, return_indices=True)[1:]
            for a, b in zip(mine, theirs)
        ]
        if any(len(p) == 0 for p, _ in meet) and out.size:
            continue
        if rank not in reads:
            reads[rank] = read_shard(path, manifest["shards"][rank])[0]
        block = reads[rank][name].reshape([len(t) for t in theirs])
        out[np.ix_(*(p for p, _ in meet))] = block[np.ix_(*(q for _, q in meet))]
        covered[np.ix_(*(p for p, _ in meet))] = True
    if not covered.all():
        raise LayoutMismatch(f"{where}: no shard holds part of what {here_words} needs here")
    return out


def cut_tree(path: str, manifest: dict, layout: dict, here_words: str, rank: int, own=None):
    """This rank's state tree under `layout`, another layout than the one saved: shard
    (rank mod the ranks saved)'s tree, each of its arrays cut for this rank (assemble), and
    each array `layout` declares that this shard lacks put in at its path, taken from a shard
    that holds it: a key saved by any rank is read by any (an expert that another EP rank
    saved). What the shard holds and `layout` does not declare comes as it was saved."""
    source = rank % manifest["world_size"]
    arrays, skeleton = read_shard(path, manifest["shards"][source])
    reads = {source: dict(arrays)}
    for name in leaves(skeleton):  # a replicated one a lower rank wrote too (holder)
        arrays[name] = assemble(name, manifest, layout, here_words, path, reads, own)
    state = unflatten(arrays, skeleton)
    for name in manifest["tensors"]:
        if name not in arrays and (name in layout or declared_under(layout, name)):
            put(state, name, assemble(name, manifest, layout, here_words, path, reads, own))
    return state


def cut(name: str, saved: dict, want, own, shard, manifest: dict) -> np.ndarray:
    """This rank's elements of tensor `name`, as `want` says it holds them ("replicated" or
    None: whole; or a Slice's JSON), from a checkpoint's shards: `saved` is the tensor's
    manifest entry, `shard(r)` rank r's arrays (read once), `own` this rank's shard where
    the world size is the one saved (None otherwise). A slice is cut from the whole tensor,
    put together from every shard that holds part of it; a flat range and a shaped tensor
    of the same size are the same tensor (FSDP's pieces, DDP's parameters)."""
    where = f"{name} saved over {describe_layout(manifest)}"
    if saved.get("replicated"):
        whole = shard(holder(saved, None if isinstance(want, dict) else own))[name]
        return _take(whole, want, where)  # a slice of it: all from one copy
    if "held" not in saved:  # a rank's own state: only where it was saved
        if own is None or name not in shard(own):
            raise LayoutMismatch(
                f"{where} is each rank's own state (not a slice of one tensor): it loads "
                "only over as many ranks as saved it"
            )
        return shard(own)[name]
    shape, held = saved["shape"], saved["held"]
    part = want.get("part", "") if isinstance(want, dict) else ""
    if own is not None and isinstance(want, dict) and held[own] is not None:
        if want["shape"] == shape and want["index"] == held[own]["index"]:
            return shard(own)[name]  # the layout it was saved in: its own shard
    whole = np.empty(shape, dtype=named_dtype(saved["dtype"]))
    covered = np.zeros(shape, dtype=bool)
    for rank, theirs in enumerate(held):
        if theirs is None or theirs.get("part", "") != part:
            continue
        index = [indices(runs) for runs in theirs["index"]]
        whole[np.ix_(*index)] = shard(rank)[name].reshape([len(i) for i in index])
        covered[np.ix_(*index)] = True
    if not covered.all():
        raise LayoutMismatch(f"{where}: the shards do not hold all of it")
    return _take(whole, want, where)


def _take(whole: np.ndarray, want, where: str) -> np.ndarray:
    """The elements of `whole` that `want` names (all of it for "replicated" or None)."""
    if not isinstance(want, dict):
        return whole
    shape = want["shape"]
    if list(whole.shape) != shape:
        if whole.size != int(np.prod(shape)):
            raise LayoutMismatch(f"{where} is {list(whole.shape)} globally, here {shape}")
        whole = whole.reshape(shape)
    return whole[np.ix_(*(indices(runs) for runs in want["index"]))]
