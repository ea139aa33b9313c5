"""Pruning under data parallelism: each bucket's kept gradients, packed, are all it sends.

    bucket.data   [ g0  g1  g2  g3  g4  g5  g6  g7 ]     every rank's (weighted) gradients
    keep          [ 1   0   0   1   1   0   1   0  ]     the masks, the same on every rank
    packed        [ g0  g3  g4  g6 ]                     np.take(bucket.data, kept)
    allreduce(packed, sum)                               n_kept elements, not n
    bucket.data   [ Σg0 0   0   Σg3 Σg4 0   Σg6 0  ]     put back; masked slots zeroed

So a masked weight's gradient is neither sent nor applied, and the bytes each step sends
fall with the sparsity: a ring allreduce sends 2(N-1)/N · n_kept · itemsize per bucket and
rank instead of 2(N-1)/N · n · itemsize. Biases and LayerNorm parameters are never masked
(minidp/models/prune/magnitude.py), so they are always sent.

Why no mask is ever sent: the masks are computed on every rank from the same weights.
Data-parallel replicas are bitwise identical (every rank starts from rank 0's weights and
applies the same averaged gradient), and the mask is a deterministic function of them (a
stable sort, ties broken by position), so every rank computes the same mask with no
message. tests/test_prune_dp.py checks that the masks agree on every rank. Were the
replicas ever to differ, the packed vectors would no longer line up; this is why pruning
is refused together with --compress (a lossy reduction need not keep replicas identical).

The hook goes in through `DistributedDataParallel.register_comm_hook`, as every gradient
transform does. It reads its masks from a MagnitudePruner (`MaskedAllreduce(pruner,
ddp.buckets, algo)`; `--prune` builds one so, in strategies/ddp_axis.py), or from the masks
the torch-named functions of minidp/models/prune/functions.py left on a user's model
(`masked_allreduce_hook(ddp)`).
"""

import numpy as np

from minidp import comm
from minidp.models.prune.functions import ModelMasks
from minidp.models.prune.magnitude import MagnitudePruner
from minidp.parallel.across_ranks import bytes_sent
from minidp.parallel.data_parallel.buckets import Bucket
from minidp.parallel.data_parallel.ddp import DistributedDataParallel


class MaskedAllreduce:
    """The communication hook: allreduce(sum) only the unmasked entries of each bucket.

    `pruner` holds the masks: a MagnitudePruner, or a ModelMasks (anything with `params`,
    `masks` and a `version` that changes with them). `step_elements` and `step_bytes` are
    what the last step sent (bucket 0 starts a step)."""

    def __init__(
        self, pruner: MagnitudePruner | ModelMasks, buckets: list[Bucket], algo: str = "auto"
    ):
        self.pruner, self.algo = pruner, algo
        self.dense_elements = sum(b.data.size for b in buckets)
        self._kept: dict[int, tuple[int, np.ndarray]] = {}  # bucket -> (version, indices)
        self.step_elements = self.step_bytes = 0

    def kept(self, bucket: Bucket) -> np.ndarray:
        """Indices into bucket.data of the entries sent: recomputed when the masks change."""
        version, kept = self._kept.get(bucket.index, (-1, None))
        now = self.pruner.version
        if version != now:
            masks = {id(p): m for p, m in zip(self.pruner.params, self.pruner.masks)}
            keep = np.concatenate(
                [masks[id(p)].ravel() if id(p) in masks else np.ones(p.size, bool)
                 for p in bucket.params]
            )  # fmt: skip
            kept = np.flatnonzero(keep)
            self._kept[bucket.index] = (now, kept)
        return kept

    def __call__(self, bucket: Bucket, group: comm.Group) -> None:
        if bucket.index == 0:
            self.step_elements = self.step_bytes = 0
        before = bytes_sent(group)
        kept = self.kept(bucket)
        packed = np.take(bucket.data, kept)
        comm.allreduce(packed, op="sum", algo=self.algo, group=group, out=packed)
        bucket.data[...] = 0
        bucket.data[kept] = packed
        self.step_elements += kept.size
        self.step_bytes += bytes_sent(group) - before

    # ---- what the DP strategy asks of its MagnitudePruner (strategies/ddp_axis.py) ---------
    def begin_step(self) -> None:
        self.pruner.begin_step()

    def record(self) -> dict:
        """The final --json record's pruning fields: sparsity reached, what a step sends."""
        return {
            "prune_target": self.pruner.target,
            "prune_sparsity": self.pruner.sparsity(),
            "prune_model_sparsity": self.pruner.model_sparsity(),
            "prune_grad_elements_per_step": self.step_elements,
            "prune_dense_grad_elements": self.dense_elements,
            "prune_bytes_per_step": self.step_bytes,
        }


def masked_allreduce_hook(ddp: DistributedDataParallel, algo: str | None = None) -> MaskedAllreduce:
    """Register on `ddp` the hook that sends only the gradients the masks keep, reading the
    masks that prune/functions.py's l1_unstructured / global_unstructured left on ddp.model
    (now and after any later pruning); `algo` defaults to ddp's. Returns the hook."""
    hook = MaskedAllreduce(ModelMasks(ddp.model), ddp.buckets, algo or ddp.algo)
    ddp.register_comm_hook(hook)
    return hook
