"""Uneven inputs: PyTorch DDP's `join()`. Ranks with fewer batches than others would leave
the others waiting in their next allreduce forever; inside `with ddp.join():` a rank that
runs out keeps joining the others' steps until every rank has run out.

    with ddp.join():
        for x, y in my_batches:            # some ranks have more batches than others
            opt.zero_grad()
            cross_entropy(ddp(x), y).backward()
            ddp.finish_gradient_sync()
            opt.step()

Each step, the forward that syncs (outside no_sync) first agrees with the others (one
allreduce of two numbers over the group): how many ranks are still in, and how many
examples they hold together, B. Each weighs its gradients by n_r / B (its forwards' batch
sizes since the last sync, summed): the step's gradient is the mean over the examples
actually seen that step, as one process computes it on them (set_batch_share is not needed,
and is overridden). A rank out of batches leaves the loop and, at the block's end, takes
part in each step the others still take: the same agreement with "not in, 0 examples",
then zero gradients into every bucket's allreduce (zero_grad, finish_gradient_sync). Once
no rank is in, every rank's parameters are set to those of the rank that stepped last (the
most steps; the lowest such rank), as PyTorch's join ends, so the replicas agree again. The
optimizer state of a rank that stopped early is its own (PyTorch's too).
"""

import contextlib

import numpy as np

from minidp import comm


class Joining:
    """The bookkeeping of one `join()` block on one rank."""

    def __init__(self, ddp):
        self.ddp, self.examples, self.steps = ddp, 0, 0

    def before_forward(self, args) -> None:
        """Count this forward's examples; the forward that syncs agrees with the others (a
        forward whose first argument has no length counts one example)."""
        self.examples += len(args[0]) if args and hasattr(args[0], "__len__") else 1
        if self.ddp.sync_enabled:
            _, total = agree(self.ddp.group, True, self.examples)
            self.ddp.share = self.examples / total
            self.examples, self.steps = 0, self.steps + 1

    def shadow(self) -> None:
        """Out of batches: join the others' steps with zeros, then take the last one's model."""
        ddp = self.ddp
        while agree(ddp.group, False, 0)[0]:
            ddp.zero_grad()
            ddp.finish_gradient_sync()
        steps = comm.allgather(np.array([self.steps], np.int64), group=ddp.group).ravel()
        last = int(np.argmax(steps))
        for p in ddp.model.parameters():
            comm.broadcast(p.data, root=last, group=ddp.group)


def agree(group: comm.Group, active: bool, examples: int) -> tuple[int, int]:
    """Collective: (ranks still in, their examples together)."""
    mine = np.array([int(active), examples], np.int64)
    live, total = comm.allreduce(mine, group=group)
    return int(live), int(total)


@contextlib.contextmanager
def join(ddp):
    """`ddp.join()`: see the module doc. An error inside the block leaves at once."""
    joining, share = Joining(ddp), ddp.share
    ddp._join = joining
    try:
        yield
        ddp._join = None
        joining.shadow()  # (not after an error in the block: that ends the run)
    finally:
        ddp._join, ddp.share = None, share  # set_batch_share's weight (or 1/N) again
