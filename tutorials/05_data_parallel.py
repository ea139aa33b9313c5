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
from minidp.comm.trace import Timeline
from minidp.parallel import DistributedDataParallel, SimpleDistributedDataParallel
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # 4 ranks on a few cores: one BLAS thread each, or they fight
group = comm.world()
rank, world = group.rank, group.size

x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B = 64  # the global batch
sampler = data.DistributedSampler(len(x_all), B, rank, world, seed=0)
local = sampler.local_indices(0)  # this rank's contiguous slice of the global batch
assert len(local) == B // world  # the batch divides evenly here
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


def has_reference_gradients(net) -> bool:
    """Every gradient of `net` equals the one-process gradient `want`, to rounding."""
    return all(
        np.allclose(p.grad, ref, rtol=1e-12, atol=1e-15) for p, ref in zip(net.parameters(), want)
    )


# %% [markdown]
# ## 2. Average the gradients after backward
# Each rank's loss is the mean over its own examples, so the global mean gradient is the
# average of the ranks' gradients (the batch divides evenly here). One allreduce per
# parameter, after backward has finished: that is all of `SimpleDistributedDataParallel`
# (minidp/parallel/data_parallel/plain.py), whose finish_gradient_sync is
#
#     for p in model.parameters():
#         comm.allreduce(p.grad, op="avg", group=group, out=p.grad)

# %%
model = new_model()
plain = SimpleDistributedDataParallel(model, group)  # every rank starts from rank 0's weights
cross_entropy(plain(Tensor(x_all[local])), y_all[local]).backward()
assert not has_reference_gradients(model)  # after backward: this rank's own gradient
group.reset_counters()
plain.finish_gradient_sync()
assert has_reference_gradients(model)
calls = group.counters["allreduce"]["calls"]
assert calls == len(model.parameters())
print0(f"per-parameter averaging matches one process: {calls} allreduce calls")

# %% [markdown]
# **Where a PyTorch user trips.** In PyTorch (DDP, and picotron's data parallelism),
# `loss.backward()` returns with the gradients already averaged: DDP's reducer waits for its
# last bucket at the end of backward. In minidp, `backward()` returns with each rank's own
# gradient (the assert above), and `finish_gradient_sync()` averages them: every wrapper
# here (DDP, ZeRO, FSDP) needs it between backward and the optimizer's step. Forget it and
# each rank steps with its own gradient: the copies drift apart, with no error.

# %% [markdown]
# ## 3. Buckets: fewer, larger messages
# Each allreduce pays a latency α however small it is. DDP packs gradients into a few flat
# buckets of at most `bucket_cap_mb`, in reverse parameter order (the order backward
# produces them; a parameter larger than the cap, here layers.1.weight, gets a bucket of its
# own), and makes each `p.grad` a *view* into its bucket: no packing copy, one message per
# bucket. Without
# overlap every bucket goes after backward. Two of DDP's speed tricks show here, each a
# module of its own (`ddp.tricks` lists them all; each gives the plain path's bits): the
# buckets lie in shared memory (parallel/data_parallel/shm_arena.py, algo "auto" on one machine),
# and those of at least `comm.auto.SHM_MIN` bytes (512 KiB) then go in one coalesced call
# (parallel/data_parallel/coalesce.py, `comm.allreduce_coalesced`): one set of
# synchronizations for all, each bucket summed as by itself. Smaller buckets go one by one
# by messages (the ring): below that size shared memory's three synchronizations cost more
# than the ring's messages (docs/collectives.md), and the bits are the same either way.

# %%
model = new_model()
ddp = DistributedDataParallel(model, group, bucket_cap_mb=0.3, overlap=False)
for b in ddp.buckets:
    names = [n for n, p in model.named_parameters() if any(p is q for q in b.params)]
    print0(f"bucket {b.index}: {b.data.nbytes / 2**20:.2f} MiB  {names}")
    assert b.data.nbytes <= 0.3 * 2**20 or len(b.params) == 1  # a big one gets its own
print0(f"speed tricks: {ddp.tricks}")
assert all(np.shares_memory(p.grad, b.data) for b in ddp.buckets for p in b.params)
ddp.comm_group.reset_counters()
ddp.zero_grad()
cross_entropy(ddp(Tensor(x_all[local])), y_all[local]).backward()
ddp.finish_gradient_sync()
assert has_reference_gradients(model)
calls = ddp.comm_group.counters["allreduce"]["calls"]
small = sum(b.data.nbytes < comm.auto.SHM_MIN for b in ddp.buckets)  # one call each
large = 1 if len(ddp.buckets) > small else 0  # the rest: one coalesced call
assert calls == (small + large if ddp.tricks["coalesce"] else len(ddp.buckets))
print0(f"bucketed: {len(ddp.buckets)} buckets ({small} under SHM_MIN) in {calls} allreduce "
       "call(s), same gradients")  # fmt: skip
ddp.close()

# %% [markdown]
# This model has one bucket of SHM_MIN bytes or more, so there is nothing to coalesce. The
# coalesced call itself, on two arrays of SHM_MIN bytes in shared memory: one call for both.

