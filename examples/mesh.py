"""The 3-D mesh on a model of your own: data x tensor x pipeline parallelism, 2 x 2 x 2.

    mpiexec -n 8 python examples/mesh.py

`Mesh` lays the 8 ranks out as a grid and gives each rank one group per axis. Your model is
cut into 2 pipeline stages; inside a stage its MLP is split over the tensor-parallel pair;
the two copies of the whole pipeline read halves of each batch and DDP averages their
gradients. Three wraps, each a piece: ColumnParallelLinear / RowParallelLinear,
PipelineStage, DistributedDataParallel. The check: every step's loss equals one process's.
"""

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.parallel import (
    ColumnParallelLinear,
    DistributedDataParallel,
    Mesh,
    PipelineStage,
    RowParallelLinear,
    Schedule1F1B,
    run_schedule,
    split_batch,
)
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores


class Stage(nn.Module):
    """Your stage s of 2: the features in (first), an MLP block, the class scores (last)."""

    def __init__(self, s: int):
        rng = np.random.default_rng(s)
        self.fc_in = nn.Linear(32 if s == 0 else 64, 64, rng=rng, dtype=np.float64)
        self.fc1 = nn.Linear(64, 128, rng=rng, dtype=np.float64)
        self.fc2 = nn.Linear(128, 64, rng=rng, dtype=np.float64)
        self.out = nn.Linear(64, 10, rng=rng, dtype=np.float64) if s == 1 else None

    def forward(self, x) -> Tensor:
        h = self.fc_in(x if isinstance(x, Tensor) else Tensor(x)).relu()
        h = h + self.fc2(self.fc1(h).relu())
        return self.out(h) if self.out else h


mesh = Mesh(dp=2, tp=2, pp=2)
d, p = mesh.coords["dp"], mesh.coords["pp"]
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B, M, STEPS = 64, 4, 8  # each copy of the pipeline: 32 examples a step, 4 micro-batches

mine = Stage(p)  # wrap 1: tensor parallelism inside the stage
mine.fc1 = ColumnParallelLinear(mine.fc1, mesh.tp_group)
mine.fc2 = RowParallelLinear(mine.fc2, mesh.tp_group)
stage = PipelineStage(mine, p, 2, mesh.pp_group)  # wrap 2: the pipeline
schedule = Schedule1F1B(2, M)
parts = [Stage(0), Stage(1)]  # the reference: the whole model in one process
opt_alone = optim.AdamW([q for part in parts for q in part.parameters()], lr=1e-2)

with DistributedDataParallel(mine, mesh.dp_group, overlap=False) as ddp:  # wrap 3: copies
    opt = optim.AdamW(mine.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = x_all[B * step : B * (step + 1)], y_all[B * step : B * (step + 1)]
        half = slice(d * B // 2, (d + 1) * B // 2)  # this copy's examples
        micro_x, micro_y, shares = split_batch(x[half], y[half], M)
        opt.zero_grad()
        with ddp.no_sync():  # the micro-batches' gradients add up, then one reduction
            losses = run_schedule(schedule, {p: stage}, micro_x, micro_y, shares)
        ddp.finish_gradient_sync()  # (PyTorch: a last backward outside no_sync reduces)
        opt.step()
        copy_loss = comm.broadcast(np.array([sum(losses, 0.0)]), root=1, group=mesh.pp_group)
        loss = comm.allreduce(copy_loss, op="avg", group=mesh.dp_group)[0]

        opt_alone.zero_grad()
        h = x
        for part in parts:
            h = part(h)
        want = cross_entropy(h, y)
        want.backward()
        opt_alone.step()
        assert abs(loss - want.item()) < 1e-10, (step, loss, want.item())
        print0(f"step {step} | loss {loss:.6f} (one process {want.item():.6f})")
# and the parameters: this rank's slices of fc1 (columns) and fc2 (rows), the rest whole
t, ref = mesh.coords["tp"], parts[p]
cols = slice(t * 64, (t + 1) * 64)  # ColumnParallelLinear's chunk of 128 outputs
pairs = [(mine.fc1.weight, ref.fc1.weight.data[:, cols])]
pairs += [(mine.fc2.weight, ref.fc2.weight.data[cols])]
pairs += [(mine.fc_in.weight, ref.fc_in.weight.data), (mine.fc2.bias, ref.fc2.bias.data)]
assert max(np.abs(a.data - b).max() for a, b in pairs) < 1e-10
print0(f"{mesh.describe()}: every step's loss and the parameters equal one process's")
mesh.close()
