"""Data parallelism on a model of your own, as PyTorch's DistributedDataParallel does it.

    mpiexec -n 4 python examples/ddp.py

Every rank builds the same model, reads its slice of each global batch, and the ranks
average the gradients during backward (in buckets), so every replica takes the step one
process takes on the whole batch. The check at the end trains that one process and compares.
Where PyTorch's DDP ends the reduction inside backward(), minidp's ends it in
finish_gradient_sync(); the `with` block stops its communication thread.
"""

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.parallel import DistributedDataParallel
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores


class Net(nn.Module):
    """Your model: anything built from minidp.nn. Here a residual MLP with one frozen layer."""

    def __init__(self):
        rng = np.random.default_rng(0)  # the same weights on every rank (DDP checks)
        self.embed = nn.Linear(32, 64, rng=rng, dtype=np.float64)
        self.embed.weight.requires_grad = False  # frozen: never reduced, never stepped
        self.hidden = nn.Linear(64, 64, rng=rng, dtype=np.float64)
        self.head = nn.Linear(64, 10, rng=rng, dtype=np.float64)

    def forward(self, x) -> Tensor:
        h = self.embed(Tensor(x)).relu()
        h = h + self.hidden(h).relu()
        return self.head(h)


world = comm.world()
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B, STEPS = 64, 30  # the global batch: each rank reads B / world.size of it
sampler = data.DistributedSampler(len(x_all), B, world.rank, world.size, seed=0)

model = Net()
with DistributedDataParallel(model, world) as ddp:
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        mine = sampler.local_indices(step)  # this rank's examples of step's global batch
        opt.zero_grad()
        loss = cross_entropy(ddp(x_all[mine]), y_all[mine])
        loss.backward()
        ddp.finish_gradient_sync()  # the last bucket's reduction done: grads averaged
        opt.step()
        if step % 10 == 0:
            mean = comm.allreduce(np.array([loss.item()]), op="avg", group=world)[0]
            print0(f"step {step:2d} | loss {mean:.4f}")

# the check: one process on the whole global batches, the same steps
alone = Net()
opt = optim.AdamW(alone.parameters(), lr=1e-2)
whole = data.DistributedSampler(len(x_all), B, 0, 1, seed=0)
for step in range(STEPS):
    batch = whole.local_indices(step)
    opt.zero_grad()
    cross_entropy(alone(x_all[batch]), y_all[batch]).backward()
    opt.step()
gap = max(np.abs(p.data - q.data).max() for p, q in zip(model.parameters(), alone.parameters()))
assert gap < 1e-10, gap
print0(f"{world.size} ranks against one process: largest parameter difference {gap:.1e}")
