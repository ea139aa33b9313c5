# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 08 · ZeRO: shard the optimizer state, then the gradients, then the parameters
#
# Launch line:
#
# mpiexec -n 4 python tutorials/08_zero.py
#
# Data parallelism keeps a whole copy of every model state on every rank: Ψ parameters,
# Ψ gradients and AdamW's two moments, 16Ψ bytes in fp32. ZeRO (Rajbhandari et al., SC 2020)
# notices that each rank only *needs* all of it for a moment, and shards it over the N ranks.
# We count plain DP's bytes, then shard one thing at a time by hand, and check each stage's
# step against DP's and its bytes against the paper's formula. (float64 here, so every byte
# count is twice the fp32 one: b = 8 bytes a number, K = 2b for the two moments.)

# %%
import os
import tempfile

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.comm.trace import Timeline
from minidp.parallel import (
    DistributedDataParallel,
    FullyShardedDataParallel,
    ZeroRedundancyOptimizer,
)
from minidp.parallel.zero.flat import ShardLayout, pieces
from minidp.parallel.zero.grads import ShardedGradients
from minidp.parallel.zero.stage3 import GatheredUnits
from minidp.parallel.zero.stages import model_state_bytes
from minidp.tools.chunks import chunk_range
from minidp.tools.log import print0
from minidp.tools.plots import pyplot, save

group = comm.world()
rank, N = group.rank, group.size
b = 8  # bytes per float64

x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
sampler = data.DistributedSampler(len(x_all), 64, rank, N, seed=0)
x, y = Tensor(x_all[sampler.local_indices(0)]), y_all[sampler.local_indices(0)]


def new_model():
    """The MLP, its parameters made views of one flat vector (the order of parameters())."""
    model = nn.MLP([32, 128, 128, 128, 128, 10], rng=np.random.default_rng(0), dtype=np.float64)
    flat = np.concatenate([p.data.ravel() for p in model.parameters()])
    offset = 0
    for p in model.parameters():
        p.data = flat[offset : offset + p.size].reshape(p.shape)
        offset += p.size
    return model, flat


def local_gradient(model):
    """This rank's gradient as one flat vector, weighted 1/N: the N of them sum to the mean."""
    cross_entropy(model(x), y).backward()
    g = np.concatenate([p.grad.ravel() for p in model.parameters()]) / N
    model.zero_grad()
    return g


def adamw(params):
    return optim.AdamW(params, lr=1e-3, weight_decay=0.1)


held_by_stage = {}  # stage -> this rank's bytes by category, for the picture at the end


def check(stage: int, held: dict, mine: int, psi: int):
    """held: this rank's bytes by category; mine: its share of the Ψ elements."""
    held_by_stage[stage] = held
    want = {
        "parameters": b * (mine if stage == 3 else psi),
        "gradients": b * (mine if stage >= 2 else psi),
        "optimizer": 2 * b * (mine if stage >= 1 else psi),
    }
    assert held == want, (held, want)
    total = comm.allreduce(np.array([sum(held.values())]), group=group)[0]
    formula = sum(model_state_bytes(stage, psi, N, itemsize=b, k=2 * b).values())
    assert total == round(N * formula)  # the ranks together: exactly N times the formula
    print0(f"stage {stage}: {held} = {sum(held.values()) / (b * psi):.3f} b·Ψ per rank")


# %% [markdown]
# ## 1. Plain data parallelism: everything, everywhere
# Allreduce the gradient, and every rank takes the same AdamW step on all Ψ parameters.

# %%
model, flat = new_model()
psi = flat.size
g = comm.allreduce(local_gradient(model), algo="ring", group=group)
whole = Tensor(flat)
whole.grad = g
opt = adamw([whole])
opt.step()
want = flat.copy()  # what every stage below must reproduce
print0(f"Ψ = {psi:,} parameters over N = {N} ranks (Ψ % N = {psi % N}: uneven chunks)")
check(0, {"parameters": flat.nbytes, "gradients": g.nbytes, "optimizer": b * 2 * psi}, psi, psi)

