# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 16 · Horovod's API: allreduce by hand, the wrapped optimizer, the mixed version, Adasum
#
# Launch line:
#
# mpiexec -n 4 python tutorials/16_horovod.py
#
# Horovod (Sergeev & Del Balso, 2018) made data parallelism a few lines added to a training
# script: `hvd.init()`, an optimizer wrapped so gradients are averaged, the initial weights
# broadcast. `import minidp.horovod as hvd` gives those names on minidp's collectives. Three
# examples, each checked against one process: data parallelism over two parts of the data
# with the allreduce written by hand; the wrapped optimizer over every rank; the mixed
# version, the model split over two ranks (tensor parallelism) and Horovod across the
# pairs. Then Horovod's Adasum against the average when the batch grows.

# %%
import os
import tempfile

import numpy as np

import minidp.horovod as hvd
from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.parallel.tensor_parallel import (
    ColwiseParallel,
    RowwiseParallel,
    gather_full,
    parallelize_module,
)
from minidp.tools.chunks import chunk_range
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0
from minidp.tools.plots import pyplot, save

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores

hvd.init()
world = comm.world()
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B, STEPS, LR = 64, 12, 0.05


class Net(nn.Module):
    """A small classifier of the 32-feature clusters: the same weights on every rank."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.fc1 = nn.Linear(32, 64, rng=rng, dtype=np.float64)
        self.fc2 = nn.Linear(64, 10, rng=rng, dtype=np.float64)

    def forward(self, x):
        return self.fc2(self.fc1(Tensor(x)).relu())


def batch(step: int):
    return x_all[B * step : B * (step + 1)], y_all[B * step : B * (step + 1)]


def alone() -> dict:
    """The reference: one process, every step's whole batch."""
    model = Net()
    opt = optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.copy() for k, v in model.state_dict().items()}


def gap(state: dict, want: dict) -> float:
    return max(float(np.abs(state[k] - v).max()) for k, v in want.items())


want = alone()

# %% [markdown]
# ## 1. Data parallelism over two parts of the data, the allreduce by hand
#
# Two ranks, each with its half of every batch: forward and backward on its half, then each
# gradient averaged over the two with `hvd.allreduce` (op Average), then the same step on
# both. The world of 4 runs it as two pairs, {0, 1} and {2, 3} (a *process set* each).

