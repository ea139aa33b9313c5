# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 14 · Checkpoints: save once, resume bit for bit, reshard by hand, refuse a corrupt shard
#
# Launch line:
#
# mpiexec -n 4 python tutorials/14_checkpoints.py
#
# A run killed at step 9,000 should go on from step 9,000, not from 0, and go on exactly as
# if nothing had happened. `minidp.parallel.checkpoint` writes one safetensors shard per rank
# (data, never pickle) and, last, a manifest that is the commit marker; loading checks each
# shard's SHA-256 first. We save a data-parallel run, see its replicated state written once
# (not once per rank), and resume it bit for bit; reshard an FSDP run from 4 ranks to 2, by
# hand and then with the library, bit for bit the same; watch a flipped bit refused, and see
# a folder kept to one job.

# %%
import json
import os
import shutil
import tempfile

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.parallel import DistributedDataParallel, FullyShardedDataParallel, checkpoint
from minidp.tools.chunks import chunk_range
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # 4 ranks on a few cores: one BLAS thread each
world = comm.world()
rank, P = world.rank, world.size
assert P == 4, "run with mpiexec -n 4"
root = comm.broadcast_text(tempfile.mkdtemp() if rank == 0 else "", root=0, group=world)
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float32)


def mlp(seed: int = 0):
    return nn.MLP([32, 64, 10], rng=np.random.default_rng(seed))


def train_steps(wrapper, opt, steps, group):
    """Each rank of `group` takes its share of a batch of 32 at each step (the step picks
    the batch), so any number of ranks trains on the same examples."""
    for step in steps:
        lo, hi = chunk_range(32, group.size, group.rank)
        batch = slice(32 * step + lo, 32 * step + hi)
        wrapper.set_batch_share(hi - lo, 32)
        opt.zero_grad()
        cross_entropy(wrapper(Tensor(x_all[batch])), y_all[batch]).backward()
        wrapper.finish_gradient_sync()
        opt.step()


# %% [markdown]
# ## 1. A shard is a safetensors file: read one by hand
#
# 8 bytes of header length (little-endian), a JSON header naming each array's dtype, shape
# and byte range (and, under `__metadata__`, the tree's skeleton), then the arrays' bytes.
# A dozen lines read it; we use them below to count what each shard holds and to reshard by
# hand.

# %%
DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64}


