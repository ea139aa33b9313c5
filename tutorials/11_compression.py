# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 11 · Gradient compression: send less, and pay back what you dropped
#
# Launch line:
#
# mpiexec -n 2 python tutorials/11_compression.py
#
# Data parallelism allreduces every gradient value every step: 2(p-1)/p·4 bytes per float32
# value per rank. A compressor sends something smaller: a few of the values (top-k), their
# signs (1 bit each), a low-rank approximation (PowerSGD). What it drops is not lost: with
# error feedback each rank keeps it as a residual e and adds it to the next gradient,
#
#     Δ = g + e;   send C(Δ);   e = Δ - C(Δ)
#
# so everything a rank computes reaches the sum sooner or later. Here: one compressor by
# hand, then every compressor on a real gradient (bytes and error), then training with them,
# loss and bytes side by side. The compressors are minidp/parallel/compress*.py.

# %%
import os
import tempfile
from dataclasses import replace

import numpy as np

from minidp import comm, data, optim
from minidp.config import TrainConfig
from minidp.log import print0
from minidp.parallel import DataParallel
from minidp.parallel.compress import make_compressor
from minidp.parallel.compress_sparse import top_k_indices
from minidp.plots import pyplot, save
from minidp.tasks import Task

group = comm.world()
rank, world = group.rank, group.size

# %% [markdown]
# ## 1. Top-k with error feedback, by hand
#
# Keep the k = 2 largest magnitudes of Δ = g + e, remember the rest. The 0.3 is never among
# the two largest of g, but it grows in the residual, 0.3 more each round, until it is.

# %%
g = np.array([0.1, -2.0, 0.3, 0.05, 1.0])
e = np.zeros_like(g)
for round_ in range(4):
    delta = g + e
    keep = top_k_indices(delta, 2)
    sent = np.zeros_like(delta)
    sent[keep] = delta[keep]
    e = delta - sent
    assert np.array_equal(sent + e, delta)  # mass conserved, bit for bit
    print0(f"round {round_}: sent {sent}  residual {e}")
assert np.isclose(sent[2], 4 * 0.3), "the 0.3 waited in the residual, four rounds of it"

# %% [markdown]
# ## 2. Every compressor on a real gradient
#
# Each rank computes the gradient of the tiny GPT on its own slice of a batch. The exact
# sum is one allreduce; each compressor gives its own approximation of the same sum. The
# bytes are counted on the wire (the group's counters), the error against the exact sum.

# %%
config = TrainConfig(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=8, seed=0)
task = Task(config, np.float32)
sampler = data.DistributedSampler(task.num_examples, config.batch_size, rank, world, seed=0)
task.loss(*task.batch(sampler.local_indices(0))).backward()
params = task.model.parameters()
grad = np.concatenate([p.grad.ravel() for p in params]) / world
shapes = [p.shape for p in params]
exact = comm.allreduce(grad, group=group)


def sent_bytes(g: comm.Group) -> int:
    return sum(c["bytes_sent"] for name, c in g.counters.items() if name != "checks")


results = {}
for spec in ("fp16", "bf16", "topk:0.01", "randomk:0.01", "sign", "qsgd:4", "powersgd:2"):
    probe = group.dup()  # fresh counters for each compressor
    out = grad.copy()
    make_compressor(spec, seed=0).reduce(out, 0, probe, shapes)
    results[spec] = (sent_bytes(probe), np.linalg.norm(out - exact) / np.linalg.norm(exact))
    every = comm.allgather(out, group=group)
    assert (every == every[0]).all(), "every rank must get the same bits"
    probe.free()
full = 2 * (world - 1) / world * grad.nbytes  # what the allreduce itself sends
print0(f"{grad.size:,} gradient values; the allreduce sends {full:,.0f} bytes per rank")
for spec, (nbytes, error) in results.items():
    print0(f"  {spec:<13} {nbytes:>8,} bytes  {full / nbytes:6.1f}x less   error {error:.3f}")
