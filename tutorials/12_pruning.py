# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 12 · Pruning: a lighter model that sends less
#
# Launch line:
#
# mpiexec -n 2 python tutorials/12_pruning.py
#
# Magnitude pruning zeroes the weights of smallest |w| and keeps them zero while the rest
# trains on. Under data parallelism a zero that stays zero needs no gradient, so each step
# sends only the gradients of the weights still alive. This tutorial builds it up: the mask,
# why AdamW needs more than a zeroed gradient, the cubic schedule, the DP hook that packs
# the kept gradients, the same on your own model with torch.nn.utils.prune's functions,
# pruning a model against simply training a smaller one, and last, structured pruning,
# which removes whole heads and channels so the model really shrinks.

# %%
import contextlib
import io
import json
import os
import tempfile
from dataclasses import replace

import numpy as np

from minidp import Tensor, comm, nn, optim
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.models.data import DistributedSampler
from minidp.models.gpt import GPT, GPTConfig
from minidp.models.prune import functions as prune
from minidp.models.prune import structured
from minidp.models.prune.magnitude import (
    MagnitudePruner,
    cubic_sparsity,
    magnitude_masks,
    prunable,
)
from minidp.models.tasks import Task
from minidp.parallel import DistributedDataParallel
from minidp.parallel.pruning import masked_allreduce_hook
from minidp.parallel.structured_pruning import prune_structured
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0
from minidp.tools.plots import pyplot, save

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores

group = comm.world()

# %% [markdown]
# ## 1. The mask: keep the largest magnitudes
# At sparsity s, round(s n) weights of smallest |w| get mask 0. Per layer, each matrix
# loses the same fraction; globally, one threshold for all, so a matrix of small weights
# loses more. (torch.nn.utils.prune's `l1_unstructured` and `global_unstructured` give the
# same masks: tests/test_prune.py checks it.)

# %%
big = np.array([[4.0, -3.0], [2.0, 5.0]])
small = np.array([[0.1, -0.4], [0.3, 0.2]])
per_layer = magnitude_masks([big, small], 0.5, "layer")
one_threshold = magnitude_masks([big, small], 0.5, "global")
print0("per layer:", [m.astype(int).tolist() for m in per_layer])
print0("global:   ", [m.astype(int).tolist() for m in one_threshold])
assert per_layer[0].sum() == per_layer[1].sum() == 2  # half of each
assert one_threshold[0].all() and not one_threshold[1].any()  # the small matrix goes first

# %% [markdown]
# ## 2. Zero must stay zero: AdamW remembers
# Zero a weight and its gradient, and AdamW still moves it: its first moment m holds the
# weight's past gradients and decays over ~1/(1 - β1) = 10 steps. The pruner also zeroes
# the masked entries of m and v; with g = m = v = 0 the update is 0 / (0 + ε) = 0, and the
# decoupled decay (1 - lr·wd)·0 = 0.

# %%
rng = np.random.default_rng(0)
x, y = Tensor(rng.standard_normal((64, 8))), rng.integers(0, 4, 64)


def drift_after_pruning(zero_the_moments: bool) -> float:
    """Train 3 steps, prune to 70%, train 5 more; the largest |w| among the pruned."""
    model = nn.MLP([8, 32, 4], rng=np.random.default_rng(1), dtype=np.float64)
    opt = optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    pruner = MagnitudePruner(model, opt if zero_the_moments else None, target=0.7)
    for step in range(8):
        if step == 3:
            pruner.prune_to(0.7)
        opt.zero_grad()
        nn.cross_entropy(model(x), y).backward()
        pruner.mask_grads()
        opt.step()
    return max(np.abs(p.data[~m]).max() for p, m in zip(pruner.params, pruner.masks))


naive, pruned = drift_after_pruning(False), drift_after_pruning(True)
print0(f"largest pruned |w| after 5 steps: gradient zeroed {naive:.3g}; moments too {pruned}")
assert naive > 1e-3 and pruned == 0.0

# %% [markdown]
# ## 3. The schedule (Zhu & Gupta 2017)
# Prune gradually, from s = 0 at step t0 to the target s_f at step `end`, every Δt steps:
# s_t = s_f (1 - (1 - (t - t0)/(end - t0))³). Fast at first, while many weights are
# redundant, slowly near the end, so the network has time to recover.