# %% [markdown]
# ## 2. Stage 1: shard the optimizer state
# An allreduce is a reduce-scatter and an allgather (the ring does exactly that). Stop in the
# middle: rank r keeps only chunk r of the summed gradient, updates only chunk r of the
# parameters (so it needs AdamW's m and v for that chunk only), then allgathers the updated
# parameters. Same bytes on the wire as DP's allreduce, and, with the ring, the same bits.

# %%
model, flat = new_model()
g = local_gradient(model)  # the whole gradient is still held: 8·Ψ/N is all we save
lo, hi = chunk_range(psi, N, rank)
chunk = Tensor(flat[lo:hi])  # a view: the update lands in the model
chunk.grad = comm.reduce_scatter(g, algo="ring", group=group)
opt = adamw([chunk])
opt.step()
comm.allgather(flat[lo:hi], algo="ring", group=group, out=flat)
assert np.array_equal(flat, want), "stage 1 differs from DP"
m_and_v = sum(v.nbytes for k, v in opt.state[0].items() if k in ("m", "v"))
check(1, {"parameters": flat.nbytes, "gradients": g.nbytes, "optimizer": m_and_v}, hi - lo, psi)

# %% [markdown]
# The same stage 1 as a piece around your own model and optimizer class, as PyTorch's
# `ZeroRedundancyOptimizer`: DDP averages the whole gradient, the piece steps this rank's
# chunk of the parameters with AdamW and allgathers them. (DDP allreduces, so 1.5x the bytes
# of the reduce-scatter above; the library's strategy, at the end, reduce-scatters.)

# %%
model, _ = new_model()
ddp = DistributedDataParallel(model, group, algo="ring")
zero_opt = ZeroRedundancyOptimizer(model.parameters(), optim.AdamW, lr=1e-3, weight_decay=0.1)
cross_entropy(ddp(x), y).backward()
ddp.finish_gradient_sync()
zero_opt.step()
ddp.close()
got = np.concatenate([p.data.ravel() for p in model.parameters()])
np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)  # DDP's buckets: other sums
m_and_v = sum(s[k].nbytes for s in zero_opt.optimizer.state for k in ("m", "v"))
assert m_and_v == 2 * b * zero_opt.shard_numel  # K·Ψ/N on this rank
print0(f"ZeroRedundancyOptimizer: {zero_opt.shard_numel:,} of {psi:,} parameters stepped here")

# %% [markdown]
# ## 3. Stage 2: shard the gradients too
# Nobody needs the whole gradient after its reduce-scatter, so reduce-scatter each layer as
# soon as backward has finished it, and drop the rest: a grad-ready hook does it (DDP's
# buckets work the same way). `ShardedGradients` is that hook. Each layer is now a segment
# of the flat vector with its own chunks (`ShardLayout`: rank r owns chunk r of every
# layer, chunk_bounds cuts them), since a layer is what one reduce-scatter moves.

# %%
model, flat = new_model()
names = {id(p): name for name, p in model.named_parameters()}
layout = ShardLayout([layer.parameters() for layer in model.layers], names, N, rank)
last_first = list(range(len(model.layers)))[::-1]  # the order backward finishes them
grad_shard = np.zeros(layout.shard_numel)
hooks = ShardedGradients(
    layout, last_first, grad_shard, group, "ring", overlap=False, timeline=Timeline(False)
)
cross_entropy(model(x), y).backward()  # each layer reduce-scattered as it completes
hooks.finish()
hooks.close()
assert all(p.grad is None for p in model.parameters()), "no whole gradient is left"
chunks = pieces(
    [flat[lo:hi] for lo, hi in layout.ranges()],  # views: the update lands in the model
    [layout.my_chunk(grad_shard, s) for s in range(len(model.layers))],
)
opt = adamw(chunks)
opt.step()
for s, (lo, hi) in enumerate(layout.chunks):  # every layer's updated chunks, to everyone
    segment = flat[layout.offsets[s] : layout.offsets[s + 1]]
    comm.allgather(segment[lo:hi], algo="ring", group=group, out=segment)
