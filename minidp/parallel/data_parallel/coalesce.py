"""Speed trick: when several buckets go at once, reduce them in one collective.

Without overlap every bucket is reduced after backward, one allreduce each. With buckets in
shared memory (shm_arena.py), each "shm" allreduce costs three synchronizations of all ranks
(comm/shm.py); `comm.allreduce_coalesced` serves all the buckets with one set of three,
each bucket still chunked and summed as by itself, so the bits are those of one allreduce
per bucket (test_ddp_tricks.py). It applies only to the default hook, a plain allreduce(sum)
in place (`hook.sums_in_place`): a compression hook gets its buckets one by one.
torch.distributed's all_reduce_coalesced and Horovod's tensor fusion are the same idea.
"""

import time

import numpy as np

from minidp import comm
from minidp.parallel.data_parallel.comm_thread import reduce_each


def reduce_together(reducer, buckets: list) -> None:
    """Reduce DDP's weighed buckets (share 1) with `reducer` (comm_thread.Reducer): in one
    allreduce_coalesced when its hook is the plain allreduce and they are NumPy arrays,
    else one by one (comm_thread.reduce_each, the plain way)."""
    hook = reducer.hook
    if (
        not getattr(hook, "sums_in_place", False)
        or len(buckets) < 2
        or not isinstance(buckets[0].data, np.ndarray)
    ):
        reduce_each(reducer, buckets)
        return
    start = time.perf_counter()
    comm.allreduce_coalesced(
        [b.data for b in buckets], op="sum", algo=hook.algo, group=reducer.group
    )
    what = f"buckets {buckets[0].index}-{buckets[-1].index}"
    reducer.record(what, start, sum(b.data.nbytes for b in buckets))
