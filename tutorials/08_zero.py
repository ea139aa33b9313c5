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
# On a model of our own, we count plain DP's bytes, then shard one thing at a time by hand,
# check each stage's step against DP's, its bytes against the paper's formula, and then the
# library's piece against our by-hand version, bit for bit. (float64 here, so every byte
# count is twice the fp32 one: b = 8 bytes a number, K = 2b for the two moments.)

# %%
import os
import tempfile

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, no_grad, optim
from minidp.parallel import (
    DistributedDataParallel,
    FullyShardedDataParallel,
    SimpleZeRO3,
    ZeroRedundancyOptimizer,
)
from minidp.parallel.zero.stages import model_state_bytes
from minidp.tools.chunks import chunk_range
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0
from minidp.tools.plots import pyplot, save

one_blas_thread()  # 4 ranks on a few cores: one BLAS thread each, or they fight
group = comm.world()
rank, N = group.rank, group.size
b = 8  # bytes per float64

x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
sampler = data.DistributedSampler(len(x_all), 64, rank, N, seed=0)
x, y = Tensor(x_all[sampler.local_indices(0)]), y_all[sampler.local_indices(0)]
SIZES = [32, 128, 128, 128, 128, 10]


class Net(nn.Module):
    """Our model: five Linears with ReLUs between them, each layer a direct child."""

    def __init__(self):
        rng = np.random.default_rng(0)  # the same weights on every rank
        self.layers = [nn.Linear(i, o, rng=rng, dtype=np.float64) for i, o in zip(SIZES, SIZES[1:])]

    def forward(self, x) -> Tensor:
        for layer in self.layers[:-1]:
            x = layer(x).relu()
        return self.layers[-1](x)


def flat_of(params) -> np.ndarray:
    """The parameters end to end, as one vector (a copy)."""
    return np.concatenate([p.data.ravel() for p in params])


def unflatten(vector: np.ndarray, params) -> None:
    """Point each parameter at its piece of `vector` (the parameters end to end)."""
    offset = 0
    for p in params:
        p.data = vector[offset : offset + p.size].reshape(p.shape)
        offset += p.size


def local_gradient(model) -> np.ndarray:
    """This rank's gradient as one flat vector, weighted 1/N: the N of them sum to the mean."""
    cross_entropy(model(x), y).backward()
    g = np.concatenate([p.grad.ravel() for p in model.parameters()]) * (1 / N)
    model.zero_grad()
    return g


def adamw(params):
    return optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def moments(opt) -> int:
    """The bytes of AdamW's m and v: the optimizer state."""
    return sum(v.nbytes for state in opt.state for k, v in state.items() if k in ("m", "v"))


def sent(collective: str, on=group) -> int:
    """Bytes all ranks sent in `collective` since the counters were reset (collective)."""
    mine = on.counters.get(collective, {}).get("bytes_sent", 0)
    return int(comm.allreduce(np.array([mine]), group=group)[0])


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
# Allreduce the gradient, and every rank takes the same AdamW step on all Ψ parameters. A
# ring allreduce sends 2(N−1)/N·Ψ·b bytes from each rank.

# %%
model = Net()
flat = flat_of(model.parameters())
psi = flat.size
group.reset_counters()
g = comm.allreduce(local_gradient(model), algo="ring", group=group)
dp_bytes = sent("allreduce")
assert dp_bytes == 2 * (N - 1) * psi * b  # the N ranks together
whole = Tensor(flat)
whole.grad = g
opt = adamw([whole])
opt.step()
want = flat.copy()  # what every stage below must reproduce
print0(f"Ψ = {psi:,} parameters over N = {N} ranks (Ψ % N = {psi % N}: uneven chunks)")
check(0, {"parameters": flat.nbytes, "gradients": g.nbytes, "optimizer": moments(opt)}, psi, psi)

# %% [markdown]
# ## 2. Stage 1: shard the optimizer state
# An allreduce is a reduce-scatter and an allgather (the ring does exactly that). Stop in the
# middle: rank r keeps only chunk r of the summed gradient, updates only chunk r of the
# parameters (so it needs AdamW's m and v for that chunk only), then allgathers the updated
# parameters. Same bytes on the wire as DP's allreduce, and, with the ring, the same bits.
# What stage 1 saves is the optimizer state, K·Ψ·(N−1)/N: the whole gradient is still
# computed and held (b·Ψ), as in DP.