# other chunk edges, so other sums' order: equal to rounding, not bit for bit
np.testing.assert_allclose(flat, want, rtol=1e-12, atol=1e-15)
m_and_v = sum(v.nbytes for state in opt.state for k, v in state.items() if k in ("m", "v"))
held = {"parameters": flat.nbytes, "gradients": grad_shard.nbytes, "optimizer": m_and_v}
check(2, held, layout.shard_numel, psi)

# %% [markdown]
# ## 4. Stage 3: shard the parameters too
# Now rank r keeps only chunk r of every layer's weights as well. `GatheredUnits` wraps each
# layer's forward: allgather the layer just before it, release it after; and again just
# before its backward. The backward closures keep references to the arrays the forward
# read (`linear` keeps W), so a fresh array per gather would stay alive until backward and
# the rank would hold all Ψ again; instead every gather writes into one of two reused slots
# (parallel/zero/stage3.py explains why that is safe). `gathered_peak` measures the bytes held at
# once.

# %%
model, flat = new_model()
names = {id(p): name for name, p in model.named_parameters()}
layout = ShardLayout([layer.parameters() for layer in model.layers], names, N, rank)
shard = layout.shard_of(flat)  # forward order: the layout's order; then drop the rest
del flat
gathered = GatheredUnits(model.layers, layout, shard, group, "ring")
grad_shard = np.zeros(layout.shard_numel)
hooks = ShardedGradients(
    layout, last_first, grad_shard, group, "ring", overlap=False, timeline=Timeline(False),
    launched=gathered.release,
)  # fmt: skip
cross_entropy(model(x), y).backward()
hooks.finish()
hooks.close()
n = len(model.layers)
opt = adamw(pieces([layout.my_chunk(shard, s) for s in range(n)],
                   [layout.my_chunk(grad_shard, s) for s in range(n)]))  # fmt: skip
opt.step()
np.testing.assert_allclose(shard, layout.shard_of(want), rtol=1e-12, atol=1e-15)
m_and_v = sum(v.nbytes for state in opt.state for k, v in state.items() if k in ("m", "v"))
check(3, {"parameters": shard.nbytes, "gradients": grad_shard.nbytes, "optimizer": m_and_v},
      layout.shard_numel, psi)  # fmt: skip
largest = b * max(layout.lengths)
assert gathered.gathered_peak <= 2 * largest < b * psi
assert gathered.gathers == 2 * n  # each layer: once for forward, once for backward
print0(
    f"stage 3 held at most {gathered.gathered_peak:,} gathered bytes (two slots of the largest"
    f" layer) of the {b * psi:,} the whole model takes; {gathered.gathers} allgathers a step"
)
gathered.unwrap()

# %% [markdown]
# Stages 3 and 2 as one piece around your own model, as PyTorch's FSDP. With
# `sharding="full"` (FULL_SHARD: stage 3) it does what we just did by hand: each layer
# gathered around its forward and its backward, its gradients reduce-scattered when ready;
# `sharding="grad_op"` (SHARD_GRAD_OP: stage 2) keeps the parameters whole and allgathers
# the updated chunks in the next forward. Its `parameters()` are this rank's shards, for any
# optimizer; `full_state_dict()` gathers the whole model by name.

# %%
for sharding in ("full", "grad_op"):
    model, _ = new_model()
    with FullyShardedDataParallel(model, group, sharding, algo="ring") as fsdp:
        opt = adamw(fsdp.parameters())
        cross_entropy(fsdp(x), y).backward()
        fsdp.finish_gradient_sync()  # each shard's .grad: the global batch's mean
        opt.step()
        state = fsdp.full_state_dict()
    got = np.concatenate([state[name].ravel() for name, _ in model.named_parameters()])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)  # DP's step, to rounding
    print0(f"FSDP {sharding}: this rank steps {fsdp.shard_numel:,} of the {psi:,} parameters")

