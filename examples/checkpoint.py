"""A checkpoint of your own training loop: saved by 4 ranks, resumed by 2.

    mpiexec -n 4 python examples/checkpoint.py

Each rank writes one safetensors shard and rank 0 a manifest, last, that commits the save
(parallel/checkpoint/). The layout says what each array is across ranks: here everything is
replicated (data parallelism: every rank holds the same model and optimizer state), so any
number of ranks can load it. Training on 2 ranks from step 10 ends where 20 uninterrupted
steps of one process end.
"""

import shutil
import tempfile

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.parallel import DistributedDataParallel, checkpoint
from minidp.tools.log import print0


class Net(nn.Module):
    def __init__(self):
        rng = np.random.default_rng(0)
        self.hidden = nn.Linear(32, 64, rng=rng, dtype=np.float64)
        self.head = nn.Linear(64, 10, rng=rng, dtype=np.float64)

    def forward(self, x) -> Tensor:
        return self.head(self.hidden(Tensor(x)).relu())


world = comm.world()
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B, SAVED, STEPS = 64, 10, 20
LAYOUT = {"model/": "replicated", "optimizer/": "replicated"}  # whole on every rank
folder = comm.broadcast_text(tempfile.mkdtemp() if world.rank == 0 else "", root=0, group=world)


def train(model, opt, group, steps):
    """Data parallelism over `group`: each rank its slice of each step's global batch."""
    with DistributedDataParallel(model, group) as ddp:
        for step in steps:
            sampler = data.DistributedSampler(len(x_all), B, group.rank, group.size, seed=0)
            mine = sampler.local_indices(step)
            opt.zero_grad()
            cross_entropy(ddp(x_all[mine]), y_all[mine]).backward()
            ddp.finish_gradient_sync()
            opt.step()


# 4 ranks: 10 steps, then save
model = Net()
opt = optim.AdamW(model.parameters(), lr=1e-2)
train(model, opt, world, range(SAVED))
state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
path = checkpoint.step_directory(folder, SAVED)
checkpoint.save(state, path, world, step=SAVED, layout=LAYOUT)
print0(f"saved {path} from {world.size} ranks")

# 2 ranks: load into new objects, 10 more steps
half = world.split(0 if world.rank < 2 else None)
if half is not None:
    model = Net()
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    state = checkpoint.load(checkpoint.latest(folder), half, layout=LAYOUT)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    train(model, opt, half, range(SAVED, STEPS))

    alone = Net()  # the check: one process, 20 steps in a row
    opt = optim.AdamW(alone.parameters(), lr=1e-2)
    train(alone, opt, half.split(half.rank), range(STEPS))
    gap = max(np.abs(p.data - q.data).max() for p, q in zip(model.parameters(), alone.parameters()))
    assert gap < 1e-10, gap
    print0(f"resumed on {half.size} ranks from step {SAVED}: against one process {gap:.1e}")
comm.barrier(group=world)
if world.rank == 0:
    shutil.rmtree(folder)