# %%
model = Net()
flat = flat_of(model.parameters())
group.reset_counters()
g = local_gradient(model)  # the whole gradient: held as in DP
lo, hi = chunk_range(psi, N, rank)
chunk = Tensor(flat[lo:hi])  # a view: the update lands in flat
chunk.grad = comm.reduce_scatter(g, algo="ring", group=group)
opt = adamw([chunk])
opt.step()
comm.allgather(flat[lo:hi], algo="ring", group=group, out=flat)
assert np.array_equal(flat, want), "stage 1 differs from DP"
rs_bytes, ag_bytes = sent("reduce_scatter"), sent("allgather")
assert rs_bytes == ag_bytes == (N - 1) * psi * b and rs_bytes + ag_bytes == dp_bytes
held = {"parameters": flat.nbytes, "gradients": g.nbytes, "optimizer": moments(opt)}
check(1, held, hi - lo, psi)
dp, one = held_by_stage[0], held_by_stage[1]
assert one["gradients"] == dp["gradients"] and one["optimizer"] == 2 * b * (hi - lo)
print0(f"stage 1 saves the optimizer state ({dp['optimizer']:,} -> {one['optimizer']:,} B); "
       f"gradients stay {one['gradients']:,} B")  # fmt: skip

# %% [markdown]
# The same stage 1 as a piece around your own model and optimizer class, as PyTorch's
# `ZeroRedundancyOptimizer`: DDP averages the whole gradient, the piece steps this rank's
# chunk of the parameters with AdamW and allgathers them. DDP allreduces: twice the bytes
# of the reduce-scatter above, so the whole step sends 1.5x what our stage 1 did (the
# library's strategy, at the end, reduce-scatters).

# %%
model = Net()
ddp = DistributedDataParallel(model, group, algo="ring")
zero_opt = ZeroRedundancyOptimizer(model.parameters(), optim.AdamW, lr=1e-3, weight_decay=0.1)
group.reset_counters()
ddp.comm_group.reset_counters()
cross_entropy(ddp(x), y).backward()
ddp.finish_gradient_sync()
zero_opt.step()
allreduce_bytes, gather_bytes = sent("allreduce", on=ddp.comm_group), sent("allgather")
ddp.close()
got = flat_of(model.parameters())
np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)  # DDP's buckets: other sums
assert allreduce_bytes == 2 * rs_bytes and gather_bytes == ag_bytes
assert 2 * (allreduce_bytes + gather_bytes) == 3 * (rs_bytes + ag_bytes)  # 1.5x
m_and_v = sum(s[k].nbytes for s in zero_opt.optimizer.state for k in ("m", "v"))
assert m_and_v == 2 * b * zero_opt.shard_numel  # K·Ψ/N on this rank
print0(f"ZeroRedundancyOptimizer: {zero_opt.shard_numel:,} of {psi:,} parameters stepped here; "
       f"DDP's allreduce {allreduce_bytes / N:,.0f} B a rank = 2x the reduce-scatter's "
       f"{rs_bytes / N:,.0f}")  # fmt: skip

# %% [markdown]
# ## 3. Stage 2: shard the gradients too
# Nobody needs the whole gradient after its reduce-scatter. A layer is what one
# reduce-scatter moves: its parameters end to end, cut into N chunks (chunk_range), rank r
# keeping chunk r of every layer's gradient and stepping chunk r of its parameters, then
# allgathering each layer's updated chunks. By hand, below, after backward; the library
# does each layer from a grad-ready hook as soon as backward has finished it, so only one
# layer's whole gradient exists at a time.

# %%
model = Net()
cross_entropy(model(x), y).backward()  # every layer's whole gradient, for now
mine = []  # per layer: my chunk of its parameters, to step, its gradient in .grad
for layer in model.layers:
    params = layer.parameters()
    g = np.concatenate([p.grad.ravel() for p in params]) * (1 / N)  # this rank's share
    lo, hi = chunk_range(g.size, N, rank)
    mine.append(Tensor(flat_of(params)[lo:hi].copy()))
    mine[-1].grad = comm.reduce_scatter(g, algo="ring", group=group)  # the sum's chunk r
    for p in params:
        p.grad = None  # the whole gradient is dropped
opt = adamw(mine)
opt.step()
for layer, chunk in zip(model.layers, mine):  # every layer's updated chunks, to everyone
    params = layer.parameters()
    whole = np.empty(sum(p.size for p in params))
    comm.allgather(chunk.data, algo="ring", group=group, out=whole)
    unflatten(whole, params)
by_hand = flat_of(model.parameters())
np.testing.assert_allclose(by_hand, want, rtol=1e-12, atol=1e-15)  # other chunks: other sums
mine_numel = sum(c.size for c in mine)
held = {"parameters": by_hand.nbytes, "gradients": b * mine_numel, "optimizer": moments(opt)}
check(2, held, mine_numel, psi)

# %% [markdown]
# The library's stage 2 is `FullyShardedDataParallel(..., sharding="grad_op")` (PyTorch's
# SHARD_GRAD_OP): each layer's gradients reduce-scattered when ready, the updated chunks
# allgathered in the next forward; its `parameters()` are this rank's chunks, for any
# optimizer, and `full_state_dict()` gathers the whole model by name. The same chunks and
# the same sums: our stage 2's bits.