# %%
pair = world.split(world.rank // 2)
model = Net()
opt = optim.SGD(model.parameters(), lr=LR, momentum=0.9)
lo, hi = chunk_range(B, 2, pair.rank)
for step in range(STEPS):
    x, y = batch(step)
    opt.zero_grad()
    cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
    for p in model.parameters():
        p.grad = hvd.allreduce(p.grad, op=hvd.Average, process_set=pair)
    opt.step()
print0(f"1. by hand over two halves: {gap(model.state_dict(), want):.1e} from one process")
assert gap(model.state_dict(), want) < 1e-12

# %% [markdown]
# ## 2. The Horovod-wrapped optimizer, every rank from rank 0's start
#
# The script Horovod's documentation shows: the optimizer wrapped, then the model's and the
# optimizer's state broadcast from rank 0 (here every rank starts from other weights, so the
# broadcast matters: `model.state_dict()` holds the parameters' own arrays, filled in
# place). `step()` averages the gradients of the 4 quarters, then steps.

# %%
model = Net()
for p in model.parameters():
    p.data += 0.5 * hvd.rank()  # a different start on every rank
opt = hvd.DistributedOptimizer(
    optim.SGD(model.parameters(), lr=LR, momentum=0.9),
    named_parameters=model.named_parameters(),
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
lo, hi = chunk_range(B, hvd.size(), hvd.rank())
for step in range(STEPS):
    x, y = batch(step)
    opt.zero_grad()
    cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
    opt.step()
print0(f"2. DistributedOptimizer over {hvd.size()} ranks: {gap(model.state_dict(), want):.1e}")
assert gap(model.state_dict(), want) < 1e-12

# %% [markdown]
# ## 3. The mixed version: the model over a pair, Horovod across the pairs
#
# Parameter parallelism inside each pair: fc1's output features split over the pair's two
# ranks, fc2's input features likewise (`parallelize_module`, tensor parallelism), so each
# rank holds half the weights. Data parallelism across the pairs: rank 0 and rank 2 hold
# the same half, and average its gradients over their process set, each pair on its half
# of the batch.
#
#     ranks     0 1 | 2 3          model halves: 0 and 2 hold one, 1 and 3 the other
#     pairs     {0, 1} {2, 3}      tensor parallel: f and g inside the model
#     across    {0, 2} {1, 3}      hvd.DistributedOptimizer(process_set=across)

# %%
across = world.split(world.rank % 2)
model = parallelize_module(Net(), pair, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
opt = hvd.DistributedOptimizer(
    optim.SGD(model.parameters(), lr=LR, momentum=0.9), process_set=across
)
lo, hi = chunk_range(B, 2, across.rank)  # the pair's half of each batch
for step in range(STEPS):
    x, y = batch(step)
    opt.zero_grad()
    cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
    opt.step()
whole = gather_full(model)  # the two halves of the weights, put together
held = sum(p.size for p in model.parameters() if p.ndim == 2)  # this rank's weight matrices
assert 2 * held == sum(p.size for p in Net().parameters() if p.ndim == 2)  # half of them
print0(f"3. tensor parallel x Horovod (2 x 2): {gap(whole, want):.1e} from one process")
assert gap(whole, want) < 1e-12

# %% [markdown]
# ## 4. Average against Adasum as the batch grows
#
# Averaging N ranks' gradients keeps the step of one rank's batch only where they agree;
# where they point different ways it shrinks (the learning rate must then be retuned for
# the bigger batch). Adasum (`op=hvd.Adasum`, adasum.py) combines two gradients as
# (1 - g1·g2 / 2|g1|²) g1 + (1 - g1·g2 / 2|g2|²) g2: their sum where they are orthogonal,
# their average where they are equal, and applies it as a tree over the ranks. Plain SGD on
# 4 ranks (16 examples each), one learning rate for the three (1.0, large: the step of one
# rank's batch), 36 steps. First the formula's two cases, on a pair:


# %%
def curve(op, lr: float = 1.0) -> list[float]:
    model = Net()
    opt = hvd.DistributedOptimizer(optim.SGD(model.parameters(), lr=lr), op=op)
    lo, hi = chunk_range(B, hvd.size(), hvd.rank())
    losses = []
    for step in range(3 * STEPS):
        x, y = x_all[B * step % 4096 :][:B], y_all[B * step % 4096 :][:B]
        opt.zero_grad()
        loss = cross_entropy(model(x[lo:hi]), y[lo:hi])
        loss.backward()
        opt.step()
        losses.append(float(hvd.allreduce(np.array([loss.item()]))[0]))
    return losses


orthogonal = hvd.allreduce(np.eye(2)[pair.rank], op=hvd.Adasum, process_set=pair)
equal = hvd.allreduce(np.array([3.0, -1.0]), op=hvd.Adasum, process_set=pair)
assert np.allclose(orthogonal, [1.0, 1.0]) and np.allclose(equal, [3.0, -1.0])
print0(f"4. Adasum of e0 and e1: {orthogonal} (the sum); of g and g: {equal} (the average)")
curves = {"Average": curve(hvd.Average), "Adasum": curve(hvd.Adasum), "Sum": curve(hvd.Sum)}
for name, losses in curves.items():
    print0(f"4. {name:8s} loss after {len(losses)} steps: {losses[-1]:.4f} (from {losses[0]:.4f})")
plt = pyplot()
if plt is not None and hvd.rank() == 0:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, losses in curves.items():
        ax.plot(losses, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the ranks)")
    ax.set_yscale("log")
    ax.set_title(f"{hvd.size()} ranks, SGD, lr 1.0")
    ax.legend()
    save(fig, os.path.join(tempfile.gettempdir(), "minidp_16_adasum.png"))
final = {name: losses[-1] for name, losses in curves.items()}
assert final["Sum"] > curves["Sum"][0]  # diverges
assert final["Adasum"] < final["Average"] < curves["Average"][0]  # Adasum ends lowest

# %% [markdown]
# The sum takes N times the step and diverges; the average is safe but takes 1/N of it
# where the ranks' gradients disagree; Adasum ends lowest (the lines above; float64 on a
# fixed number of ranks, so every run prints the same, and the asserts check the order):
# its step grows toward the sum where the ranks' gradients carry different information,
# and stays the average where they agree.
# Horovod also offers
# `hvd.join()` for ranks with fewer batches than others, and `Compression.fp16` (half the
# bytes on the wire); docs/horovod.md has them, and the table of what each name maps to.