# %%
big = [comm.shared_zeros(comm.auto.SHM_MIN // 8, np.float64, group) for _ in range(2)]
for b in big:
    b[...] = group.rank
group.reset_counters()
comm.allreduce_coalesced(big, group=group)
assert group.counters["allreduce"]["calls"] == 1  # one set of synchronizations for both
assert all((b == sum(range(group.size))).all() for b in big)
print0(f"two shared arrays of {comm.auto.SHM_MIN:,} bytes: "
       f"{group.counters['allreduce']['calls']} coalesced allreduce call")  # fmt: skip
for b in big:
    comm.release_shared(b, group)

# %% [markdown]
# ## 4. Overlap: send a bucket as soon as its gradients are final
# The grad-ready hook of each parameter counts its bucket down; the last one hands the bucket
# to a communication thread, which reduces it while backward continues with earlier layers.
# The timeline records compute on one track and communication on another. The lines below
# are this run's: with 4 ranks sharing a few cores the thread may get to a bucket only
# after backward has ended, and the line says so.

# %%
model = new_model()
timeline = Timeline()
ddp = DistributedDataParallel(model, group, bucket_cap_mb=0.3, overlap=True, timeline=timeline)
ddp.zero_grad()
with timeline.span("backward"):
    cross_entropy(ddp(Tensor(x_all[local])), y_all[local]).backward()
with timeline.span("gradient sync wait"):
    ddp.finish_gradient_sync()
assert has_reference_gradients(model)
backward = next(e for e in timeline.events if e["name"] == "backward")
sends = sorted(
    (e for e in timeline.events if e["name"].startswith("allreduce")), key=lambda e: e["ts"]
)
assert len(sends) == len(ddp.buckets)  # one allreduce a bucket
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

# %% [markdown]
# ## 6. Gradient accumulation: micro-batches, and one product per weight
# A rank can cut its slice into K micro-batches (less activation memory at once): each loss
# weighs m_k / n_r, the first K-1 backward passes run under `ddp.no_sync()` (no
# communication), and the last one reduces the sum. Plainly, every backward adds x_k^T g_k
# into each weight's gradient: a matrix product that writes the whole gradient, then an
# addition that reads and writes it again, K times. Under `no_sync` a Linear's weight keeps
# copies of the rows x_k and g_k instead (`minidp.defer_weight_grads()`), and the last
# backward multiplies them once: sum_k x_k^T g_k = [x_1; ...; x_K]^T [g_1; ...; g_K], the
# product of the whole slice. The copies never take more memory than the gradient itself
# (past that, the rows so far are multiplied at once), and reading `.grad` in between
# multiplies what is kept, so no reader ever sees a partial gradient.

# %%
import contextlib  # noqa: E402
import time  # noqa: E402

from minidp import defer_weight_grads  # noqa: E402

K = 4
cuts = comm.chunk_bounds(len(local), K)
parts = [local[lo:hi] for lo, hi in zip(cuts, cuts[1:])]


def accumulate(net, defer_first: bool, no_sync=None):
    """K backward passes into net's gradients; the first K-1 deferred if `defer_first`."""
    for k, part in enumerate(parts):
        first = k < K - 1 and defer_first
        block = (no_sync or defer_weight_grads)() if first else contextlib.nullcontext()
        with block:
            loss = cross_entropy(net(Tensor(x_all[part])), y_all[part])
            (loss * (len(part) / len(local))).backward()


model = new_model()
ddp = DistributedDataParallel(model, group, bucket_cap_mb=0.3)
ddp.zero_grad()
accumulate(ddp, True, ddp.no_sync)
ddp.finish_gradient_sync()
assert has_reference_gradients(model)
print0(f"{K} micro-batches, the last outside no_sync: the whole global batch's gradient")
ddp.zero_grad()
for part in parts:  # every micro-batch inside no_sync, the last one too
    with ddp.no_sync():
        loss = cross_entropy(ddp(Tensor(x_all[part])), y_all[part])
        (loss * (len(part) / len(local))).backward()
ddp.finish_gradient_sync()  # reduces what was accumulated
assert has_reference_gradients(model)
print0(f"{K} micro-batches, all inside no_sync, then finish_gradient_sync(): the same")
ddp.close()

# %% [markdown]
# **Where a PyTorch user trips.** In PyTorch the sync happens inside a backward: the one
# that runs *outside* `no_sync()`. Run every micro-batch inside it and nothing is ever
# averaged (silently); so the last micro-batch must run outside. In minidp the sync is
# `finish_gradient_sync()`, which reduces whatever was accumulated, inside `no_sync` or not
# (the second check above). Running the last micro-batch outside `no_sync` is still the
# better order: its buckets then go out while its backward runs (section 4).
#
# Is deferring faster? It saves K−1 passes that read and write each weight's gradient, and
# does one product of K·m rows instead of K products of m rows; it costs copying the rows.
# Which wins depends on the sizes and on the BLAS: with one BLAS thread a rank (several
# threads per rank on a shared machine measure the threads' fight, not the idea) and these
# 256-wide layers it is usually deferring, but the line below is this run's measurement,
# one process, the two alternated, 30 pairs; this tutorial asserts no time.

# %%
net = new_model()
seconds = {False: [], True: []}
for pair in range(32):  # plain, deferred, plain, deferred, ...: the two see the same machine
    for defer in (False, True):
        net.zero_grad()
        start = time.perf_counter()
        accumulate(net, defer)
        _ = [p.grad for p in net.parameters()]  # the read that multiplies deferred rows
        if pair >= 2:  # two warm-up pairs
            seconds[defer].append(time.perf_counter() - start)
plain_ms, deferred_ms = (1e3 * float(np.median(seconds[d])) for d in (False, True))
ratio = float(np.median(np.array(seconds[False]) / np.array(seconds[True])))
print0(
    f"{K} micro-batches of {len(parts[0])} rows: plain {plain_ms:.2f} ms, deferred "
    f"{deferred_ms:.2f} ms per accumulation (median plain/deferred per pair: {ratio:.2f})"
)
