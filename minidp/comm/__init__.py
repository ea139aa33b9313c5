"""minidp.comm: collectives written by hand on MPI point-to-point messages.

Read in this order: chunks.py (how a vector is cut), p2p.py (the only sends and receives),
ring.py (Baidu's ring), recursive.py (butterflies), tree.py (binomial trees), naive.py,
alltoall.py, barrier.py; then group.py, checks.py and buffers.py for what surrounds them,
collectives.py / rooted.py for the public functions and their contract, and text.py for
strings sent over them.

    from minidp import comm
    g = comm.world()
    total = comm.allreduce(x, op="sum", algo="ring", group=g)
"""

from minidp.comm.auto import choose
from minidp.comm.chunks import chunk_bounds, chunk_range
from minidp.comm.collectives import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    REDUCE_SCATTER,
    allgather,
    allreduce,
    alltoall,
    barrier,
    reduce_scatter,
)
from minidp.comm.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout
from minidp.comm.group import Group, world
from minidp.comm.ops import OPS, REDUCE_DTYPES
from minidp.comm.rooted import (
    BROADCAST,
    GATHER,
    REDUCE,
    SCATTER,
    broadcast,
    gather,
    reduce,
    scatter,
)
from minidp.comm.text import broadcast_text, gather_text

ALGORITHMS = {
    "allreduce": tuple(ALLREDUCE),
    "reduce_scatter": tuple(REDUCE_SCATTER),
    "allgather": tuple(ALLGATHER),
    "broadcast": tuple(BROADCAST),
    "reduce": tuple(REDUCE),
    "gather": tuple(GATHER),
    "scatter": tuple(SCATTER),
    "alltoall": tuple(ALLTOALL),
    "barrier": tuple(BARRIER),
}
"""The algorithms each collective accepts besides "auto"."""

__all__ = [
    "ALGORITHMS",
    "OPS",
    "REDUCE_DTYPES",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Group",
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_text",
    "choose",
    "chunk_bounds",
    "chunk_range",
    "gather",
    "gather_text",
    "reduce",
    "reduce_scatter",
    "scatter",
    "world",
]
