"""ZeRO's flat parameter vector, cut into segments, and each rank's shard of every segment.

All the model's Ψ parameters, laid end to end, are one flat vector. It is cut into
*segments* (the gradient buckets at stages 1 and 2, one segment per layer at stage 3), and
each segment into N chunks with chunk_bounds, one per rank of the data-parallel group:

    flat      | segment 0 (n0 = 10)     | segment 1 (n1 = 5) |
    N = 4     | 0 1 2 | 3 4 5 | 6 7 | 8 9 | 0 1 | 2 | 3 | 4  |
    rank        r0      r1      r2    r3    r0   r1  r2  r3

    rank r owns chunk r of every segment: [o_s + b_s[r], o_s + b_s[r + 1]) for each s,
    with o_s the segment's offset and b_s = chunk_bounds(n_s, N)

Why per segment, not one chunk of the whole vector: a segment is what one collective moves
(a bucket's reduce-scatter, a layer's allgather), and `reduce_scatter` / `allgather` cut
their vector by chunk_bounds; so rank r's piece of segment s is exactly what those
collectives give it, with no copy. Chunks differ by at most one element, so Ψ need not
divide by N, and a chunk boundary falls wherever it falls, inside a tensor or not.

The optimizer updates the shard through one *piece* per segment: a Tensor whose .data is a
view of this rank's parameter chunk and whose .grad a view of its gradient chunk. AdamW and
SGD are elementwise, so stepping the pieces is stepping those elements of the whole model.
"""

import numpy as np

from minidp import comm
from minidp.engine.deferred import flat_values
from minidp.engine.tensor import Tensor
from minidp.tools.chunks import chunk_bounds


class ShardLayout:
    """Where every parameter lies in the flat vector, and which ranges rank r owns.

    `segments`: lists of parameters (each parameter in exactly one), in flat order; `names`
    the dotted name of each parameter (to line up another copy of the model, in tests)."""

    def __init__(self, segments: list[list], names: dict[int, str], size: int, rank: int):
        self.segments, self.size, self.rank = segments, size, rank
        self.order = [names[id(p)] for seg in segments for p in seg]  # flat order, by name
        self.lengths = [sum(p.size for p in seg) for seg in segments]
        self.offsets = np.cumsum([0, *self.lengths]).tolist()  # o_s
        self.bounds = [chunk_bounds(n, size) for n in self.lengths]  # b_s
        self.chunks = [(b[rank], b[rank + 1]) for b in self.bounds]  # mine, within segment s
        self.chunk_sizes = [hi - lo for lo, hi in self.chunks]
        self.shard_offsets = np.cumsum([0, *self.chunk_sizes]).tolist()  # in my shard
        self.numel = self.offsets[-1]  # Ψ
        self.shard_numel = self.shard_offsets[-1]  # about Ψ / N

    def ranges(self) -> list[tuple[int, int]]:
        """This rank's [lo, hi) ranges of the flat vector, one per segment."""
        return [(o + lo, o + hi) for o, (lo, hi) in zip(self.offsets, self.chunks)]

    def flatten(self, named: dict[str, np.ndarray]) -> np.ndarray:
        """The flat vector of a model's parameters {name: array}, in this layout's order."""
        return np.concatenate([np.ravel(named[name]) for name in self.order])

    def shard_of(self, flat: np.ndarray) -> np.ndarray:
        """This rank's elements of a whole flat vector, concatenated: what its shard holds."""
        return np.concatenate([flat[lo:hi] for lo, hi in self.ranges()])

    def shard_of_parameters(self, dtype) -> np.ndarray:
        """What shard_of(the flat vector) gives, copied straight from the segments'
        parameters, one at a time: no whole flat vector is ever made (stage 3 would hold
        the model twice while it shards it). A deferred parameter (deferred_init) gives only
        the elements in this rank's chunks, drawn from its recipe: never a whole weight."""
        shard = np.empty(self.shard_numel, dtype)
        for s, ((lo, hi), params) in enumerate(zip(self.chunks, self.segments)):
            flat_values(params, lo, hi, dtype, out=self.my_chunk(shard, s))
        return shard

    def segment_views(self, array: np.ndarray, s: int) -> list[np.ndarray]:
        """Views into `array` (segment s, flat) shaped as the segment's parameters."""
        views, offset = [], 0
        for p in self.segments[s]:
            views.append(array[offset : offset + p.size].reshape(p.shape))
            offset += p.size
        return views

    def my_chunk(self, shard: np.ndarray, s: int) -> np.ndarray:
        """This rank's chunk of segment s within a shard-sized array (a view)."""
        return shard[self.shard_offsets[s] : self.shard_offsets[s + 1]]


