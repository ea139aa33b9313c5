"""A checkpoint of your own training loop: saved by 4 ranks under FSDP, resumed by 2 under DDP.

    mpiexec -n 4 python examples/checkpoint.py

checkpoint.get_state_dict(model, optimizer) names what this rank holds, by parameter name:
whole arrays, or `Sharded` slices (FSDP's range of each flattened parameter) that say which
elements of the whole tensor they are. Each rank writes one safetensors shard and rank 0 a
manifest, last, that commits the save. checkpoint.load fills another layout's state dict in
place, cutting each entry from the shards that hold it; set_state_dict hands it to the
wrapper and the optimizer. Training on 2 ranks from step 10 ends where 20 uninterrupted
steps of one process end.
"""

import shutil
import tempfile

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.parallel import DistributedDataParallel, FullyShardedDataParallel, checkpoint
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores


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
folder = comm.broadcast_text(tempfile.mkdtemp() if world.rank == 0 else "", root=0, group=world)


def train(wrapper, opt, group, steps):
    """Each rank its slice of each step's global batch."""
    for step in steps:
        sampler = data.DistributedSampler(len(x_all), B, group.rank, group.size, seed=0)
        mine = sampler.local_indices(step)
        opt.zero_grad()
        cross_entropy(wrapper(x_all[mine]), y_all[mine]).backward()
        wrapper.finish_gradient_sync()
        opt.step()


# 4 ranks, FSDP: 10 steps, then save what each rank holds
with FullyShardedDataParallel(Net(), world) as fsdp:
    opt = optim.AdamW(fsdp.parameters(), lr=1e-2)
    train(fsdp, opt, world, range(SAVED))
    model_sd, optim_sd = checkpoint.get_state_dict(fsdp, opt)
    if world.rank == 0:
        print(f"rank 0 holds elements {model_sd['head.weight'].where.runs[0]} of head.weight")
    path = checkpoint.step_directory(folder, SAVED)
    checkpoint.save({"model": model_sd, "optim": optim_sd}, path, world, step=SAVED)
    print0(f"saved {path} from {world.size} ranks")

# 2 ranks, DDP: the state dict of the new layout, filled in place, then 10 more steps
half = world.split(0 if world.rank < 2 else None)
if half is not None:
    model = Net()
    with DistributedDataParallel(model, half) as ddp:
        opt = optim.AdamW(model.parameters(), lr=1e-2)
        model_sd, optim_sd = checkpoint.get_state_dict(ddp, opt)
        state = {"model": model_sd, "optim": optim_sd}
        checkpoint.load(state, checkpoint.latest(folder), half)
        checkpoint.set_state_dict(ddp, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        train(ddp, opt, half, range(SAVED, STEPS))

    alone = Net()  # the check: one process, 20 steps in a row
    opt = optim.AdamW(alone.parameters(), lr=1e-2)
    with DistributedDataParallel(alone, half.split(half.rank)) as one:
        train(one, opt, one.group, range(STEPS))
    gap = max(np.abs(p.data - q.data).max() for p, q in zip(model.parameters(), alone.parameters()))
    assert gap < 1e-10, gap
    print0(f"resumed on {half.size} ranks from step {SAVED}: against one process {gap:.1e}")
comm.barrier(group=world)
if world.rank == 0:
    shutil.rmtree(folder)