assert results["fp16"][1] < 1e-3 and results["bf16"][1] < 1e-2  # casts: nearly exact
assert full / results["topk:0.01"][0] > 40 and full / results["sign"][0] > 25
assert results["powersgd:2"][1] < 1  # the low-rank part of the gradient, not all of it

# %% [markdown]
# ## 3. Why error feedback: a quadratic where sign alone stalls
#
# f(x) = ½ Σ a_i x_i² with curvatures a_i spread over two and a half decades. Scaled sign
# gives every coordinate the same step size, the mean |Δ|: too big for the flat directions
# to settle, too small for the steep ones. With error feedback the residual corrects both.

# %%
rng = np.random.default_rng(0)
a, start = np.exp(rng.uniform(-3, 3, 500)), rng.standard_normal(500)
finals = {}
for spec in ("sign", "sign-noef"):
    x, compressor = start.copy(), make_compressor(spec)
    for _ in range(1500):
        gradient = a * x / world  # every rank has the same gradient: the sum is the mean
        compressor.reduce(gradient, 0, group)
        x -= 0.5 / a.max() * gradient
    finals[spec] = 0.5 * np.sum(a * x * x)
print0(
    f"f after 1500 steps from f = {0.5 * np.sum(a * start**2):.1f}: "
    + ", ".join(f"{k} {v:.4f}" for k, v in finals.items())
)
assert finals["sign"] < finals["sign-noef"] / 10, "error feedback fixes sign here"

# %% [markdown]
# ## 4. Training with compression
#
# The same model trained four times from the same seed on the same batches: uncompressed,
# top-k at 1%, sign with error feedback and sign without it, with AdamW. Loss and bytes
# side by side.

# %%
steps = 60
curves, bytes_per_step = {}, {}
for spec in ("none", "topk:0.01", "sign", "sign-noef"):
    run = replace(config, compress=spec, steps=steps, lr=1e-2, warmup=5)
    strategy = DataParallel(Task(run, np.float32), run, group)
    shard = data.DistributedSampler(task.num_examples, run.batch_size, rank, world, seed=1)
    losses = []
    for step in range(steps):
        lr = optim.warmup_cosine(step, run.lr, run.warmup, steps, run.min_lr_ratio)
        losses.append(strategy.step(shard.local_indices(step), lr).loss)
    record = strategy.record()
    assert strategy.max_param_diff() == 0.0  # the ranks stay in lockstep
    strategy.close()
    curves[spec], bytes_per_step[spec] = losses, record["grad_bytes_sent"]
    print0(
        f"{spec:<10} final loss {np.mean(losses[-10:]):.3f} | {record['grad_bytes_sent']:>9,.0f} "
        f"bytes/step | residual {record['residual_norm'] or 0:.3f}"
    )

tail = {spec: np.mean(c[-10:]) for spec, c in curves.items()}
assert tail["topk:0.01"] < curves["none"][0] - 0.5  # it learns, on 1% of the values
assert bytes_per_step["none"] / bytes_per_step["topk:0.01"] > 40
assert max(tail["sign"], tail["sign-noef"]) < curves["none"][0] - 0.3  # both learn
# Which sign wins here is measured, not promised: the residual goes back into the gradient
# before AdamW, whose momentum amplifies its delayed bursts; on the quadratic above there was
# no momentum. (`python -m minidp bench compress` compares them on the default GPT.)

plt = pyplot()
if plt is not None and rank == 0:
    fig, ax = plt.subplots(figsize=(7, 4))
    for spec, losses in curves.items():
        ax.plot(losses, label=f"{spec} ({bytes_per_step[spec]:,.0f} B/step)")
    ax.set(xlabel="step", ylabel="training loss", title=f"compression on {world} ranks")
    ax.legend()
    save(fig, os.path.join(tempfile.gettempdir(), "minidp_11_compression.png"))
print0("compression tutorial: all checks passed")
