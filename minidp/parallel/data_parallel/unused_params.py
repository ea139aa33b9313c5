"""Which parameters some backward reached since the last gradient sync, over all ranks.

A parameter no rank's backward reached (unused in the step on every rank) must end with
.grad None, so that optimizers skip it (no weight decay, no moments), as PyTorch's DDP
with find_unused_parameters=True leaves it. Each rank keeps one int32 flag per parameter,
1 once a backward (no_sync's too) reached it; the sync ends with one max-allreduce of the
flags on the DDP's `group` (PyTorch allreduces its local_used_map so). Not inside the
buckets: a communication hook may change any value it is given (compression), and the
gradient group's byte counts are what compression is measured by.
"""

import numpy as np

from minidp import comm


class ReachedFlags:
    """One flag per parameter of `params`: reached by some backward since the last sync?"""

    def __init__(self, params: list):
        self.params = params
        self.flags = np.zeros(len(params), dtype=np.int32)

    def mark(self, k: int) -> None:
        self.flags[k] = 1

    def clear(self) -> None:
        self.flags[:] = 0

    def drop_unreached(self, group: comm.Group) -> None:
        """.grad = None for each parameter no rank's backward reached; then clear."""
        if group.size > 1:
            comm.allreduce(self.flags, op="max", group=group, out=self.flags)
        for k in np.flatnonzero(self.flags == 0):
            self.params[k].grad = None
        self.clear()
