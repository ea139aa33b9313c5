"""Expert parallelism inside data parallelism, the plain way: one allreduce per parameter.

    mpiexec -n 4 python examples/experts.py

    model = ExpertParallel(model, dp_group, ep=2)  # this rank keeps E/ep experts a MoE layer
    loss = cross_entropy(model(x), y) + load_balancing_loss(model.module)   # x: my slice
    loss.backward()                                # the all-to-alls' reverses run in here
    model.finish_gradient_sync()                   # each gradient over its own group
    opt.step()                                     # opt over model.parameters()

What it does to the model: in every MoE layer (models/moe/), it keeps only this rank's
experts (EP rank j of the block: experts [j E/ep, (j+1) E/ep)) and swaps the layer's
dispatcher for AllToAllExperts (dispatch.py): tokens go to the rank of their expert and
back in all-to-alls, and the router's counts are summed over the DP group. The groups are
groups.py's: EP groups of ep consecutive DP ranks, expert-DP groups of their replicas.
The model may be a tensor-parallel GPT whose MoE layers every TP rank holds whole: MeshGPT
(parallel/tensor_parallel/mesh_gpt.py) wraps it over the mesh's DP group, which makes the
replicated gradients alike over TP after this sync.

The gradients, for the mean loss over the global batch (dp equal slices, each rank's loss
the mean over its own, as in data parallelism):

    non-expert w:   dL/dw = (1/dp) sum over the dp ranks of dL_r/dw      allreduce(avg), DP
    expert e:       the rank holding e already has sum over its EP group of dL_r/dθ_e (its
                    all-to-alls brought every rank's tokens); the replicas in the other
                    blocks hold the other ranks' sums, so
                    dL/dθ_e = (1/dp) sum over e's expert-DP group       allreduce(sum), / dp

Switch's auxiliary loss follows the same rule: each rank's aux is E sum_e f_e P_e with f_e
from the whole batch (sum_over_batch) and P_e over its own tokens, so the ranks' aux losses
and their router gradients average to one process's over the global batch.

Plain: one blocking allreduce per parameter after backward, nothing overlapped, no buckets
(ddp.py's ideas would apply to each of the two groups alike).

It is a gradient synchronizer of the one step skeleton (parallel/step.py): zero_grad,
no_sync (nothing to hold back: every reduction waits for finish_gradient_sync anyway),
set_batch_share (equal slices only: the 1/dp above, and Switch's P_e averaged over ranks)
and finish_gradient_sync. For the loop around it: `norm(kind)`, the whole model's L2 norm
with each expert counted once; `replicas()`, who holds the same bits; `gather_model()`, the
whole model back in one process's shape. Each expert's parameters carry their name in the
whole model (`placement`, as TP's shards do), so a checkpoint of get_state_dict(ep, opt)
keys them `...experts.{global index}...`, held whole on their replicas: it loads into any
other ep (EP 2 -> 1) or number of ranks.
"""

import contextlib
import copy
import math

import numpy as np

from minidp import comm
from minidp.engine.nn import Module
from minidp.models.moe.layer import LocalExperts, MoE, moe_layers
from minidp.parallel.experts.dispatch import AllToAllExperts
from minidp.parallel.experts.groups import expert_groups
from minidp.parallel.tensor_parallel.layers import Placement

__all__ = ["ExpertParallel"]


