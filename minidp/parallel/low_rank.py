"""Low-rank factorization under data parallelism: every rank holds the same factors.

    mpiexec -n 4 python -m minidp bench prune --structured --low-rank 16

    ddp.close()                                          # DDP's buckets hold the old shapes
    factorize_replicas(model, 16, group, optimizer=opt)  # W -> A B on every rank alike
    ddp = DistributedDataParallel(model, group)          # wrap the smaller model again

Each rank computes the truncated SVD of its own replica (models/prune/low_rank.py), then
rank 0's factors are broadcast: replicas are bitwise identical and so, on one machine, are
their SVDs, but LAPACK's result may depend on its thread count, and one differing bit would
let the replicas drift. Cost: one SVD per factorized Linear and one broadcast of its two
factors, r (n_in + n_out) values, once.

The optimizer: each factorized weight's entry is replaced by its two factors with fresh
state (AdamW's m and v start at zero, its bias correction from step 1): the factors are new
parameters, and a moment of W says nothing about A's or B's. The bias is kept, and its state.
"""

from minidp import comm
from minidp.engine.nn import Module
from minidp.models.prune import low_rank
from minidp.parallel.structured_pruning import OneShot


def factorize_replicas(model: Module, rank, group: comm.Group, where=None, optimizer=None):
    """low_rank.factorize_model on every rank of `group`, rank 0's factors broadcast; the
    optimizer's entry of each old weight replaced by its factors (fresh state). Returns the
    new LowRankLinears. Any DDP around `model` must be built again after it."""
    where = low_rank.linears_of(model) if where is None else where
    olds = [(o[k] if isinstance(o, list) else getattr(o, k)).weight for o, k in where]
    made = low_rank.factorize_model(model, rank, where)
    for layer in made:
        for weight in (layer.first.weight, layer.second.weight):
            comm.broadcast(weight.data, root=0, group=group)
    params = [] if optimizer is None else optimizer.params
    for old, layer in zip(olds, made):
        i = next((i for i, p in enumerate(params) if p is old), None)
        if i is not None:  # W's entry: A's and B's, their state fresh
            params[i : i + 1] = [layer.first.weight, layer.second.weight]
            optimizer.state[i : i + 1] = [{}, {}]
    return made


class LowRankFactorization(OneShot):
    """One-shot factorization at step `at` of a data-parallel run (structured_pruning.py's
    OneShot): `prune(optimizer)` factorizes every rank alike. No flag sets it (the command
    line's face is at its cap): a script or the bench puts it in the dp recipe's
    `structured` (tests/test_low_rank.py, minidp_bench/_prune_structured.py)."""

    def __init__(self, model: Module, rank, at: int, group: comm.Group):
        super().__init__(model, at, group)
        self.rank = rank

    def prune(self, optimizer=None) -> None:
        factorize_replicas(self.model, self.rank, self.group, optimizer=optimizer)
        self.after = self.model.num_parameters()

    def describe(self) -> str:
        return f"low-rank factorization, rank {self.rank:g}, at step {self.at}"

    def record(self) -> dict:
        return {"low_rank": self.rank, "low_rank_at": self.at,
                "parameters_before": self.before, "parameters_after": self.after}  # fmt: skip
