"""Experts spread over ranks on a model of your own: a MoE layer in a residual classifier.

    mpiexec -n 4 python examples/experts.py

Four data-parallel ranks, each reading a quarter of every batch; the MoE layer's 4 experts
split over EP groups of 2 ranks ({0, 1} and {2, 3}), so every expert has two replicas
({0, 2} hold experts 0 and 1, {1, 3} experts 2 and 3). Tokens go to their expert's rank and
back in all-to-alls inside forward and backward; `finish_gradient_sync` averages the
router and the other layers over all 4 ranks and each expert over its 2 replicas. The
check: the losses of one process over the whole batch, and the final weights (float64).
"""

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.parallel import ExpertParallel
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores


class Net(nn.Module):
    """Your model: an input layer, a residual MoE block (top-2 of 4 experts), a head."""

    def __init__(self):
        rng = np.random.default_rng(0)  # every rank builds the whole model alike
        self.embed = nn.Linear(32, 16, rng=rng, dtype=np.float64)
        self.moe = nn.MoE(16, n_experts=4, top_k=2, capacity_factor=1.0, rng=rng,
                          dtype=np.float64, hidden=32)  # fmt: skip
        self.head = nn.Linear(16, 10, rng=rng, dtype=np.float64)

    def forward(self, x) -> Tensor:
        h = self.embed(Tensor(x)).tanh()
        return self.head(h + self.moe(h))  # each example one token for the router


world = comm.world()
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B, STEPS = 64, 10


def train(model, net, rows, sync=lambda: None) -> list[float]:
    """STEPS steps of `model` (net, or net wrapped) on this rank's `rows` of each batch."""
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = x_all[step * B : (step + 1) * B], y_all[step * B : (step + 1) * B]
        opt.zero_grad()
        loss = cross_entropy(model(x[rows]), y[rows]) + nn.load_balancing_loss(net)
        loss.backward()
        sync()
        opt.step()
        losses.append(comm.allreduce(np.array([loss.item()]), op="avg", group=world)[0])
    return losses


# the reference: one process over the whole batch, a capacity group per rank's quarter
alone = Net()
alone.moe.capacity_groups = world.size  # each rank's slice has its own capacity
want = train(alone, alone, slice(None))

# expert parallel: experts over EP groups of 2, the batch over all 4 ranks
net = Net()
ep_model = ExpertParallel(net, world, ep=2)
share = B // world.size
mine = slice(world.rank * share, (world.rank + 1) * share)
got = train(ep_model, net, mine, sync=ep_model.finish_gradient_sync)
groups = ep_model.ep_group.world_ranks, ep_model.expert_dp_group.world_ranks
print0(
    f"rank 0 holds {len(net.moe.experts)} of 4 experts; EP group {groups[0]}, expert-DP {groups[1]}"
)
print0(f"step 0 loss {got[0]:.6f}, step {STEPS - 1} loss {got[-1]:.6f}")
np.testing.assert_allclose(got, want, rtol=1e-10)
whole = ep_model.full_state_dict()
for name, p in alone.named_parameters():
    np.testing.assert_allclose(whole[name], p.data, rtol=1e-9, atol=1e-12, err_msg=name)
load = net.moe.load
print0(f"last step: assignments per expert {load.routed.tolist()}, dropped {load.dropped.sum()}")
print0("expert parallel equals one process over the whole batch")