# %%
model = Net()
with FullyShardedDataParallel(model, group, "grad_op", algo="ring") as fsdp:
    opt = adamw(fsdp.parameters())
    cross_entropy(fsdp(x), y).backward()
    fsdp.finish_gradient_sync()  # each shard's .grad: the global batch's mean
    opt.step()
    state = fsdp.full_state_dict()
    assert fsdp.shard_numel == mine_numel
got = np.concatenate([state[name].ravel() for name, _ in model.named_parameters()])
assert np.array_equal(got, by_hand), "FSDP grad_op differs from stage 2 by hand"
print0(f"FSDP grad_op == stage 2 by hand, bit for bit; {mine_numel:,} of {psi:,} stepped here")

# %% [markdown]
# ## 4. Stage 3: shard the parameters too
# Now rank r keeps only chunk r of every layer's parameters. A layer is gathered
# (allgather) just before its forward and released after; gathered again for its backward.
# Forward runs without recording a graph: the graph's ops keep the arrays they read, so it
# would keep every layer's whole weights alive until backward. Backward runs each layer
# again, recording, from its kept input, and backpropagates through it (that second forward
# is the plain way to free a layer in between), then reduce-scatters its gradient into
# chunk r. One layer is whole at a time: `whole_now` holds it, and we measure its peak.

# %%
model = Net()
layers, n = model.layers, len(model.layers)
mine = []  # my chunk of each layer: all this rank keeps of the model
for layer in layers:
    v = flat_of(layer.parameters())
    lo, hi = chunk_range(v.size, N, rank)
    mine.append(Tensor(v[lo:hi].copy()))  # a copy: the whole layer goes
whole_now, peak = {}, 0  # layer -> its whole parameters, while gathered


def gather(u: int) -> None:
    global peak
    params = layers[u].parameters()
    whole_now[u] = np.empty(sum(p.size for p in params))
    comm.allgather(mine[u].data, group=group, out=whole_now[u])  # every rank's chunk
    unflatten(whole_now[u], params)
    peak = max(peak, sum(v.nbytes for v in whole_now.values()))


def release(u: int) -> None:
    whole_now.pop(u, None)
    for p in layers[u].parameters():  # its shape, no memory: NaN if read by mistake
        p.data = np.broadcast_to(np.nan, p.shape)


for u in range(n):
    release(u)  # from here on, this rank keeps only its chunks


def relu_but_last(u: int, h: Tensor) -> Tensor:
    return h.relu() if u < n - 1 else h  # as Net.forward: no ReLU after the last layer


group.reset_counters()
inputs = [x]  # each layer's input: what backward reruns it from
with no_grad():
    for u in range(n):
        gather(u)
        inputs.append(relu_but_last(u, layers[u](inputs[u])))
        release(u)
logits = Tensor(inputs[-1].data, requires_grad=True)
cross_entropy(logits, y).backward()
dy = logits.grad
for u in reversed(range(n)):
    gather(u)
    leaf = Tensor(inputs[u].data, requires_grad=u > 0)
    relu_but_last(u, layers[u](leaf)).backward(dy)  # the layer again, recorded; dL/dW, dL/dx
    dy = leaf.grad
    g = np.concatenate([p.grad.ravel() for p in layers[u].parameters()])
    mine[u].grad = comm.reduce_scatter(g, op="avg", group=group)  # my chunk of the mean
    for p in layers[u].parameters():
        p.grad = None
    release(u)
opt = adamw(mine)
opt.step()
calls = {c: group.counters[c]["calls"] for c in ("allgather", "reduce_scatter")}
assert calls == {"allgather": 2 * n, "reduce_scatter": n}  # each layer: 2 gathers, 1 sum
largest = b * max(sum(p.size for p in layer.parameters()) for layer in layers)
assert peak == largest < b * psi  # one layer whole at a time
mine_numel = sum(c.size for c in mine)
held = {"parameters": b * mine_numel, "gradients": b * mine_numel, "optimizer": moments(opt)}
check(3, held, mine_numel, psi)
print0(f"stage 3 held at most {peak:,} gathered bytes (the largest layer) of the {b * psi:,} "
       f"the whole model takes; {calls['allgather']} allgathers a step")  # fmt: skip

# %% [markdown]
# The library's plain stage 3, `SimpleZeRO3` (parallel/zero/plain.py), is this loop as a
# piece around your model: each layer's forward wrapped as one op that gathers, runs and
# releases, and in backward does what our second loop did. Our bits. Then FSDP with
# `sharding="full"` (PyTorch's FULL_SHARD): the same sharding without the second forward,
# its gathers written into two slots reused in turn (stage3.py explains why that is safe,
# and measures what they hold); DP's step, to rounding.

