# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 02 · Training on one process: an MLP, then a tiny GPT
#
# Launch line:
#
# python tutorials/02_training.py
#
# Everything a parallel scheme will later split up, on one process: data, a model, a loss,
# backward, an optimizer step. The data ships with minidp: synthetic clusters, and a
# character corpus made from the docstrings of Python's own standard library.

# %%
import numpy as np

from minidp import Tensor, cross_entropy, data, nn, no_grad, optim
from minidp.tools.info import one_blas_thread

one_blas_thread()  # one BLAS thread, as each rank of the later tutorials has

# %% [markdown]
# ## 1. An MLP on synthetic clusters
# 10 Gaussian clusters in 32 dimensions. The sampler hands out the **global batch** for each
# step; with one process, this rank's slice is all of it.

# %%
x_train, y_train, x_val, y_val = data.classification(seed=0)
assert x_train.shape[1] == 32 and len(np.unique(y_train)) == 10  # 10 clusters, 32 dimensions
model = nn.MLP([32, 64, 64, 10], rng=np.random.default_rng(0))
opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sampler = data.DistributedSampler(len(x_train), global_batch=64, seed=0)


def accuracy(x, y) -> float:
    with no_grad():
        return float((model(Tensor(x)).data.argmax(axis=1) == y).mean())


print(f"before: accuracy {accuracy(x_val, y_val):.2f}")
for step in range(150):
    idx = sampler.local_indices(step)
    assert len(idx) == 64  # one process: its slice is the whole global batch
    loss = cross_entropy(model(Tensor(x_train[idx])), y_train[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 50 == 0:
        print(f"step {step:3d} loss {loss.item():.3f}")
acc = accuracy(x_val, y_val)
print(f"after: accuracy {acc:.2f}")
assert acc > 0.8, "the MLP should separate the clusters"

# %% [markdown]
# ## 2. A tiny GPT on the standard library's docstrings
# Inputs are windows of `block_size` characters; targets are the same windows shifted by
# one: the model learns to predict the next character. AdamW with warmup then cosine decay,
# and global-norm clipping, as nanoGPT does.

# %%
train_ids, val_ids, tok = data.char_corpus()
print(f"corpus: {len(train_ids):,} training characters, vocabulary {tok.vocab_size}")
cfg = nn.GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32)
gpt = nn.GPT(cfg, seed=0)
print(f"GPT with {gpt.num_parameters():,} parameters")
assert gpt.num_parameters() == sum(p.size for p in gpt.parameters())
opt = optim.AdamW(gpt.parameters(), lr=3e-3)
sampler = data.DistributedSampler(len(train_ids) - cfg.block_size, global_batch=16, seed=0)
steps, losses, lrs = 150, [], []
for step in range(steps):
    opt.lr = optim.warmup_cosine(step, 3e-3, warmup=10, total=steps)
    lrs.append(opt.lr)
    xb, yb = data.lm_batch(train_ids, sampler.local_indices(step), cfg.block_size)
    assert np.array_equal(xb[:, 1:], yb[:, :-1])  # the targets: the inputs shifted by one
    loss = cross_entropy(gpt(xb), yb)
    opt.zero_grad()
    loss.backward()
    optim.clip_grad_norm(gpt.parameters(), 1.0)
    opt.step()
    losses.append(loss.item())
    if step % 50 == 0:
        print(f"step {step:3d} loss {loss.item():.3f} lr {opt.lr:.1e}")
print(f"loss: first 10 steps {np.mean(losses[:10]):.2f} -> last 10 {np.mean(losses[-10:]):.2f}")
assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 1.0, "the GPT should learn"
assert np.allclose(lrs[:10], 3e-3 * np.arange(1, 11) / 10)  # warmup: linear to the peak
assert (np.diff(lrs[9:]) <= 0).all() and lrs[-1] > 3e-4  # cosine, down towards peak/10

# %% [markdown]
# ## 3. Sampling
# Feed a newline, then repeatedly sample the next character from the softmax.

# %%
out = gpt.generate(np.array([tok.encode("\n")]), 120, rng=np.random.default_rng(0))
print(tok.decode(out[0]))
assert out.shape == (1, 1 + 120)  # the newline, then 120 sampled characters

# %% [markdown]
# The same loop, with flags and a log, is `python -m minidp` (minidp/cli/training/loop.py); with
# `mpiexec -n 4` in front it becomes data parallel (tutorial 05).
