# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 14 · Checkpoints: save, resume bit for bit, reshard, refuse a corrupt shard, one job a folder
#
# Launch line:
#
# mpiexec -n 4 python tutorials/14_checkpoints.py
#
# A run killed at step 9,000 should go on from step 9,000, not from 0, and go on exactly as
# if nothing had happened. `minidp.parallel.checkpoint` writes one safetensors shard per rank
# (data, never pickle) and, last, a manifest that is the commit marker; loading checks each
# shard's SHA-256 first. We save a data-parallel run and resume it bit for bit, reshard a
# ZeRO run from 4 ranks to 2, watch a flipped bit refused, and see a folder kept to one
# job.

# %%
import os
import shutil
import tempfile

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.cli.training.loop import train
from minidp.parallel import DistributedDataParallel, checkpoint
from minidp.tools.log import print0

world = comm.world()
rank, P = world.rank, world.size
root = comm.broadcast_text(tempfile.mkdtemp() if rank == 0 else "", root=0, group=world)
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float32)


def fresh():
    """The same model and AdamW on every rank, wrapped in DDP."""
    model = nn.MLP([32, 64, 10], rng=np.random.default_rng(0))
    ddp = DistributedDataParallel(model, world, overlap=False)
    return model, ddp, optim.AdamW(model.parameters(), 1e-2)


def train_steps(model, ddp, opt, steps):
    """Each rank takes its quarter of a batch of 32 at each step (the step picks the batch)."""
    for step in steps:
        batch = slice(32 * step + 8 * rank, 32 * step + 8 * rank + 8)
        opt.zero_grad()
        cross_entropy(model(Tensor(x_all[batch])), y_all[batch]).backward()
        ddp.finish_gradient_sync()
        opt.step()


# %% [markdown]
# ## Save after 3 steps, resume in new objects, 3 more: the same bits as 6 in a row
#
# The state is a plain tree: the model's arrays, the optimizer's moments and step count, the
# step. Each rank writes its own; the manifest records every shard's checksum and size.

# %%
model, ddp, opt = fresh()
train_steps(model, ddp, opt, range(3))
state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}
path = checkpoint.step_directory(root, 3)
checkpoint.save(state, path, world, step=3)
print0(f"saved {sorted(os.listdir(path))}")
train_steps(model, ddp, opt, range(3, 6))  # the uninterrupted run goes on

again, ddp2, opt2 = fresh()  # a new process would build these
loaded = checkpoint.read(checkpoint.latest(root), world)
again.load_state_dict(loaded["model"])
opt2.load_state_dict(loaded["optimizer"])
train_steps(again, ddp2, opt2, range(loaded["step"], 6))
for (name, p), q in zip(model.named_parameters(), again.parameters()):
    assert np.array_equal(p.data, q.data), name
print0("resumed at step 3: after step 6 every parameter is the uninterrupted run's, bit for bit")

# %% [markdown]
# ## Reshard: ZeRO over 4 ranks saved, loaded over 2
#
# Under ZeRO each rank holds a chunk of the flat parameter vector and of its optimizer
# moments. The manifest says which elements each shard holds (`held`), so 2 ranks can cut
# their new, larger chunks from the 4 old ones. The training loop does it with `--resume`;
# after it, training goes on like one process (float64).

# %%
tiny = dict(n_layer=1, n_embd=16, n_head=2, block_size=8, batch_size=8, steps=4,
            dtype="float64", eval_batches=1, sample_tokens=0, log_every=100)  # fmt: skip
solo = world.split(0 if rank == 0 else None)  # rank 0 alone: the reference
want = train(TrainConfig(**tiny), solo)["param_l2"] if solo is not None else 0.0
want = float(comm.broadcast(np.array([want]), root=0, group=world)[0])
zero = dict(tiny, strategy="zero", zero_stage=2)
train(TrainConfig(**zero, save_dir=f"{root}/zero", save_every=2), world)
held = checkpoint.read_manifest(f"{root}/zero/step_000002")["tensors"]["strategy/shard"]
print0(f"saved over 4 ranks; rank r holds of the flat vector: {[h['index'] for h in held['held']]}")
half = world.split(0 if rank < 2 else None)
if half is not None:
    got = train(TrainConfig(**zero, resume=f"{root}/zero/step_000002"), half)
    assert abs(got["param_l2"] / want - 1) < 1e-10
    print0(f"resumed over 2 ranks: param L2 {got['param_l2']:.12f}, one process {want:.12f}")
comm.barrier(group=world)

# %% [markdown]
# ## A corrupt shard is refused, on every rank, before anything is loaded
#
# Flip one bit in rank 1's shard: rank 1 finds the checksum wrong and tells the others, so
# no rank goes on with half a model.

# %%
shard = os.path.join(path, "shard_00001.safetensors")
if rank == 0:
    with open(shard, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
comm.barrier(group=world)
try:
    checkpoint.read(path, world)
    raise AssertionError("a corrupt shard was loaded")
except checkpoint.CheckpointError as error:
    assert "shard_00001.safetensors is corrupt" in str(error)
    print0(f"refused on every rank: {error}")
try:  # the same through the command line's loop: one line naming the flag
    train(TrainConfig(**tiny, resume=f"{root}/nothing-here"), world)
except BadConfig as error:
    print0(f"refused: {error}")

# %% [markdown]
# ## One job at a time in a folder
#
# Two jobs saving into one folder would overwrite each other's checkpoints, and a resume
# would go on from the other job's weights. A run with `--save-dir` holds the folder's lock
# (`checkpoint.folder_lock`: rank 0's flock, dropped by the kernel however the job ends)
# while it runs; a second holder, here a second `with`, is refused on every rank. And a
# scheduler's SIGTERM makes every rank finish its step and save it: send it to the
# `mpiexec` of `mpiexec -n 4 python -m minidp --steps 3000 --save-dir run`, then run the
# same command with `--resume run` (docs/checkpoints.md).

# %%
with checkpoint.folder_lock(root, world):
    try:
        with checkpoint.folder_lock(root, world):
            raise AssertionError("two jobs held one folder")
    except checkpoint.FolderInUse as error:
        print0(f"refused: {error}")
comm.barrier(group=world)
if rank == 0:
    shutil.rmtree(root)