# %%
model = Net()
zero3 = SimpleZeRO3(model, group)
opt = adamw(zero3.parameters())
cross_entropy(zero3(x), y).backward()
opt.step()
assert all(np.array_equal(p.data, q.data) for p, q in zip(zero3.parameters(), mine))
print0("SimpleZeRO3 == stage 3 by hand, bit for bit")
model = Net()
with FullyShardedDataParallel(model, group, "full", algo="ring") as fsdp:
    opt = adamw(fsdp.parameters())
    cross_entropy(fsdp(x), y).backward()
    fsdp.finish_gradient_sync()
    opt.step()
    state = fsdp.full_state_dict()
got = np.concatenate([state[name].ravel() for name, _ in model.named_parameters()])
np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)  # DP's step, to rounding
print0("FSDP full: DP's step, to rounding")

# %% [markdown]
# ## 5. Mixed precision: the paper's 16Ψ, and 2Ψ + 2Ψ + 12Ψ
# The paper counts mixed-precision training: weights and gradients in 16 bits (2Ψ each),
# and the optimizer's state in fp32: a master copy of the weights and Adam's two moments,
# K = 12 bytes a parameter. That is why ZeRO matters: the optimizer's 12Ψ is three quarters
# of the 16Ψ, and stage 1 alone shards it. `amp.to_half` puts the weights in bfloat16 (the
# arithmetic stays float32: NumPy promotes a 16-bit weight read with float32 activations);
# the optimizer keeps a float32 master of each 16-bit weight in its state, and FSDP's
# buffers and gradients take the weights' dtype. Counted from the arrays, stage 3:

# %%
from minidp.parallel import amp  # noqa: E402  (the section's own import)

model = Net()
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
assert abs(sum(held.values()) - paper) <= 16  # Ψ/N rounded: one parameter (16 B) off
print0(f"bf16, stage 3: {held}, {sum(held.values()) / mine:.0f} bytes a parameter of the "
       f"shard; the paper's 16Ψ/N = {paper:,.0f} B")  # fmt: skip
# %% [markdown]
# float16 needs a loss scaler as well (amp.GradScaler: its 5 exponent bits underflow small
# gradients), bfloat16 does not. On the command line: `--precision bf16` or `fp16`, with any
# stepped strategy, and `--recompute` to keep only each GPT block's input for backward;
# docs/memory.md measures both, and the peak memory the OS sees.

# %% [markdown]
# ## 6. The picture: what one rank holds at each stage
# Stacked bars, one per stage, of the bytes counted above (rank 0's; the others differ by
# at most one element per chunk), and for stage 3 the layer it gathers as it runs (at its
# peak): that buffer is why stage 3 holds more than 1/N of DP's model states.

# %%
held_by_stage[3] = {**held_by_stage[3], "gathered (peak)": peak}
CATEGORIES = ("parameters", "gradients", "optimizer", "gathered (peak)")
NAMES = ("DP", "stage 1", "stage 2", "stage 3")
plt = pyplot() if rank == 0 else None
if plt is not None:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    stages = sorted(held_by_stage)
    bottom = np.zeros(len(stages))
    for category in CATEGORIES:
        heights = np.array([held_by_stage[s].get(category, 0) / 1e3 for s in stages])
        ax.bar([NAMES[s] for s in stages], heights, bottom=bottom, label=category)
        bottom += heights
    ax.set_ylabel("KB on this rank")
    ax.set_title(f"model states on rank 0: float64 (b = 8), AdamW (K = 2b), Ψ = {psi:,}, N = {N}"
                 "\nbetween steps, plus stage 3's gather buffer; activations not counted",
                 fontsize=9)  # fmt: skip
    ax.legend()
    save(fig, os.path.join(tempfile.gettempdir(), "minidp_08_zero.png"))
kb = {s: sum(h.values()) / 1e3 for s, h in held_by_stage.items()}
print0("KB on this rank: " + ", ".join(f"{NAMES[s]} {kb[s]:.1f}" for s in sorted(kb)))
states = kb[3] - peak / 1e3  # stage 3's model states alone: 1/N of DP's
assert round(states / kb[0], 2) == round(1 / N, 2) < round(kb[3] / kb[0], 2)
print0(f"stage 3: {states / kb[0]:.2f} of DP's model states (1/N), {kb[3] / kb[0]:.2f} with "
       "its gather buffer")  # fmt: skip

# %% [markdown]
# The same, as a strategy of the training loop, with buckets, overlap and clipping:
#
#     mpiexec -n 4 python -m minidp --strategy zero --zero-stage 3
#
# and the measured table against the formulas: `mpiexec -n 4 python -m minidp bench memory`.
