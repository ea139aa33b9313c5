"""Tensor parallelism on an MLP of your own, as Megatron-LM splits a transformer's MLP.

    mpiexec -n 2 python examples/tensor_parallel.py

Y = relu(X A) B with A cut by columns and B by rows over N ranks: rank i computes
relu(X A_i) B_i with no message at all, and one allreduce sums the N parts (Megatron's g;
its f, before, passes X through and allreduces dL/dX in backward). Every rank reads the
whole batch and keeps 1/N of A and B: the model's largest matrices. The check: the losses
of one process, step for step.
"""

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.parallel import ColumnParallelLinear, RowParallelLinear
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores


class Net(nn.Module):
    """Your model: an input layer, an MLP block (fc1 then fc2), a head."""

    def __init__(self):
        rng = np.random.default_rng(0)  # every rank builds the whole model alike
        self.embed = nn.Linear(32, 64, rng=rng, dtype=np.float64)
        self.fc1 = nn.Linear(64, 256, rng=rng, dtype=np.float64)
        self.fc2 = nn.Linear(256, 64, rng=rng, dtype=np.float64)
        self.head = nn.Linear(64, 10, rng=rng, dtype=np.float64)

    def forward(self, x) -> Tensor:
        h = self.embed(Tensor(x)).relu()
        return self.head(h + self.fc2(self.fc1(h).relu()))


world = comm.world()
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B, STEPS = 64, 20

model = Net()
model.fc1 = ColumnParallelLinear(model.fc1, world)  # A_i: this rank's 256 / N columns
model.fc2 = RowParallelLinear(model.fc2, world)  # B_i: the same rows; sum, then the bias
opt = optim.AdamW(model.parameters(), lr=1e-2)  # each rank steps its own slices

alone = Net()
opt_alone = optim.AdamW(alone.parameters(), lr=1e-2)

for step in range(STEPS):
    batch = slice(B * step, B * (step + 1))  # every rank: the whole batch
    losses = []
    for net, o in ((model, opt), (alone, opt_alone)):
        o.zero_grad()
        loss = cross_entropy(net(x_all[batch]), y_all[batch])
        loss.backward()
        o.step()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-10 * losses[1], (step, losses)
    if step % 5 == 0:
        print0(f"step {step:2d} | loss {losses[0]:.6f} (one process {losses[1]:.6f})")

mine = sum(p.size for p in (model.fc1.weight, model.fc2.weight))
whole = sum(p.size for p in (alone.fc1.weight, alone.fc2.weight))
print0(f"rank 0 keeps {mine:,} of the MLP's {whole:,} weights ({world.size} ranks)")
