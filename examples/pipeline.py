"""Pipeline parallelism on stages of your own: GPipe in its plain form, then 1F1B.

    mpiexec -n 2 python examples/pipeline.py

You cut your model into as many stages as ranks; stage s lives on rank s. Each step's batch
is cut into micro-batches that flow through the stages: activations forward, their
gradients back. SimpleGPipe (parallel/pipeline/plain.py) runs every forward, then every
backward; the full machinery runs any schedule, here 1F1B, which holds fewer micro-batches
at once, with torch.distributed.pipelining's API: `Schedule1F1B(stage, n_microbatches,
loss_fn).step(...)`. Both end where one process ends.
"""

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.parallel import PipelineStage, Schedule1F1B, SimpleGPipe
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores


class Stage(nn.Module):
    """Your stage s: the first takes the features, the last gives the 10 class scores."""

    def __init__(self, s: int, num_stages: int):
        rng = np.random.default_rng(s)  # the same weights whichever rank builds it
        first, last = s == 0, s == num_stages - 1
        self.fc = nn.Linear(32 if first else 64, 64, rng=rng, dtype=np.float64)
        self.out = nn.Linear(64, 10 if last else 64, rng=rng, dtype=np.float64)

    def forward(self, x) -> Tensor:
        x = x if isinstance(x, Tensor) else Tensor(x)
        return self.out(self.fc(x).relu())


world = comm.world()
P, rank = world.size, world.rank
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B, M, STEPS = 64, 4, 10  # 64 examples a step, in 4 micro-batches of 16


def batch(step: int):
    return x_all[B * step : B * (step + 1)], y_all[B * step : B * (step + 1)]


# the reference: every stage in one process, the whole batch
parts = [Stage(s, P) for s in range(P)]
opt = optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-2)
for step in range(STEPS):
    x, y = batch(step)
    opt.zero_grad()
    for part in parts:
        x = part(x)
    cross_entropy(x, y).backward()
    opt.step()
want = parts[rank].state_dict()

# GPipe, plain: one call per step on every rank, the batch's first and last ends where used
mine = Stage(rank, P)
gpipe, opt = SimpleGPipe(mine, world, n_microbatches=M), optim.AdamW(mine.parameters(), lr=1e-2)
for step in range(STEPS):
    x, y = batch(step)
    opt.zero_grad()
    loss = gpipe.step(x if rank == 0 else None, target=y if rank == P - 1 else None)
    opt.step()
    if step % 3 == 0:
        print0(f"GPipe step {step} | loss {loss:.4f}")
gap = max(np.abs(v - want[k]).max() for k, v in mine.state_dict().items())
assert gap < 1e-12, gap

# 1F1B: a PipelineStage per rank and a schedule over it; step() cuts the batch itself
mine = Stage(rank, P)
stage, opt = PipelineStage(mine, rank, P, world), optim.AdamW(mine.parameters(), lr=1e-2)
schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=cross_entropy)
for step in range(STEPS):
    x, y = batch(step)
    opt.zero_grad()
    if stage.is_first:
        schedule.step(x)
    elif stage.is_last:
        schedule.step(target=y)
    else:
        schedule.step()
    opt.step()
gap = max(gap, max(np.abs(v - want[k]).max() for k, v in mine.state_dict().items()))
assert gap < 1e-12, gap
print0(f"GPipe and 1F1B over {P} ranks against one process: largest difference {gap:.1e}")