# %%
s_t = {t: cubic_sparsity(t, 0.9, 10, 40) for t in range(10, 41, 5)}
print0("s_t:", ", ".join(f"{t}: {s:.2f}" for t, s in s_t.items()))
assert all(np.isclose(s, 0.9 * (1 - (1 - (t - 10) / 30) ** 3)) for t, s in s_t.items())
rises = np.diff(list(s_t.values()))
assert s_t[10] == 0 and s_t[40] == 0.9 and (np.diff(rises) < 0).all()  # fast, then slow

# %% [markdown]
# ## 4. Data parallelism sends the kept gradients only
# `--prune` plugs a communication hook into DDP (minidp/parallel/pruning.py): each
# bucket's unmasked gradients are packed with `np.take`, allreduced, and put back; masked
# slots are zeroed, never sent. No mask is ever sent either: every rank computes it from
# its replica, and replicas are bitwise identical. With the ring, each rank sends
# 2(N-1)/N of each packed bucket.

# %%
config = TrainConfig(n_layer=1, n_embd=32, block_size=16, batch_size=8, steps=12, allreduce="ring",
                     prune=0.9, prune_start=2, prune_end=8, prune_every=2)  # fmt: skip
strategy = DataParallel(Task(config, np.dtype(config.dtype)), config, group)
sampler = DistributedSampler(strategy.task.num_examples, config.batch_size,
                             *strategy.data_shard, seed=config.seed)  # fmt: skip
hook, N = strategy.pruning, group.size
print0(f"{hook.dense_elements} gradient values; sent per rank and step:")
for step in range(config.steps):
    strategy.step(sampler.local_indices(step), 3e-3)
    kept = hook.step_elements
    total = sum(group.comm.allgather(hook.step_bytes))  # over the ranks: 2(N-1) packed copies
    assert total == 2 * (N - 1) * kept * 4  # float32
    assert kept == hook.dense_elements - sum(int((~m).sum()) for m in hook.pruner.masks)  # alive
    if step % 2 == 0 or step == config.steps - 1:
        s = hook.pruner.sparsity()
        print0(f"  step {step:2d}: sparsity {s:.2f}, {kept:6d} values, {hook.step_bytes:7d} B")
masks = b"".join(m.tobytes() for m in hook.pruner.masks)
assert len(set(group.comm.allgather(masks))) == 1, "every rank holds the same masks"
assert strategy.max_param_diff() == 0.0
strategy.close()

# %% [markdown]
# ## 5. Your own model: torch.nn.utils.prune's functions
# The pieces above, as functions on a model you built, under PyTorch's names:
# `l1_unstructured(module, "weight", amount)` for one matrix, `global_unstructured(pairs,
# amount)` for one threshold over many, `remove` to make it permanent, `is_pruned`. Each
# zeroes the weight, keeps `module.weight_mask`, and hooks the weight so its masked
# gradient is zeroed as backward finishes it (torch multiplies by the mask in forward
# instead). Prune before wrapping in DDP; `masked_allreduce_hook(ddp)` then sends only
# the kept gradients.

# %%
model = nn.MLP([8, 32, 4], rng=np.random.default_rng(1), dtype=np.float64)
prune.global_unstructured([(layer, "weight") for layer in model.layers], amount=0.75)
with DistributedDataParallel(model, group, algo="ring", overlap=False) as ddp:
    hook = masked_allreduce_hook(ddp)
    opt = optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    mine = np.array_split(np.arange(len(y)), group.size)[group.rank]  # this rank's slice
    for _ in range(4):
        opt.zero_grad()
        nn.cross_entropy(ddp(Tensor(x.data[mine])), y[mine]).backward()
        ddp.finish_gradient_sync()
        opt.step()
print0(f"sent {hook.step_elements} of {hook.dense_elements} gradient values per step")
n_weights = sum(layer.weight.size for layer in model.layers)  # the biases are all sent
assert hook.step_elements == hook.dense_elements - round(0.75 * n_weights)
for layer in model.layers:
    assert (layer.weight.data[~layer.weight_mask] == 0).all()  # still exactly zero
    prune.remove(layer, "weight")  # permanent: the zeros stay, the mask goes
assert not prune.is_pruned(model)

