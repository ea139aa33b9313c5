"""Speed trick: DDP's buckets in shared memory, so the allreduce copies nothing in or out.

The plain buckets (buckets.py) are ordinary arrays. When every rank of the group is on one
machine, the "shm" allreduce (comm/shm.py) reduces by loading the other ranks' memory; an
ordinary array must first be copied into a shared scratch segment and back. With this
trick the buckets are carved out of one **arena** that already lies in shared memory, so
the reduction reads and writes the buckets where they are:

    arena (shared_zeros, one per DDP)  [ bucket 0 | bucket 1 | bucket 2 ]
                                          ▲ every p.grad is a view into its slot

It plugs into DDP through assign_buckets' `zeros(count, dtype)` allocator (`carve`), and
out of it at close (`release`): the gradients move to private memory, the arena goes back to
its ranks' pool for the next DDP. The bits are the plain path's (test_ddp_tricks.py), and
`bench dp --case tricks` measures what it buys.
"""

import numpy as np

from minidp import comm
from minidp.comm.netem import network


def shared_arena(params: list, algo: str, group: comm.Group) -> np.ndarray | None:
    """One array for all buckets in memory every rank reads, when they are reduced by loads
    (algo "shm", or "auto" with every rank on one machine, room in /dev/shm and no emulated
    network, comm/netem.py); else None
    (plain buckets). Collective: every rank gets the same answer."""
    if algo not in ("auto", "shm") or group.size == 1:
        return None
    if not isinstance(params[0].data, np.ndarray):  # torch tensors stage through the host
        return None
    if algo == "auto" and (network() is not None or not comm.on_one_machine(group)):
        return None  # the same answer on every rank; an emulated network is not loads
    count = sum(p.size for p in params)
    return comm.shared_zeros(count, params[0].dtype, group, if_room=algo == "auto")


def carve(arena: np.ndarray):
    """zeros(count, dtype) for assign_buckets: the arena's next `count` elements, in order."""
    taken = [0]

    def zeros(count, dtype):
        taken[0] += count
        return arena[taken[0] - count : taken[0]]

    return zeros


def release(arena: np.ndarray, buckets: list, group: comm.Group) -> None:
    """Move every bucket's gradients out of the arena (values kept, every .grad still a view
    of its bucket), and hand the arena back to its ranks' pool (no MPI call)."""
    for bucket in buckets:
        bucket.move_to_private_memory()
    comm.release_shared(arena, group)
