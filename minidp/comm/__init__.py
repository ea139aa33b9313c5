"""minidp.comm: collectives written by hand on MPI point-to-point messages.

    from minidp import comm
    g = comm.world()
    total = comm.allreduce(x, op="sum", algo="ring", group=g)

How a vector is cut into one chunk per rank is pure arithmetic, below this package:
`minidp/tools/chunks.py` (`chunk_bounds`, `chunk_range`, re-exported here). Read the package in
this order, every module of it:

  the messages      p2p.py (the only sends and receives), reduce_ops.py (the reduction operators,
                    applied on the receiving side), errors.py (what a collective raises)
  the algorithms    ring.py (Baidu's ring), recursive.py (butterflies: recursive doubling,
                    halving, Rabenseifner), tree.py (binomial trees), naive.py (one rank
                    talks to all: the baseline), alltoall.py, barrier.py (dissemination),
                    builtin.py (MPI's own collectives, algo="mpi", for comparison),
                    shm.py (algo="shm": ranks on one machine read each other's memory),
                    shm_memory.py (the shared windows it reads: made, pooled, found)
  around them       group.py (Group: the communicator, counters, deadline), buffers.py
                    (scratch a Group reuses), checks.py (cross-rank fingerprints),
                    watchdog.py (the deadline of the data exchange: a thread that aborts),
                    abort.py (ending the job from one rank: one line, then MPI_Abort),
                    netem.py (an emulated slower network: MINIDP_NET_*, off by default)
  the public calls  auto.py (algo="auto" by size), args.py (local argument checks),
                    collectives.py and rooted.py (the functions and their contract),
                    text.py (strings over collectives)
  speed beside      fast_path.py (the same steps with less Python per call: plans made
                    once, persistent requests, laid out by persistent.py;
                    MINIDP_FAST_COMM=0 turns it off; allreduce), fast_collectives.py
                    (the same for reduce_scatter, allgather and broadcast)
  what ranks did    trace.py (the Timeline: each rank's spans, saved as a Chrome trace)

Public: the names in `__all__` below, and `minidp.comm.p2p` (`send`, `recv`, `sendrecv`,
`isend`, `irecv`, `waitall`; `probe`, `recv_any`, `waitall_within` for protocols where a
rank does not know who speaks next, such as the parameter server): the teaching layer the
tutorials build collectives from.
The other modules are the implementation; import them to read them, not to rely on them.
"""

from minidp.comm import fast_collectives, fast_path  # noqa: F401 (fill collectives.FAST)
from minidp.comm.abort import end_job
from minidp.comm.auto import choose
from minidp.comm.collectives import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    REDUCE_SCATTER,
    allgather,
    allreduce,
    allreduce_coalesced,
    alltoall,
    barrier,
    reduce_scatter,
)
from minidp.comm.errors import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    MessageSizeMismatch,
)
from minidp.comm.group import Group, world
from minidp.comm.reduce_ops import OPS, REDUCE_DTYPES
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
from minidp.comm.shm import on_one_machine, shared_zeros
from minidp.comm.shm_memory import in_shared_memory, peer_arrays, release_shared
from minidp.comm.text import broadcast_text, gather_text
from minidp.tools.chunks import chunk_bounds, chunk_range

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
    "MessageSizeMismatch",
    "Group",
    "allgather",
    "allreduce",
    "allreduce_coalesced",
    "alltoall",
    "barrier",
    "broadcast",
    "end_job",
    "broadcast_text",
    "choose",
    "chunk_bounds",
    "chunk_range",
    "gather",
    "gather_text",
    "in_shared_memory",
    "on_one_machine",
    "peer_arrays",
    "reduce",
    "reduce_scatter",
    "release_shared",
    "scatter",
    "shared_zeros",
    "world",
]