# %% [markdown]
# ## 6. Pruning against shrinking
# The other way to a lighter model: train a smaller one. Width 32 pruned to 75% keeps a
# quarter of its weight-matrix values; a dense model of width 16 has a quarter of the
# blocks' matrices but half of the embeddings' (V x C and T x C), so it keeps a few more
# (both counted below). The same data, steps and seed; `python -m minidp bench prune` runs
# the whole table.

# %%
base = TrainConfig(n_layer=1, block_size=32, steps=80, log_every=4, sample_tokens=0)
schedule = dict(prune=0.75, prune_start=10, prune_end=50, prune_every=5)
runs = {"width 32 dense": dict(n_embd=32), "width 32, 75% pruned": dict(n_embd=32, **schedule),
        "width 16 dense": dict(n_embd=16)}  # fmt: skip
curves, finals = {}, {}
with tempfile.TemporaryDirectory() as tmp:
    for name, change in runs.items():
        path = os.path.join(tmp, f"{group.rank}.json")
        run_config = replace(base, **change, json=path)
        run_config.validate()
        with contextlib.redirect_stdout(io.StringIO()):
            finals[name] = train(run_config, group)
        if group.rank == 0:
            curves[name] = [json.loads(line) for line in open(path)][:-1]
for name, final in finals.items():
    sent = final.get("prune_bytes_per_step", final["bytes_sent_by_axis"]["dp"] / base.steps)
    print0(f"{name:22s} val loss {final['val_loss']:.4f} | {sent / 1e3:6.1f} kB sent per step")
dense_loss, pruned_loss, small_loss = (finals[name]["val_loss"] for name in runs)
assert finals["width 32, 75% pruned"]["prune_sparsity"] > 0.74
left = {  # the weight-matrix values each keeps
    width: sum(p.size for _, p in prunable(Task(replace(base, n_embd=width), np.float32).model))
    for width in (32, 16)
}
print0(f"weight-matrix values kept: width 32 pruned {left[32] // 4:,}, width 16 {left[16]:,}")
assert left[32] // 4 < left[16] < left[32] // 2
# here, with fewer weights left, the pruned wide model beats the narrow dense one
assert dense_loss < small_loss and pruned_loss < small_loss

# %% [markdown]
# A picture: loss and bytes per step over training (rank 0).

# %%
plt = pyplot() if group.rank == 0 else None
if plt is not None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, records in curves.items():
        steps = [r["step"] for r in records]
        left.plot(steps, [r["loss"] for r in records], label=name)
        right.plot(steps, [r["bytes_sent_per_step"] / 1e3 for r in records], label=name)
    left.set(xlabel="step", ylabel="training loss", title="loss")
    right.set(xlabel="step", ylabel="kB sent per rank per step", title="bytes on the wire")
    left.legend()
    save(fig, os.path.join(tempfile.gettempdir(), "minidp_12_pruning.png"))

# %% [markdown]
# ## 7. Structured pruning: remove heads and channels, and the model really shrinks
# Masks keep every matrix its shape. Remove whole attention heads and MLP channels
# instead, by the L2 norm of what each owns (torch's `ln_structured`), and slice the
# weights: a smaller dense GPT. The scores are averaged over the group first, so every
# rank removes the same ones. Slicing drops only zeros: the sliced model computes what the
# masked dense model computes.

# %%
tiny = GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=4, n_embd=16)
masked = GPT(tiny, seed=1, dtype=np.float64)
sliced = GPT(tiny, seed=1, dtype=np.float64)
tokens = np.random.default_rng(0).integers(0, 20, (3, 8))
structured.prune(structured.gpt_units(masked), 0.5, masks_only=True)  # heads zeroed in place
prune_structured(sliced, 0.5, group)  # the same heads gone, the weights sliced
gap = np.abs(sliced(tokens).data - masked(tokens).data).max()
print0(f"heads per block {sliced.config.heads}, MLP channels {sliced.config.mlp_channels}")
print0(f"parameters {masked.num_parameters():,} -> {sliced.num_parameters():,}, max gap {gap}")
assert gap <= 1e-12 and sliced.config.heads == (2, 2) and sliced.config.mlp_channels == (32, 32)
assert sliced.num_parameters() == 4_176 and masked.num_parameters() == 7_360
# `--prune-structured 0.5` does this at step steps/3 of a DP run, then fine-tunes;
# `python -m minidp bench prune --structured` measures what it buys (docs/pruning.md)