# %% [markdown]
# ## 5. The picture: what one rank holds at each stage
# Stacked bars, one per stage, of the bytes counted above (rank 0's; the others differ by
# at most one element per chunk).

# %%
plt = pyplot() if rank == 0 else None
if plt is not None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    stages = sorted(held_by_stage)
    bottom = np.zeros(len(stages))
    for category in ("parameters", "gradients", "optimizer"):
        heights = np.array([held_by_stage[s][category] / 1e3 for s in stages])
        ax.bar([("DP", "stage 1", "stage 2", "stage 3")[s] for s in stages], heights,
               bottom=bottom, label=category)  # fmt: skip
        bottom += heights
    ax.set_ylabel("KB on this rank")
    ax.set_title(f"model states per rank, Ψ = {psi:,}, N = {N}")
    ax.legend()
    save(fig, os.path.join(tempfile.gettempdir(), "minidp_08_zero.png"))
print0("KB on this rank: " + ", ".join(
    f"{('DP', 'stage 1', 'stage 2', 'stage 3')[s]} {sum(h.values()) / 1e3:.1f}"
    for s, h in sorted(held_by_stage.items())))  # fmt: skip

# %% [markdown]
# ## 6. Mixed precision: the paper's 16Ψ, and 2Ψ + 2Ψ + 12Ψ
# The paper counts mixed-precision training: weights and gradients in 16 bits (2Ψ each),
# and the optimizer's state in fp32: a master copy of the weights and Adam's two moments,
# K = 12 bytes a parameter. That is why ZeRO matters: the optimizer's 12Ψ is three quarters
# of the 16Ψ, and stage 1 alone shards it. `amp.to_half` puts the weights in bfloat16 (the
# arithmetic stays float32: NumPy promotes a 16-bit weight read with float32 activations);
# the optimizer keeps a float32 master of each 16-bit weight in its state, and FSDP's
# buffers and gradients take the weights' dtype. Counted from the arrays, stage 3:

# %%
from minidp.parallel import amp  # noqa: E402  (the section's own import)

model, _ = new_model()
amp.to_half(model, "bf16")
with FullyShardedDataParallel(model, group, "full", algo="ring") as fsdp:
    opt = adamw(fsdp.parameters())
    cross_entropy(fsdp(Tensor(x.data.astype(np.float32))), y).backward()
    fsdp.finish_gradient_sync()
    opt.step()
    held = {
        "parameters": sum(p.data.nbytes for p in fsdp.parameters()),
        "gradients": sum(p.grad.nbytes for p in fsdp.parameters()),
        "optimizer": sum(s[k].nbytes for s in opt.state for k in ("master", "m", "v")),
    }
mine = sum(p.size for p in fsdp.parameters())
assert held == {"parameters": 2 * mine, "gradients": 2 * mine, "optimizer": 12 * mine}, held
paper = sum(model_state_bytes(3, psi, N, itemsize=2, k=12).values())
print0(f"bf16, stage 3: {held}, {sum(held.values()) / mine:.0f} bytes a parameter of the "
       f"shard; the paper's 16Ψ/N = {paper:,.0f} B")  # fmt: skip
# %% [markdown]
# float16 needs a loss scaler as well (amp.GradScaler: its 5 exponent bits underflow small
# gradients), bfloat16 does not. On the command line: `--precision bf16` or `fp16`, with any
# stepped strategy, and `--recompute` to keep only each GPT block's input for backward;
# docs/memory.md measures both, and the peak memory the OS sees.

# %% [markdown]
# The same, as a strategy of the training loop, with buckets, overlap and clipping:
#
#     mpiexec -n 4 python -m minidp --strategy zero --zero-stage 3
#
# and the measured table against the formulas: `mpiexec -n 4 python -m minidp bench memory`.
