# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 07 · Tensor parallelism: split the layer, not the batch
#
# Launch line:
#
# mpiexec -n 2 python tutorials/07_tensor_parallel.py
#
# Data parallelism copies the whole model onto every rank. Megatron-LM (Shoeybi et al.
# 2019) instead splits each layer's weight matrix across the ranks of a tensor-parallel
# group, so each rank stores and multiplies 1/p of it. This tutorial builds the pieces by
# hand, then with minidp.parallel's layers, each checked against the unsplit layer:
# column- and row-parallel linears, Megatron's f and g, the parallel MLP, attention split by
# heads, the vocabulary, sequence parallelism, then `TensorParallelGPT` around a GPT you
# build (its head tied to its embedding), and finally `--strategy tp` training like one
# process.

# %%
import os
import tempfile

import numpy as np

from minidp import Tensor, comm, nn
from minidp import functional as F
from minidp.cli.strategies import DataParallel, TensorParallel
from minidp.cli.training.config import TrainConfig
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.optim import AdamW
from minidp.parallel import (
    ColumnParallelLinear,
    Mesh,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    TensorParallelGPT,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from minidp.parallel.tensor_parallel.communications import copy_to_tensor_parallel, sequence_range
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0
from minidp.tools.plots import pyplot, save

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores

mesh = Mesh(tp=comm.world().size)  # dp 1 x tp p: every rank in one TP group
group = mesh.tp_group
p, r = group.size, group.rank
print0(mesh.describe())
rng = np.random.default_rng(0)  # the same stream on every rank: the same "whole" weights
B, T, C = 2, 8, 16
X = rng.standard_normal((B * T, C))
A = rng.standard_normal((C, 4 * C))  # Y = X A, minidp's orientation (in, out)

# %% [markdown]
# ## 1. Column-parallel by hand: split A's output features
# A = [A_1 | A_2 | ... | A_p]; rank i computes Y_i = X A_i, a block of Y's columns. Putting
# the blocks side by side (an allgather along the last axis) gives Y.

# %%
cols = np.array_split(np.arange(4 * C), p)[r]
Y_i = X @ A[:, cols]
Y = np.concatenate(list(comm.allgather(Y_i, group=group)), axis=-1)
assert np.allclose(Y, X @ A)
print0(f"column-parallel: each rank holds {A[:, cols].size} of A's {A.size} numbers")
assert A[:, cols].size == A.size // p  # 1/p of the weight (4C columns divide by p here)

# %% [markdown]
# ## 2. Row-parallel by hand: split A's input features
# B = [B_1 ; ... ; B_p] by rows and Y's columns likewise: Z = Y B = sum_i Y_i B_i. Each
# rank's product is a partial sum; an allreduce adds them. Column then row needs nothing
# between them: the Y_i a column-parallel layer leaves are just what a row-parallel one needs.

# %%
Bw = rng.standard_normal((4 * C, C))
Z = comm.allreduce(np.ascontiguousarray(Y_i @ Bw[cols]), group=group)
assert np.allclose(Z, X @ A @ Bw)
whole_row = nn.Linear(4 * C, C, rng=np.random.default_rng(4), dtype=np.float64)
row = RowParallelLinear(whole_row, group)  # the library's: my rows of the same whole layer
assert np.allclose(row(Tensor(Y[:, cols])).data, whole_row(Tensor(Y)).data)

# %% [markdown]
# ## 3. f and g: the operators that make backward right
# Forward, every rank reads all of X. Backward, each rank's dL/dX = dL/dY_i A_i^T covers
# only its own columns' share: the whole dL/dX is the sum over ranks. Megatron's **f** is
# identity forward and allreduce backward; its conjugate **g** (after the row-parallel
# layer) is allreduce forward and identity backward. Without f, the input gradient is a
# partial sum:

# %%
full = nn.Linear(C, 4 * C, rng=np.random.default_rng(1), dtype=np.float64)
x = Tensor(X, requires_grad=True)
(full(x) ** 2).sum().backward()
want = x.grad.copy()
layer = ColumnParallelLinear(full, group)  # this rank's slice of the same whole layer
for use_f in (False, True):
    xi = Tensor(X, requires_grad=True)
    inp = copy_to_tensor_parallel(xi, group) if use_f else xi
    (nn.linear(inp, layer.weight, layer.bias) ** 2).sum().backward()
    ok = np.allclose(xi.grad, want)
    print0(f"input gradient {'with' if use_f else 'without'} f equals one process: {ok}")
    assert ok == use_f

# %% [markdown]
# ## 4. The parallel MLP: one allreduce forward, one backward
# ParallelMLP is f -> column-parallel -> GeLU -> row-parallel -> g. The group's counters
# show the two allreduces (plus none in between).

# %%
cfg = nn.GPTConfig(vocab_size=11, block_size=T, n_layer=1, n_head=4, n_embd=C)
block = nn.Block(cfg, rng=np.random.default_rng(2), dtype=np.float64)
x3 = rng.standard_normal((B, T, C))
xw = Tensor(x3, requires_grad=True)
(block.fc_proj(F.gelu(block.fc(xw))) ** 2).sum().backward()
mlp = ParallelMLP(block.fc, block.fc_proj, group)
group.reset_counters()
xp = Tensor(x3, requires_grad=True)
out = mlp(xp)
(out**2).sum().backward()
assert np.allclose(out.data, block.fc_proj(block.fc(Tensor(x3)).gelu()).data)
assert np.allclose(xp.grad, xw.grad)
print0(f"parallel MLP: allreduces per forward + backward = {group.counters['allreduce']['calls']}")
assert group.counters["allreduce"]["calls"] == 2

# %% [markdown]
# ## 5. Attention, split by heads
# The heads are independent, so rank i keeps the q, k, v columns of its n_head/p heads
# (column-parallel QKV), attends with them alone, and the output projection is
# row-parallel over the same features.

# %%
attn = ParallelAttention(block.attn, group)
assert np.allclose(attn(Tensor(x3)).data, block.attn(Tensor(x3)).data)
print0(f"attention: {block.attn.n_head} heads, {attn.n_head} on each rank")
assert attn.n_head == block.attn.n_head // p

# %% [markdown]
# ## 6. The vocabulary: embedding rows and a cross-entropy that never gathers the logits
# Rank i keeps the rows of tokens [v_i, v_{i+1}) (11 tokens: an uneven split). Lookup
# masks the other tokens to zero, then g sums: exactly one rank contributes each row. The
# head's logits stay split by columns; the cross-entropy allreduces each row's max, and its
# sum of exponentials and target logit: N numbers, not N x V.

# %%
tokens = rng.integers(0, cfg.vocab_size, (B, T))
emb = VocabParallelEmbedding(nn.Embedding(11, C, rng=np.random.default_rng(3)), group)
whole_table = nn.Embedding(11, C, rng=np.random.default_rng(3))
assert np.allclose(emb(tokens).data, whole_table(tokens).data)
logits = rng.standard_normal((B, T, cfg.vocab_size))
mine = slice(emb.start, emb.stop)
group.reset_counters()
loss = vocab_parallel_cross_entropy(Tensor(logits[..., mine]), tokens, emb.start, group)
assert np.isclose(loss.item(), nn.cross_entropy(Tensor(logits), tokens).item())
rows = comm.allgather(np.array([emb.start, emb.stop]), group=group)
reduced = group.counters["allreduce"]  # the max, then (sum of exponentials, target logit)
N = B * T
print0(
    f"vocab-parallel cross-entropy {loss.item():.6f}; tokens per rank "
    f"{[f'{lo}..{hi - 1}' for lo, hi in rows]}; {reduced['calls']} allreduces of 3 N = "
    f"{3 * N} numbers in all, not N x V = {N * cfg.vocab_size}"
)
assert rows[-1][1] == cfg.vocab_size and len({hi - lo for lo, hi in rows}) == 2  # uneven
assert reduced["calls"] == 2 and reduced["bytes_recv"] <= (p - 1) * 3 * N * logits.itemsize

# %% [markdown]
# ## 7. Sequence parallelism (Korthikanti et al. 2022)
# Between the parallel blocks, LayerNorm and dropout run on whole activations that every
# rank holds identically: p copies. Split them along the sequence instead: an allreduce is a
# reduce-scatter plus an allgather, so put the reduce-scatter at the block's end (each rank
# keeps its T/p positions) and the allgather at the next block's start. Same bytes;
# LayerNorm's activations divided by p.

# %%
lo, hi = sequence_range(T, group)
sp_mlp = ParallelMLP(block.fc, block.fc_proj, group, sequence_parallel=True)
group.reset_counters()
out_sp = sp_mlp(Tensor(x3[:, lo:hi]))  # in: my positions; out: my positions, summed
assert out_sp.shape == (B, T // p, C)  # the activations between blocks: 1/p on each rank
assert np.allclose(out_sp.data, out.data[:, lo:hi])
sent = {k: v["bytes_sent"] for k, v in group.counters.items() if k != "checks"}
ring = 2 * (p - 1) / p * x3.nbytes  # what g's ring allreduce of the same tensor sends
print0(f"sequence-parallel MLP forward sent {sent} bytes; g's allreduce: {ring:.0f}")
assert sum(sent.values()) == ring

# %% [markdown]
# ## 8. TensorParallelGPT around a GPT you built, head tied to the embedding
# `TensorParallelGPT(gpt, group)` slices a whole nn.GPT: every layer above, in its place.
# GPT-2 ties its head to its token embedding E (V x C): logits = X E^T, one weight used
# twice. The embedding's rows v_i..v_{i+1} are the head's columns v_i..v_{i+1}, so the
# tied head multiplies by the embedding's own shard E_i, and autograd adds the two uses'
# gradients. A few AdamW steps, each rank on its shards, against the one process:


# %%
class TiedHead(nn.Module):
    """logits = x E^T, E the token embedding's own Parameter (not a copy)."""

    def __init__(self, wte: nn.Embedding):
        self.weight = wte.weight

    def forward(self, x):
        return x @ self.weight.T


def tied_gpt() -> nn.GPT:
    gpt = nn.GPT(cfg, seed=5, dtype=np.float64)  # the same seed on every rank
    gpt.head = TiedHead(gpt.wte)
    return gpt


gpt, tp_gpt = tied_gpt(), TensorParallelGPT(tied_gpt(), group)
opt, tp_opt = AdamW(gpt.parameters(), lr=1e-2), AdamW(tp_gpt.parameters(), lr=1e-2)
targets = np.roll(tokens, -1, axis=1)  # any targets will do
for step in range(3):
    one, split = nn.cross_entropy(gpt(tokens), targets), tp_gpt.loss(tokens, targets)
    for loss, optimizer in ((one, opt), (split, tp_opt)):
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print0(f"step {step}: one process {one.item():.9f}, tensor parallel {split.item():.9f}")
    assert np.isclose(split.item(), one.item(), rtol=1e-10)
whole = tp_gpt.gather_whole("data")  # collective: the shards put back together
assert all(np.allclose(whole[name], q.data, rtol=1e-10) for name, q in gpt.named_parameters())
print0(f"tied: {tp_gpt.tied}; wte.weight on rank {r}: {tp_gpt.wte.weight.shape} of {(11, C)}")
assert tp_gpt.tied and tp_gpt.wte.weight.shape == (emb.stop - emb.start, C)

# %% [markdown]
# ## 9. The whole GPT trains like one process
# `--strategy tp` slices the same nn.GPT every rank builds from the seed; in float64 the
# losses match single-process training to rounding (the largest gap is printed).

# %%
config = TrainConfig(
    strategy="tp", n_layer=1, n_embd=16, n_head=4, block_size=8, batch_size=8,
    dtype="float64", sequence_parallel=True, overlap="off",
)  # fmt: skip
solo = comm.world().split(comm.world().rank)  # each rank alone: the reference
curves = {}
for name, Scheme, g in (("one process", DataParallel, solo), ("tp", TensorParallel, None)):
    with Scheme(Task(config, np.float64), config, g or comm.world()) as strategy:
        sampler = DistributedSampler(strategy.task.num_examples, 8, *strategy.data_shard, seed=0)
        curves[name] = [strategy.step(sampler.local_indices(s), 3e-3).loss for s in range(15)]
print0("step  one process  tensor parallel")
for s in range(0, 15, 3):
    print0(f"{s:4d}  {curves['one process'][s]:.9f}  {curves['tp'][s]:.9f}")
gap = np.max(np.abs(np.subtract(curves["tp"], curves["one process"])) / curves["one process"])
print0(f"largest relative gap over 15 steps: {gap:.1e}")
assert gap < 1e-12
plt = pyplot() if r == 0 else None
if plt is not None:
    fig, ax = plt.subplots(figsize=(5, 3))
    for name, losses in curves.items():
        ax.plot(losses, label=name, linestyle="--" if name == "tp" else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    save(fig, os.path.join(tempfile.gettempdir(), "minidp_07_tp_vs_one_process.png"))
solo.free()
mesh.close()
print0("all checks passed")
