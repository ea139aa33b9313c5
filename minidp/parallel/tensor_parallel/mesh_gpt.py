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
- Experts (`ep`, a GPT with MoE blocks): each MoE layer, router and experts, is held whole
  on every TP rank of a DP coordinate (they read the same tokens, so they route them alike
  and run the same experts: redundant, but plain), and ExpertParallel (parallel/experts/)
  spreads the experts over EP groups of the DP ranks at one TP coordinate, sums the
  router's counts over the DP group, and is then the data-parallel axis itself: each
  expert's gradient over its expert-DP group, the rest averaged over DP. The experts are
  among the `replicated` parameters: made alike over TP after that sync, as the rest.

    net = MeshGPT(gpt, Mesh(dp=4, tp=2), ep=2)    # 8 ranks: 2 of E = 4 experts a rank
    loss = net.loss(x_mine, y_mine) + load_balancing_loss(net.model)
    loss.backward(); net.experts.finish_gradient_sync(); net.after_dp_sync(take_rank0=True)

- The reports every scheme owes: the model's norm (each TP shard and each expert counted
  once), which arrays ranks must hold alike, their spread, and the whole model gathered back.
"""

import math

from minidp import comm
from minidp.parallel.across_ranks import replica_spread
from minidp.parallel.context_parallel import ContextParallel
from minidp.parallel.experts import ExpertParallel
from minidp.parallel.tensor_parallel.gpt import TensorParallelGPT
from minidp.parallel.tensor_parallel.replicated import make_alike, sum_of_squares


class MeshGPT:
    """`gpt` (the whole nn.GPT, alike on every rank) on `mesh`'s TP and CP axes; see the
    module docstring. Attributes: `model` (the TP GPT), `cp` (its ContextParallel, None at
    cp = 1), `experts` (its ExpertParallel over the DP axis, None without `ep`), `sharded`
    and `replicated` (this rank's parameters, split or whole over TP), `mine` (this rank's
    experts, among the replicated)."""

    def __init__(self, gpt, mesh, *, sequence_parallel=False, cp_algo="ring", zigzag=True, ep=None):
        self.mesh = mesh
        self.model = TensorParallelGPT(gpt, mesh.tp_group, sequence_parallel=sequence_parallel)
        self.cp = self.experts = None
        if mesh.cp > 1:
            if ep is not None:  # each CP rank would route its own positions
                raise ValueError("experts with context parallelism: not supported")
            self.cp = ContextParallel(self.model, mesh.cp_group, cp_algo, zigzag)
        if ep is not None:
            self.experts = ExpertParallel(self.model, mesh.dp_group, ep)
        self.sharded, self.replicated = self.model.sharded_and_replicated()
        held = self.experts.expert_params if self.experts else set()
        self.mine = [p for p in self.replicated if id(p) in held]
        self.whole = [p for p in self.replicated if id(p) not in held]  # alike everywhere

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
        """Collective over TP (and EP): the whole model's L2 norm of "data" or "grad",
        each TP shard and each expert counted once."""
        squares = sum_of_squares(self.sharded, self.whole, kind, self.mesh.tp_group)
        if self.experts is not None:  # whole on each TP rank, E/ep of them on each EP rank
            squares += sum_of_squares(self.mine, [], kind, self.experts.ep_group)
        return math.sqrt(squares)

    def replicas(self, whole: comm.Group | None = None, shards: bool = True) -> list:
        """[(group, [(name, array)])]: the replicated parameters alike on every rank of
        `whole` (default: the mesh's group), the experts over TP and over their expert-DP
        group; with `shards`, the TP shards alike over DP and over CP."""
        name = {id(p): n for n, p in self.model.named_parameters()}
        alike = [(whole or self.mesh.group, [(name[id(p)], p.data) for p in self.whole])]
        if self.experts is not None:
            experts = [(name[id(p)], p.data) for p in self.mine]
            alike += [(self.mesh.tp_group, experts), (self.experts.expert_dp_group, experts)]
        if not shards:
            return alike
        mine = [(name[id(p)], p.data) for p in self.sharded]
        return [(self.mesh.dp_group, mine), (self.mesh.cp_group, mine), *alike]

    def max_param_diff(self, whole: comm.Group) -> float:
        """Collective: the largest spread of what ranks should hold alike."""
        return max(
            replica_spread([array for _, array in named], group)
            for group, named in self.replicas(whole)
        )

    def gather_into(self, gpt) -> None:
        """Collective over TP (and EP): the whole model back in `gpt` from the shards (and
        every EP rank's experts), as fresh arrays."""
        whole = self.model.gather_whole("data")  # this rank's experts by their whole names
        if self.experts is not None:
            whole.update(self.experts.whole_experts())
        for name, p in gpt.named_parameters():
            p.data = whole[name]

    def describe(self) -> str:
        sp = "on" if self.model.sequence_parallel else "off"
        cp = self.cp and self.cp.attention
        cp = f" | context parallel {cp.algo}{' zig-zag' * cp.zigzag}" if cp else ""
        return f"sequence parallel {sp}{cp}"
