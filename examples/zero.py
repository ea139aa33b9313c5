"""ZeRO on a model of your own: stage 1 (ZeroRedundancyOptimizer beside DDP) and stage 3
(FullyShardedDataParallel), as PyTorch names them; SimpleZeRO3 is stage 3 in its plain form.

    mpiexec -n 4 python examples/zero.py

Data parallelism keeps the whole model, its gradients and the optimizer's state on every
rank: 4 + 4 + 8 bytes a parameter for AdamW in float32. ZeRO cuts what each rank keeps by
the number of ranks N: stage 1 the optimizer state, stage 3 everything, gathering each
layer only while it runs. Each variant trains the same steps; each ends where one process
ends, and prints what its rank 0 holds.
"""

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.parallel import (
    DistributedDataParallel,
    FullyShardedDataParallel,
    SimpleZeRO3,
    ZeroRedundancyOptimizer,
)
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0
from minidp.tools.memory import nbytes, optimizer_bytes

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores


class Net(nn.Module):
    """Your model: each direct child is a layer ZeRO-3 gathers on its own."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.embed = nn.Linear(32, 128, rng=rng, dtype=np.float64)
        self.hidden = nn.Linear(128, 128, rng=rng, dtype=np.float64)
        self.head = nn.Linear(128, 10, rng=rng, dtype=np.float64)

    def forward(self, x) -> Tensor:
        h = self.embed(Tensor(x)).relu()
        return self.head(h + self.hidden(h).relu())


world = comm.world()
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B, STEPS = 64, 20
sampler = data.DistributedSampler(len(x_all), B, world.rank, world.size, seed=0)


def train(forward, params, opt, sync=lambda: None) -> tuple[int, int]:
    """STEPS steps on this rank's slices; (bytes of the parameters this rank keeps, of its
    optimizer's state)."""
    for step in range(STEPS):
        mine = sampler.local_indices(step)
        opt.zero_grad()
        cross_entropy(forward(x_all[mine]), y_all[mine]).backward()
        sync()  # DDP's and FSDP's reductions: done before the step
        opt.step()
    return sum(p.size for p in params) * 8, optimizer_bytes(getattr(opt, "optimizer", opt))


# the reference: one process on the whole batches
alone = Net()
opt = optim.AdamW(alone.parameters(), lr=1e-2)
whole = data.DistributedSampler(len(x_all), B, 0, 1, seed=0)
for step in range(STEPS):
    opt.zero_grad()
    batch = whole.local_indices(step)
    cross_entropy(alone(x_all[batch]), y_all[batch]).backward()
    opt.step()
want = alone.state_dict()


def report(name: str, state: dict, held: tuple[int, int]) -> None:
    gap = max(np.abs(state[k] - v).max() for k, v in want.items())
    assert gap < 1e-10, (name, gap)
    print0(f"{name:34s} parameters {held[0]:7,d} B | optimizer state {held[1]:7,d} B | "
           f"against one process {gap:.1e}")  # fmt: skip


params = alone.parameters()
report("one process (all of it)", want, (nbytes(p.data for p in params), optimizer_bytes(opt)))

model = Net()  # stage 1: DDP reduces the gradients, each rank steps 1/N of the parameters
with DistributedDataParallel(model, world) as ddp:
    zopt = ZeroRedundancyOptimizer(model.parameters(), optim.AdamW, world, lr=1e-2)
    held = train(ddp, model.parameters(), zopt, ddp.finish_gradient_sync)
    report("ZeroRedundancyOptimizer + DDP", model.state_dict(), held)

model = Net()  # stage 3: each layer whole only while it runs, gradients reduce-scattered
with FullyShardedDataParallel(model, world, sharding="full") as fsdp:
    opt = optim.AdamW(fsdp.parameters(), lr=1e-2)
    held = train(fsdp, fsdp.parameters(), opt, fsdp.finish_gradient_sync)
    report("FullyShardedDataParallel", fsdp.full_state_dict(), held)

model = Net()  # stage 3, plain: the same idea in one short file (parallel/zero/plain.py)
zero3 = SimpleZeRO3(model, world)
opt = optim.AdamW(zero3.parameters(), lr=1e-2)
held = train(zero3, zero3.parameters(), opt)
report("SimpleZeRO3", zero3.full_state_dict(), held)