class ExpertParallel:
    """Shard every MoE layer of `model` over EP groups of `ep` ranks of `dp_group` (default:
    the world), and reduce each gradient over its group (see the module docstring). Every
    rank must build the same model (the same seed); weights are broadcast from the first
    rank of each group anyway, as data parallelism does."""

    def __init__(
        self, model: Module, dp_group: comm.Group | None = None, ep: int = 1, algo: str = "auto"
    ):
        self.module, self.dp_group, self.ep = model, dp_group or comm.world(), ep
        self.ep_group, self.expert_dp_group = expert_groups(self.dp_group, ep)
        self.layers: list[tuple[str, MoE]] = list(moe_layers(model))
        if not self.layers:
            raise ValueError("ExpertParallel: the model has no MoE layer (models/moe/)")
        dispatcher = AllToAllExperts(self.ep_group, self.dp_group, algo)
        for name, layer in self.layers:
            E = len(layer.experts)
            if E % ep:
                raise ValueError(f"ExpertParallel: {name}'s {E} experts do not divide by ep={ep}")
            lo = self.ep_group.rank * (E // ep)
            layer.experts = layer.experts[lo : lo + E // ep]  # mine: global lo, lo + 1, ...
            layer.dispatcher = dispatcher
            for i, expert in enumerate(layer.experts):  # their names in the whole model
                for pname, p in expert.named_parameters():
                    p.placement = Placement(f"{name}experts.{lo + i}.{pname}")
        self.expert_params = {
            id(p) for _, layer in self.layers for x in layer.experts for p in x.parameters()
        }
        for p in model.parameters():
            comm.broadcast(p.data, root=0, group=self.group_of(p))

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self) -> list:
        """This rank's parameters: the non-expert ones and its own experts'."""
        return self.module.parameters()

    def group_of(self, p) -> comm.Group:
        """The group p's gradient is reduced over: expert-DP for an expert's, else DP."""
        return self.expert_dp_group if id(p) in self.expert_params else self.dp_group

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def no_sync(self):
        """Micro-batches accumulate into .grad; only finish_gradient_sync reduces."""
        return contextlib.nullcontext()

    def set_batch_share(self, n: int, batch: int) -> None:
        """This rank computes n of the global batch's examples: equal slices only."""
        if n * self.dp_group.size != batch:
            raise ValueError(
                f"ExpertParallel averages equal slices: {n} examples of {batch} on each of "
                f"{self.dp_group.size} ranks"
            )

    def finish_gradient_sync(self) -> None:
        """After backward: every .grad becomes the global batch's gradient, in place."""
        dp = self.dp_group.size
        for p in self.module.parameters():
            if not p.requires_grad or p.grad is None:
                continue
            if id(p) in self.expert_params:
                comm.allreduce(p.grad, group=self.expert_dp_group, out=p.grad)
                p.grad *= 1.0 / dp  # the sum of every rank's dL_r, over dp ranks
            else:
                comm.allreduce(p.grad, op="avg", group=self.dp_group, out=p.grad)

    def norm(self, kind: str = "grad") -> float:
        """The whole model's L2 norm of "grad" or "data": the replicated parameters' here,
        each expert's once (summed over the EP group). Collective over the EP group."""
        mine = [0.0, 0.0]  # replicated, experts
        for p in self.module.parameters():
            x = getattr(p, kind)
            if x is not None:
                mine[id(p) in self.expert_params] += float(np.vdot(x, x))
        experts = comm.allreduce(np.array([mine[1]]), group=self.ep_group)[0]
        return math.sqrt(mine[0] + experts)

    def replicas(self) -> list:
        """[(group, [(name, array), ...])]: the replicated parameters alike over the DP
        group, each expert's over its expert-DP group (no message)."""
        named = list(self.module.named_parameters())
        theirs = [(n, p.data) for n, p in named if id(p) not in self.expert_params]
        experts = [(n, p.data) for n, p in named if id(p) in self.expert_params]
        return [(self.dp_group, theirs), (self.expert_dp_group, experts)]

    def gather_model(self) -> None:
        """Collective over the EP group: every MoE layer of `module` holds all E experts
        again and runs them here (LocalExperts), as the one-process model; the wrapper's
        all-to-alls are done with (for evaluation and sampling after training)."""
        whole = self.full_state_dict()
        for _, layer in self.layers:
            mine = layer.experts
            layer.experts = [copy.deepcopy(mine[0]) for _ in range(self.ep * len(mine))]
            layer.dispatcher = LocalExperts()
            for expert in layer.experts:
                for p in expert.parameters():
                    p.placement = None
        self.module.load_state_dict(whole)
        self.expert_params = set()  # every parameter whole here now

    def close(self) -> None:
        """Free the EP and expert-DP groups."""
        self.ep_group.free()
        self.expert_dp_group.free()

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter of the whole model by its one-process name, on every rank: the
        experts gathered over the EP group (experts.{j E/ep + i} is EP rank j's i-th)."""
        state = {}
        for name, p in self.module.named_parameters():
            if id(p) not in self.expert_params:
                state[name] = p.data  # replicated: the same on every rank
        return {**state, **self.whole_experts()}

    def whole_experts(self) -> dict[str, np.ndarray]:
        """Collective over the EP group: every MoE layer's E experts' parameters by their
        names in the whole model (experts.{j E/ep + i} is EP rank j's i-th), on every rank."""
        state = {}
        for prefix, layer in self.layers:
            for i, x in enumerate(layer.experts):
                for pname, p in x.named_parameters():
                    rows = comm.allgather(np.ascontiguousarray(p.data), group=self.ep_group)
                    for j, row in enumerate(rows):
                        state[f"{prefix}experts.{j * len(layer.experts) + i}.{pname}"] = row
        return state