def flat_parameters(layout: ShardLayout, dtype) -> np.ndarray:
    """Copy the model's parameters into one flat array and make each `p.data` a view of it
    (stages 1 and 2 keep all Ψ; then a segment's allgather writes straight into the model).
    A deferred parameter is drawn from its recipe straight into its place."""
    flat = np.empty(layout.numel, dtype=dtype)
    for s, params in enumerate(layout.segments):
        segment = flat[layout.offsets[s] : layout.offsets[s + 1]]
        flat_values(params, 0, segment.size, dtype, out=segment)
        for p, view in zip(params, layout.segment_views(segment, s)):
            p.data, p.recipe = view, None
    return flat


def allgather_flat(flat: np.ndarray, layout: ShardLayout, group: comm.Group, algo: str) -> None:
    """Collective: every segment's chunks to every rank, in place in the whole flat vector
    (stages 1 and 2: each rank has updated its chunks, the rest of `flat` is stale)."""
    for s, (lo, hi) in enumerate(layout.chunks):
        segment = flat[layout.offsets[s] : layout.offsets[s + 1]]
        comm.allgather(segment[lo:hi], algo=algo, group=group, out=segment)


def gather_whole(layout: ShardLayout, chunks: list[np.ndarray], group: comm.Group, algo: str):
    """Collective: each segment whole, in a new array of its own, from every rank's chunk of
    it (`chunks[s]`, this rank's): {id(parameter): its value, a view of that array}."""
    whole = {}
    for s, mine in enumerate(chunks):
        segment = np.empty(layout.lengths[s], mine.dtype)
        comm.allgather(mine, algo=algo, group=group, out=segment)
        for p, view in zip(layout.segments[s], layout.segment_views(segment, s)):
            whole[id(p)] = view
    return whole


def slices_in(params: list, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(i, start, stop): the elements [start, stop) of params[i] (flattened) that fall in
    [lo, hi) of the params laid end to end (a chunk of a segment); none for an empty chunk."""
    out, offset = [], 0
    for i, p in enumerate(params):
        start, stop = max(lo, offset), min(hi, offset + p.size)
        if start < stop:
            out.append((i, start - offset, stop - offset))
        offset += p.size
    return out


def chunk_slices(layout: ShardLayout) -> list[list[tuple]]:
    """Per segment: (parameter, the slice of this rank's chunk that holds part of it), for
    each parameter with elements in the chunk. A chunk edge falls anywhere, so a slice may
    cover part of a tensor."""
    out = []
    for (lo, hi), params in zip(layout.chunks, layout.segments):
        mine, offset = [], 0
        for p in params:
            a, b = max(lo, offset), min(hi, offset + p.size)
            if a < b:
                mine.append((p, slice(a - lo, b - lo)))
            offset += p.size
        out.append(mine)
    return out


def pieces(param_chunks: list[np.ndarray], grad_chunks: list[np.ndarray]) -> list[Tensor]:
    """One Tensor per segment over this rank's chunks (data and grad are views, not copies):
    what the sharded optimizer steps."""
    out = []
    for data, grad in zip(param_chunks, grad_chunks):
        piece = Tensor(data)  # np.asarray of an ndarray: the view itself
        piece.grad = grad
        out.append(piece)
    return out