def read_safetensors(file: str) -> dict:
    raw = open(file, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")  # the skeleton: dicts, lists, plain values
    return {
        name: np.frombuffer(raw[8 + n + a : 8 + n + b], DTYPES[e["dtype"]]).reshape(e["shape"])
        for name, e in header.items()
        for a, b in [e["data_offsets"]]
    }


# %% [markdown]
# ## 2. Save after 3 steps: what every rank holds is written once
#
# `checkpoint.get_state_dict(ddp, opt)` names what this rank holds, and says how: under DDP
# every parameter and its AdamW moments are *replicated*, the same on every rank. Writing
# them from each of 4 ranks would put 4 identical copies on disk (4 shards, one SHA-256).
# As PyTorch's DCP does, the lowest rank holding each replicated array writes it; the
# others' shards keep only the tree's skeleton, and the manifest's `saved_by` says where
# each array is. The same state saved over 2 ranks writes the same bytes.

# %%
model = mlp()
ddp = DistributedDataParallel(model, world, overlap=False)
opt = optim.AdamW(model.parameters(), 1e-2)
train_steps(ddp, opt, range(3), world)
model_sd, optim_sd = checkpoint.get_state_dict(ddp, opt)
state = {"model": model_sd, "optim": optim_sd, "step": 3}
path = checkpoint.step_directory(root, 3)
checkpoint.save(state, path, world, step=3)
held = checkpoint.read_manifest(path)["tensors"]["model/layers.0.weight"]
print0(f"model/layers.0.weight: held on ranks {held['on']}, written by rank {held['saved_by']}")
assert held["on"] == [0, 1, 2, 3] and held["saved_by"] == 0
state_bytes = sum(p.data.nbytes for p in model.parameters()) * 3  # weights, m and v
state_bytes += 8 * len(model.parameters())  # and each parameter's step count (int64)

half = world.split(0 if rank < 2 else None)  # the same state saved over 2 of the ranks
if half is not None:
    checkpoint.save(state, f"{root}/over_2", half, step=3)
comm.barrier(group=world)
written = {}
for ranks, where in ((4, path), (2, f"{root}/over_2")):
    shards = checkpoint.read_manifest(where)["shards"]
    data_bytes = [sum(a.nbytes for a in read_safetensors(f"{where}/{s['file']}").values())
                  for s in shards]  # fmt: skip
    files = [s["bytes"] for s in shards]
    written[ranks] = data_bytes
    print0(f"over {ranks} ranks: arrays per shard {data_bytes} B; files {files} B "
           f"(the rest is each header: skeleton and names)")  # fmt: skip
assert written[4] == [state_bytes, 0, 0, 0] and written[2] == [state_bytes, 0]
print0(f"the state's {state_bytes:,} B are written once at 4 ranks and at 2, not 4 or 2 times")

# %% [markdown]
# ## 3. Resume in new objects, 3 more steps: the same bits as 6 in a row
#
# `checkpoint.load` fills the new objects' state dicts in place (rank 1 reads its own shard,
# and the model from rank 0's); `set_state_dict` hands them back.

# %%
train_steps(ddp, opt, range(3, 6), world)  # the uninterrupted run goes on
again = mlp(seed=7)  # other weights: everything must come from the checkpoint
ddp2 = DistributedDataParallel(again, world, overlap=False)
opt2 = optim.AdamW(again.parameters(), 1e-2)
model_sd2, optim_sd2 = checkpoint.get_state_dict(ddp2, opt2)
loaded = {"model": model_sd2, "optim": optim_sd2, "step": 0}
checkpoint.load(loaded, checkpoint.latest(root), world)
checkpoint.set_state_dict(ddp2, opt2, model_state_dict=model_sd2, optim_state_dict=optim_sd2)
assert loaded["step"] == 3  # a plain value: set by the load too
train_steps(ddp2, opt2, range(loaded["step"], 6), world)
for (name, p), q in zip(model.named_parameters(), again.parameters()):
    assert np.array_equal(p.data, q.data), name
print0(f"resumed at step {loaded['step']}: after step 6 every parameter is the "
       "uninterrupted run's, bit for bit")  # fmt: skip
ddp.close()
ddp2.close()

# %% [markdown]
# ## 4. Reshard by hand: FSDP over 4 ranks saved, loaded over 2
#
# Under FSDP each rank holds a range of every flattened parameter (and of its moments). The
# manifest says which (`held`: per dimension, runs `[lo, hi)`), so 2 ranks can cut their
# new, larger ranges from the 4 old ones: put each parameter together from the shards that
# hold it, then take this rank's range. By hand first, for the model's parameters; then
# `checkpoint.load`, which does the same for every array, parameters and moments, and
# must agree bit for bit. (`--resume` over another world size does this for the command
# line's runs.)

# %%
fsdp = FullyShardedDataParallel(mlp(), world)
opt = optim.AdamW(fsdp.parameters(), 1e-2)
train_steps(fsdp, opt, range(3), world)
model_sd, optim_sd = checkpoint.get_state_dict(fsdp, opt)
sharded = f"{root}/fsdp"
checkpoint.save({"model": model_sd, "optim": optim_sd}, sharded, world, step=3)
saved_whole = fsdp.full_state_dict()
fsdp.close()
manifest = checkpoint.read_manifest(sharded)
runs = [h["index"][0] for h in manifest["tensors"]["model/layers.0.weight"]["held"]]
print0(f"layers.0.weight (2,048 values, flattened) over 4 ranks: rank r holds {runs}")

if half is not None:
    fsdp2 = FullyShardedDataParallel(mlp(seed=7), half)
    opt2 = optim.AdamW(fsdp2.parameters(), 1e-2)
    model_sd2, optim_sd2 = checkpoint.get_state_dict(fsdp2, opt2)
    shards = [read_safetensors(f"{sharded}/{s['file']}") for s in manifest["shards"]]
    by_hand = {}
    for name, entry in model_sd2.items():  # a Sharded: this rank's elements, and which
        key, saved = f"model/{name}", manifest["tensors"][f"model/{name}"]
        whole = np.empty(saved["shape"], entry.local.dtype)  # the flattened parameter
        for r, held in enumerate(saved["held"]):
            at = 0  # rank r's runs, one after another in its shard (None: it held none)
            for lo, hi in held["index"][0] if held else []:
                whole[lo:hi] = shards[r][key][at : at + hi - lo]
                at += hi - lo
        by_hand[name] = np.concatenate([whole[lo:hi] for lo, hi in entry.where.runs[0]])
    new_runs = half.comm.gather(model_sd2["layers.0.weight"].where.runs[0], root=0)
    print0(f"over 2 ranks: rank r holds {new_runs}")

    state2 = {"model": model_sd2, "optim": optim_sd2}
    checkpoint.load(state2, sharded, half)  # the library: every array, in place
    checkpoint.set_state_dict(fsdp2, opt2, model_state_dict=model_sd2, optim_state_dict=optim_sd2)
    for name, entry in model_sd2.items():
        assert np.array_equal(entry.local, by_hand[name]), name
    for name, value in fsdp2.full_state_dict().items():
        assert np.array_equal(value, saved_whole[name]), name
    print0("by hand = checkpoint.load, bit for bit; the whole model is the one saved over 4")
    fsdp2.close()
comm.barrier(group=world)

# %% [markdown]
# ## 5. A corrupt shard is refused, on every rank, before anything is loaded
#
# Flip one bit of the model's bytes in shard 0, the one shard that holds them: every rank
# reads it (rank 0 its own, the others for the replicated model), finds the checksum
# wrong, and says so, so no rank goes on with half a model.

# %%
shard = os.path.join(path, "shard_00000.safetensors")
if rank == 0:
    with open(shard, "r+b") as f:
        f.seek(-100, os.SEEK_END)  # inside the arrays' bytes
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
comm.barrier(group=world)
try:
    checkpoint.read(path, world)
    raise AssertionError("a corrupt shard was loaded")
except checkpoint.CheckpointError as error:
    assert "shard_00000.safetensors is corrupt" in str(error)
    print0(f"refused on every rank: {str(error)[:110]}...")
try:
    checkpoint.read(f"{root}/nothing-here", world)
    raise AssertionError("a folder without a manifest was loaded")
except checkpoint.CheckpointError as error:
    assert "has no manifest.json" in str(error)
    print0(f"refused: {error}")

# %% [markdown]
# ## 6. One job at a time in a folder
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
        assert "is in use by another job" in str(error)
        print0(f"refused: {error}")
comm.barrier(group=world)
if rank == 0:
    shutil.rmtree(root)
