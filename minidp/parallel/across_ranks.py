"""What ranks compute together about a model they share or shard: its global norm (and
clipping by it, each shard counted once), how far replicas have drifted apart (and the first
parameter whose bits differ among them), the global batch's loss, the bytes a group has
sent, each rank's figures side by side, and the stand-in a released parameter keeps.

Every piece and recipe uses these; none of them holds state. Each is a collective over the
group it is given, unless it says otherwise.
"""

import math
import zlib

import numpy as np

from minidp import comm
from minidp.engine import optim
from minidp.engine.backend import to_numpy


def global_l2(arrays, shard_group: comm.Group | None = None) -> float:
    """The L2 norm of `arrays`, this rank's shard, summed over `shard_group` (None: the
    arrays are whole here). Each element must be held by exactly one rank of shard_group."""
    total = optim.sum_of_squares(arrays)
    if shard_group is not None and shard_group.size > 1:
        total = float(comm.allreduce(np.array([total]), group=shard_group)[0])
    return math.sqrt(total)


def clip_global_norm(params, max_norm: float, shard_group: comm.Group | None = None) -> float:
    """Clip gradients by their global norm, each shard counted once (see global_l2)."""
    params = list(params)
    norm = global_l2([p.grad for p in params], shard_group)
    return optim.clip_grad_norm(params, max_norm, total_norm=norm)


def stand_in(p) -> np.ndarray:
    """What a released parameter's .data is: read-only, its shape, one element of memory
    (a scheme that keeps only shards releases the whole model's arrays so)."""
    return np.broadcast_to(np.zeros((), p.dtype), p.shape)


def replica_spread(arrays, group: comm.Group, chunk: int = 1 << 17) -> float:
    """max over elements of (largest - smallest value across the group): 0.0 when in sync.

    About `chunk` elements at a time (small arrays packed together, a large one cut): no
    array the size of the model is made, so the check costs a rank no more memory than a
    gradient bucket. A NaN anywhere is the answer (alike on every rank: the allreduce's)."""
    spread = 0.0
    for part in _packed(arrays, chunk):
        both = comm.allreduce(np.concatenate([part, -part]), op="max", group=group)
        d = float((both[: part.size] + both[part.size :]).max())  # a NaN, or inf - inf: nan
        if np.isnan(d):
            return float("nan")
        spread = max(spread, d)
    return spread


def _packed(arrays, chunk: int):
    """The arrays' elements laid end to end, in float64 runs of about `chunk` elements."""
    parts, held = [], 0
    for a in arrays:
        flat = to_numpy(a).ravel()
        for lo in range(0, flat.size, chunk):
            parts.append(flat[lo : lo + chunk].astype(np.float64))
            held += parts[-1].size
            if held >= chunk:
                yield np.concatenate(parts)
                parts, held = [], 0
    if parts:
        yield np.concatenate(parts)


def bytes_sent(*groups: comm.Group) -> int:
    """Data bytes this rank sent on the groups (not the fingerprints of the checks)."""
    return sum(
        c["bytes_sent"]
        for group in groups
        for name, c in group.counters.items()
        if name != "checks"
    )


def global_loss(local_loss: float, share: float, group: comm.Group) -> float:
    """The global batch's mean loss: the sum over ranks of (n_r / B) * this rank's mean."""
    return float(comm.allreduce(np.array([local_loss * share]), group=group)[0])


def split_mean(part_mean, group: comm.Group) -> float:
    """A mean over data split among the ranks: `part_mean((rank, size))` is this rank's
    share of it (its part's mean weighted by the part's fraction of the data), summed."""
    return float(comm.allreduce(np.array([part_mean((group.rank, group.size))]), group=group)[0])


def per_rank(figures: dict, group: comm.Group) -> dict[str, list[int]]:
    """{name: [on rank 0, rank 1, ...]} from each rank's {name: integer}; every rank must
    name the same figures (0 where it has none)."""
    names = sorted(figures)
    mine = np.array([figures[name] for name in names], dtype=np.int64)
    every = comm.allgather(mine, group=group).reshape(group.size, len(names))
    return {name: every[:, i].tolist() for i, name in enumerate(names)}


def first_difference(named_arrays: list[tuple[str, object]], group: comm.Group) -> str | None:
    """Among ranks of `group` that should hold the same bits of these (name, array) pairs:
    None if they do, else a line naming the first parameter whose bits differ and the ranks
    that differ from the most of them (from rank 0 on a tie).

    Each rank hashes each array (CRC-32 of its bytes) and the hashes are allgathered: one
    message of 8 bytes per parameter, never the parameters themselves. Every rank reads the
    same table, so every rank returns the same answer."""
    if not named_arrays or group.size == 1:
        return None
    mine = [zlib.crc32(np.ascontiguousarray(to_numpy(a)).view(np.uint8)) for _, a in named_arrays]
    table = comm.allgather(np.array(mine, np.int64), group=group).reshape(group.size, -1)
    for j in np.flatnonzero((table != table[0]).any(axis=0)):
        column = table[:, j].tolist()
        most = max(column, key=lambda h: (column.count(h), h == column[0]))
        ranks = [r for r, h in enumerate(column) if h != most]
        agree = [r for r, h in enumerate(column) if h == most]
        return (
            f"parameter {named_arrays[j][0]!r} on rank(s) {', '.join(map(str, ranks))} "
            f"differs from rank(s) {', '.join(map(str, agree))} (world ranks "
            f"{', '.join(str(group.world_ranks[r]) for r in ranks)})"
        )
    return None
