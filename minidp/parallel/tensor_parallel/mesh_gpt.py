"""MeshGPT: a GPT on a mesh's tensor- and context-parallel axes, what a data-parallel axis
(DDP, or ZeRO over TP shards) then wraps. Megatron-LM's model placement, as one piece:

    mesh = Mesh(dp=2, tp=2, cp=2)
    net = MeshGPT(gpt, mesh, sequence_parallel=False, cp_algo="ring", zigzag=True)
    ddp = DistributedDataParallel(net.model, mesh.dp_group)
    loss = net.loss(x_mine, y_mine)          # x: this DP coordinate's examples, whole
    loss.backward(); ddp.finish_gradient_sync()
    net.after_dp_sync(take_rank0=mesh.dp > 2)    # the CP group's parts, TP's replicas

- The TP axis: every rank keeps its slice of each split weight (TensorParallelGPT); the
  weights no layer splits (embeddings, LayerNorms, ...) are `replicated` on every TP rank,
  their gradients made alike over TP after the data-parallel sync (replicated.py).
- The CP axis (cp > 1): ContextParallel over the CP group: each rank runs its T/C positions
  of the same examples (ring attention or Ulysses over its TP heads), the loss the whole
  batch's mean, and each gradient a partial sum over the CP group, summed there after the
  data-parallel sync (parallel/context_parallel/).
- The reports every scheme owes: the model's norm (each TP shard counted once), which
  arrays ranks must hold alike, their spread, and the whole model gathered back.
"""

import math

from minidp import comm
from minidp.parallel.across_ranks import replica_spread
from minidp.parallel.context_parallel import ContextParallel
from minidp.parallel.tensor_parallel.gpt import TensorParallelGPT
from minidp.parallel.tensor_parallel.replicated import make_alike, sum_of_squares


class MeshGPT:
    """`gpt` (the whole nn.GPT, alike on every rank) on `mesh`'s TP and CP axes; see the
    module docstring. Attributes: `model` (the TP GPT), `cp` (its ContextParallel, None at
    cp = 1), `sharded` and `replicated` (this rank's parameters, split or whole)."""

    def __init__(self, gpt, mesh, *, sequence_parallel=False, cp_algo="ring", zigzag=True):
        self.mesh = mesh
        self.model = TensorParallelGPT(gpt, mesh.tp_group, sequence_parallel=sequence_parallel)
        self.cp = None
        if mesh.cp > 1:
            self.cp = ContextParallel(self.model, mesh.cp_group, cp_algo, zigzag)
        self.sharded, self.replicated = self.model.sharded_and_replicated()

    def loss(self, x, y):
        """The mean loss of examples (x, y), whole sequences (CP cuts its own slice)."""
        return (self.cp or self.model).loss(x, y)

    def after_dp_sync(self, take_rank0: bool) -> None:
        """After the data-parallel sync: the CP group's partial gradients summed, then the
        replicated parameters' gradients made alike over TP (`take_rank0`: TP rank 0's,
        where the data-parallel sums may differ by rank: more than 2 ranks, compression)."""
        if self.cp is not None:
            self.cp.finish_gradient_sync()
        partial = self.model.replicated_grads_partial
        make_alike(self.replicated, self.mesh.tp_group, partial, take_rank0)

    def norm(self, kind: str) -> float:
        """Collective over TP: the whole model's L2 norm of "data" or "grad"."""
        squares = sum_of_squares(self.sharded, self.replicated, kind, self.mesh.tp_group)
        return math.sqrt(squares)

    def replicas(self, whole: comm.Group, shards: bool = True) -> list:
        """[(group, [(name, array)])]: the replicated parameters alike on every rank of
        `whole`; with `shards`, the TP shards alike over DP and over CP."""
        name = {id(p): n for n, p in self.model.named_parameters()}
        alike = [(whole, [(name[id(p)], p.data) for p in self.replicated])]
        if not shards:
            return alike
        mine = [(name[id(p)], p.data) for p in self.sharded]
        return [(self.mesh.dp_group, mine), (self.mesh.cp_group, mine), *alike]

    def max_param_diff(self, whole: comm.Group) -> float:
        """Collective: the largest spread of what ranks should hold alike."""
        shards = [p.data for p in self.sharded]
        groups = (self.mesh.dp_group, self.mesh.cp_group)
        spread = max(replica_spread(shards, g) for g in groups)
        return max(spread, replica_spread([p.data for p in self.replicated], whole))

    def gather_into(self, gpt) -> None:
        """Collective over TP: the whole model back in `gpt` from the shards."""
        self.model.gather_into(gpt)

    def describe(self) -> str:
        sp = "on" if self.model.sequence_parallel else "off"
        cp = self.cp and self.cp.attention
        cp = f" | context parallel {cp.algo}{' zig-zag' * cp.zigzag}" if cp else ""
        return f"sequence parallel {sp}{cp}"
