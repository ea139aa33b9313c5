"""Structured pruning under data parallelism: every rank removes the same heads and channels.

    mpiexec -n 2 python tutorials/12_pruning.py          # section 7 uses it

    ddp.close()                                        # DDP's buckets hold the old shapes
    kept = prune_structured(model, 0.5, group, score="taylor", optimizer=opt)
    ddp = DistributedDataParallel(model, group)        # wrap the smaller model again

The scores (minidp/models/prune/structured.py) are the mean over the group of each rank's
own: for magnitude scores the replicas are bitwise identical and so are the scores, the mean
changes nothing; for Taylor scores each rank's |w · g| comes from its own shard of the batch,
and the mean is a score over the global batch (Molchanov et al. average |w · g| over many
batches). The mean is one allreduce, whose result is the same bits on every rank, and the
sort after it is deterministic (ties by position): so every rank keeps the same units with
no index ever sent. `tests/test_prune_structured.py` checks the kept units on every rank.

Cost: one allreduce of (heads + channels) float64 values per pruning, a sort per group,
and a copy of each sliced weight (and its AdamW m and v). After it, every matmul that
touched a removed unit is smaller, and so is every gradient DDP sends.
"""

import numpy as np

from minidp import comm
from minidp.engine.nn import Module
from minidp.models.prune import structured


def agreed_scores(group: comm.Group):
    """`agree` for structured.prune: the mean of a score vector over `group`."""

    def agree(scores: np.ndarray) -> np.ndarray:
        total = comm.allreduce(np.ascontiguousarray(scores, dtype=np.float64), group=group)
        return total / group.size

    return agree


def prune_structured(
    model: Module, amount, group: comm.Group, score: str = "l2", optimizer=None
) -> list[np.ndarray]:
    """Remove `amount` of each block's heads and MLP channels (a GPT) or each hidden
    layer's channels (an MLP), the same ones on every rank of `group`, and slice the
    weights (and `optimizer`'s state). Returns the kept units per group. Any DDP around
    `model` must be built again after it (its buckets hold the old shapes)."""
    units = structured.units_of(model)
    return structured.prune(units, amount, score, optimizer, agree=agreed_scores(group))


class OneShot:
    """A model made smaller once, at step `at` of a data-parallel run: `begin_step()` is True
    at that step; then the caller closes DDP, calls `prune(optimizer)` and builds DDP again
    (strategies/dp.py's step, for whatever it holds in `structured`)."""

    def __init__(self, model: Module, at: int, group: comm.Group):
        self.model, self.at, self.group = model, at, group
        self.t = 0  # steps begun
        self.before = self.after = model.num_parameters()

    def begin_step(self) -> bool:
        t, self.t = self.t, self.t + 1
        return t == self.at


class StructuredPruning(OneShot):
    """One-shot structured pruning at step `at` (`--prune-structured`): `prune(optimizer)`
    removes `amount` of the units on every rank alike."""

    def __init__(self, model: Module, amount: float, at: int, group: comm.Group, score="l2"):
        super().__init__(model, at, group)
        self.amount, self.score = amount, score

    def prune(self, optimizer=None) -> None:
        prune_structured(self.model, self.amount, self.group, self.score, optimizer)
        self.after = self.model.num_parameters()

    def describe(self) -> str:
        return f"structured pruning {self.amount:g} ({self.score}) at step {self.at}"

    def record(self) -> dict:
        """The final record's fields: the fraction, the step, the parameters before and after."""
        return {
            "prune_structured": self.amount,
            "prune_structured_at": self.at,
            "parameters_before": self.before,
            "parameters_after": self.after,
        }
