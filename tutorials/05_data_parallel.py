# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 05 · Data parallelism: average, then bucket, then overlap
#
# Launch line:
#
# mpiexec -n 4 python tutorials/05_data_parallel.py
#
# Every rank keeps a whole copy of the model and reads a quarter of the global batch. If the
# ranks average their gradients before each step, every copy takes the same step that one
# process would take on the whole batch. This tutorial builds that up the way PyTorch DDP
# does: first the plain average, then buckets, then overlapping communication with backward.

# %%
import os
import tempfile

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn
from minidp.log import print0
from minidp.parallel import DistributedDataParallel
from minidp.trace import Timeline

group = comm.world()
rank, world = group.rank, group.size

x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B = 64  # the global batch
sampler = data.DistributedSampler(len(x_all), B, rank, world, seed=0)
local = sampler.local_indices(0)  # this rank's contiguous slice of the global batch
print0(f"{world} ranks; global batch {B}; rank 0 reads {len(local)} examples")


def new_model():
    return nn.MLP([32, 256, 256, 10], rng=np.random.default_rng(0), dtype=np.float64)


# %% [markdown]
# ## 1. The reference: one process, the whole global batch

# %%
single = new_model()
cross_entropy(
    single(Tensor(x_all[sampler.global_indices(0)])), y_all[sampler.global_indices(0)]
).backward()
want = [p.grad.copy() for p in single.parameters()]

# %% [markdown]
# ## 2. Average the gradients after backward
# Each rank's loss is the mean over its own examples, so the global mean gradient is the
# average of the ranks' gradients (the batch divides evenly here). One allreduce per
# parameter, after backward has finished.

# %%
model = new_model()
cross_entropy(model(Tensor(x_all[local])), y_all[local]).backward()
group.reset_counters()
for p in model.parameters():
    comm.allreduce(p.grad, op="avg", group=group, out=p.grad)
for got, ref in zip((p.grad for p in model.parameters()), want):
    assert np.allclose(got, ref, rtol=1e-12, atol=1e-15)
calls = group.counters["allreduce"]["calls"]
print0(f"per-parameter averaging matches one process: {calls} allreduce calls")

# %% [markdown]
# ## 3. Buckets: fewer, larger messages
# Each allreduce pays a latency α however small it is. DDP packs gradients into a few flat
# buckets, in reverse parameter order (the order backward produces them), and makes each
# `p.grad` a *view* into its bucket: no packing copy, one message per bucket.

# %%
model = new_model()
ddp = DistributedDataParallel(model, group, bucket_cap_mb=0.3, overlap=False)
for b in ddp.buckets:
    names = [n for n, p in model.named_parameters() if any(p is q for q in b.params)]
    print0(f"bucket {b.index}: {b.data.nbytes / 2**20:.2f} MiB  {names}")
assert all(np.shares_memory(p.grad, b.data) for b in ddp.buckets for p in b.params)
ddp.comm_group.reset_counters()
ddp.zero_grad()
cross_entropy(ddp(Tensor(x_all[local])), y_all[local]).backward()
ddp.finish_gradient_sync()
assert all(
    np.allclose(p.grad, ref, rtol=1e-12, atol=1e-15) for p, ref in zip(model.parameters(), want)
)
print0(f"bucketed: {ddp.comm_group.counters['allreduce']['calls']} allreduce calls, same gradients")
ddp.close()

# %% [markdown]
# ## 4. Overlap: send a bucket as soon as its gradients are final
# The grad-ready hook of each parameter counts its bucket down; the last one hands the bucket
# to a communication thread, which reduces it while backward continues with earlier layers.
# The timeline records compute on one track and communication on another.

# %%
model = new_model()
timeline = Timeline()
ddp = DistributedDataParallel(model, group, bucket_cap_mb=0.3, overlap=True, timeline=timeline)
ddp.zero_grad()
with timeline.span("backward"):
    cross_entropy(ddp(Tensor(x_all[local])), y_all[local]).backward()
with timeline.span("gradient sync wait"):
    ddp.finish_gradient_sync()
assert all(
    np.allclose(p.grad, ref, rtol=1e-12, atol=1e-15) for p, ref in zip(model.parameters(), want)
)
backward = next(e for e in timeline.events if e["name"] == "backward")
sends = sorted(
    (e for e in timeline.events if e["name"].startswith("allreduce")), key=lambda e: e["ts"]
)
backward_end = backward["ts"] + backward["dur"]
for e in sends:  # when the thread got to each bucket: on a busy machine, maybe only later
    where = "during backward" if e["ts"] < backward_end else "after backward"
    start_us = e["ts"] - backward["ts"]
    print0(f"  {e['name']:<20} starts {start_us:8.0f} us after backward began ({where})")
path = os.path.join(tempfile.gettempdir(), "minidp_05_timeline.json")
timeline.save(path, group)  # open it in ui.perfetto.dev: one process per rank
print0(f"timeline written to {path}")
ddp.close()

# %% [markdown]
# ## 5. Training: every rank stays identical, and matches one process
# The training loop drives this through the "dp" strategy (`minidp.parallel.DataParallel`,
# the first implementation of the strategy protocol every scheme follows), which adds
# micro-batches (`no_sync`) and uneven batches (each rank's share n_r / B) on top of this;
# `mpiexec -n 4 python -m minidp` runs it.

# %%
from minidp import optim  # noqa: E402

model, single = new_model(), new_model()
ddp = DistributedDataParallel(model, group, bucket_cap_mb=0.3)
opt, opt_single = optim.SGD(ddp.parameters(), lr=0.1), optim.SGD(single.parameters(), lr=0.1)
for step in range(5):
    idx, full = sampler.local_indices(step), sampler.global_indices(step)
    ddp.zero_grad()
    cross_entropy(ddp(Tensor(x_all[idx])), y_all[idx]).backward()
    ddp.finish_gradient_sync()
    opt.step()
    opt_single.zero_grad()
    cross_entropy(single(Tensor(x_all[full])), y_all[full]).backward()
    opt_single.step()
flat = np.concatenate([p.data.ravel() for p in model.parameters()])
spread = comm.allreduce(flat, op="max", group=group) - comm.allreduce(flat, op="min", group=group)
assert spread.max() == 0.0, "every rank must hold bitwise-identical parameters"
assert all(
    np.allclose(p.data, q.data, rtol=1e-10) for p, q in zip(model.parameters(), single.parameters())
)
print0("5 data-parallel steps == 5 single-process steps; ranks identical")
ddp.close()
