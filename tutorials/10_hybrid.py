# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 10 · The 3-D mesh: data x pipeline x tensor parallelism, equal to one process
#
# Launch line:
#
# mpiexec -n 8 python tutorials/10_hybrid.py
#
# Megatron-LM trains its largest models on a grid of ranks (Narayanan et al. 2021): tensor
# parallelism inside a node (many small allreduces, on the fastest links), pipeline stages
# across nodes (one message per micro-batch per cut), and data parallelism over copies of the
# whole pipeline (one gradient reduction per step). Each rank sits at (d, p, t) and belongs
# to one group per axis. This tutorial places 8 ranks on a 2 x 2 x 2 grid and draws which
# groups each rank belongs to; composes the three pieces by hand, TP inside each pipeline
# stage, DDP over the copies, and checks the gradients against one process; measures what
# each axis sends; then trains `--strategy hybrid --dp 2 --tp 2 --pp 2` equal to one
# process in float64.

# %%
import os
import tempfile

import numpy as np

from minidp import comm, cross_entropy, nn
from minidp.cli.strategies import STRATEGIES, DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.comm.trace import Timeline
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.parallel import (
    DistributedDataParallel,
    Mesh,
    PipelineStage,
    TensorParallelGPT,
    build_schedule,
    run_schedule,
    split_batch,
    split_model,
)
from minidp.parallel.pipeline.executor import measured_bubble
from minidp.parallel.pipeline.simulate import formula_bubble, simulate
from minidp.parallel.tensor_parallel.gpt import whole_arrays
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0
from minidp.tools.plots import pyplot, save

one_blas_thread()  # 8 ranks on a few cores: one BLAS thread each
world = comm.world()
assert world.size == 8, "run with mpiexec -n 8: a 2 x 2 x 2 mesh"
rank = world.rank

# %% [markdown]
# ## 1. The grid and each rank's three groups
# `Mesh(dp, tp, pp)` numbers the ranks as `arange(8).reshape(dp, pp, tp)`: tp fastest, so a
# TP group is neighbouring ranks (one node), then pp, then dp. A rank's group on an axis is
# the ranks that differ from it on that axis only; `Group.split` builds all three.

# %%
mesh = Mesh(dp=2, tp=2, pp=2)
print0(mesh.describe())
coords = world.comm.gather((rank, mesh.coords), root=0)
if rank == 0:
    print("rank  (d, p, t)   tp group   pp group   dp group")
    for r, c in coords:
        line = [m for axis in ("tp", "pp", "dp") for m in mesh.members(axis) if r in m]
        print(
            f"{r:4d}  ({c['dp']}, {c['pp']}, {c['tp']})      {line[0]}     {line[1]}     {line[2]}"
        )
assert mesh.members("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
assert mesh.members("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
assert mesh.members("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]

plt = pyplot() if rank == 0 else None
if plt is not None:  # the grid three times, each rank coloured by its group on one axis
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, axis in zip(axes, ("tp", "pp", "dp")):
        for colour, members in enumerate(mesh.members(axis)):
            for r in members:
                d, p, _, t = (int(i) for i in np.argwhere(mesh.grid == r)[0])  # (d, p, c, t)
                x, y = 2 * p + t, 1 - d  # columns: stage, then TP shard; rows: replicas
                ax.add_patch(plt.Rectangle((x, y), 0.9, 0.9, color=f"C{colour}", alpha=0.7))
                ax.text(x + 0.45, y + 0.45, str(r), ha="center", va="center", fontsize=12)
        ax.set(xlim=(-0.1, 4), ylim=(-0.1, 2), title=f"{axis} groups", xticks=[], yticks=[])
        ax.set_xlabel("stage 0 (t 0, 1) | stage 1 (t 0, 1)")
        ax.set_ylabel("replica d = 1 | d = 0")
    save(fig, os.path.join(tempfile.gettempdir(), "minidp_10_mesh.png"))

# %% [markdown]
# ## 2. The pieces composed by hand
# Every rank builds the same GPT from the seed. Its TP group slices every layer
# (`TensorParallelGPT`); `split_model` cuts the sliced model into pp stages, and rank (d, p, t)
# keeps stage p's part; `PipelineStage` passes activations along its pp group; DDP wraps
# the part over the dp group, the ranks holding the same slice of the same stage. One step:
# every micro-batch under `ddp.no_sync()` (gradients add up), then one reduction.
#
# Tutorial 05 ran the last micro-batch's backward *outside* `no_sync()`, so that its
# buckets reduce while backward still runs. In a pipeline this rank's last backward is one
# action deep inside `run_schedule`, between other stages' sends and receives, so here the
# whole schedule runs under `no_sync()` and `ddp.finish_gradient_sync()` afterwards reduces
# every bucket at once: the same sum, with no overlap of that last backward. (PyTorch has
# no such call: its DDP reduces only in a backward outside `no_sync()`, so there the last
# micro-batch must leave the block; Megatron-LM and PyTorch's pipelining instead switch
# the sync on for the last micro-batch's backward from inside the schedule.)

# %%
cfg = nn.GPTConfig(vocab_size=24, block_size=8, n_layer=4, n_head=4, n_embd=16)
B, M = 8, 4  # the global batch; micro-batches per replica
rng = np.random.default_rng(0)  # the same data on every rank
idx = rng.integers(0, cfg.vocab_size, size=(B, cfg.block_size))
targets = rng.integers(0, cfg.vocab_size, size=(B, cfg.block_size))

reference = nn.GPT(cfg, seed=1, dtype=np.float64)  # one process, the whole batch
logits = reference(idx)
cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1)).backward()
want = {name: p.grad for name, p in reference.named_parameters()}

model = TensorParallelGPT(nn.GPT(cfg, seed=1, dtype=np.float64), mesh.tp_group)
parts = split_model(model, mesh.pp)
stage_index = mesh.coords["pp"]
stage = PipelineStage(
    parts[stage_index], stage_index, mesh.pp, mesh.pp_group, loss_fn=model.criterion
)
ddp = DistributedDataParallel(parts[stage_index], mesh.dp_group, overlap=False)
schedule = build_schedule("1f1b", mesh.pp, M)

d = mesh.coords["dp"]  # replica d reads half the batch
lo, hi = d * B // mesh.dp, (d + 1) * B // mesh.dp
micro_in, micro_t, shares = split_batch(idx[lo:hi], targets[lo:hi], M)
ddp.set_batch_share(hi - lo, B)  # its mean weighs (hi - lo) / B in the global mean
timeline = Timeline()  # each compute action's span, "F 0.3": forward of stage 0, micro-batch 3
with ddp.no_sync():
    run_schedule(schedule, {stage_index: stage}, micro_in, micro_t, shares, timeline=timeline)
ddp.finish_gradient_sync()

whole = whole_arrays(parts[stage_index].parameters(), mesh.tp_group, "grad")  # over TP
worst = max(float(np.max(np.abs(g - want[name]))) for name, g in whole.items())
for r, s, n, w in world.comm.gather((rank, stage_index, len(whole), worst), root=0) or []:
    print(f"rank {r} (stage {s}): {n} whole gradients against one process, max |diff| {w:.1e}")
assert worst < 1e-12
ddp.close()

# %% [markdown]
# ### The bubble, measured against (p-1)/(m+p-1)
# 1F1B's formula, (p-1)/(m+p-1) = 1/5 here, is the bubble of equal stages whose messages
# take no time. This run's are neither. Stage 0 holds the embedding, stage 1 the LM head and
# the vocabulary-parallel loss, so their spans differ: replaying the schedule with each
# stage's mean forward and backward (`simulate`, messages free) gives the bubble that this
# imbalance makes, never below the formula. Replaying it with each action's own duration
# adds the spread between micro-batches (on shared cores one action runs long while the
# other rank waits, or while it would have waited anyway: this one may fall below the
# formula). What the run measured adds the time between spans (the pipeline's messages,
# Python), so it is not below that replay, but for a hair: a send leaves inside its span,
# so the next stage may start just before the span ends (within 0.02 is checked).

# %%
took = {e["name"]: e["dur"] for e in timeline.events if e["name"][:1] in ("F", "B")}  # µs
spans = {k: v for part in mesh.pp_group.comm.allgather(took) for k, v in part.items()}
mean = {k: np.mean([v for n, v in spans.items() if n[:3] == k]) for k in
        ("F 0", "B 0", "F 1", "B 1")}  # fmt: skip


def replay(duration) -> float:
    compute = schedule.compute_actions()
    return simulate(compute, mesh.pp, schedule.num_stages, False, duration).bubble_fraction


by_stage = replay(lambda a: mean[f"{a.kind} {a.stage}"])
by_action = replay(lambda a: spans[f"{a.kind} {a.stage}.{a.micro_batch}"])
measured = measured_bubble(timeline, mesh.pp_group)
formula = formula_bubble("1f1b", mesh.pp, M)
print0(
    f"stage 0: F {mean['F 0'] / 1e3:.2f} ms, B {mean['B 0'] / 1e3:.2f} ms; stage 1: "
    f"F {mean['F 1'] / 1e3:.2f} ms, B {mean['B 1'] / 1e3:.2f} ms (means of {M} micro-batches)"
)
print0(f"bubble: formula {formula:.3f} <= replayed with the stages' means {by_stage:.3f}; "
       f"replayed with each action's time {by_action:.3f} <= measured {measured:.3f} "
       "(+ 0.02: a send leaves inside its span)")  # fmt: skip
assert formula - 1e-9 <= by_stage and by_action <= measured + 0.02, (by_stage, by_action)


# %% [markdown]
# ## 3. What each axis sends
# The recipe `--strategy hybrid --dp 2 --tp 2 --pp 2` builds just this. Each axis's bytes
# per step: TP's allreduces of activations (two per block in forward, two in backward, and
# the vocabulary-parallel loss's), the pipeline's one activation and one gradient per
# micro-batch per cut, and DP's gradients once per step (of this rank's slice of its stage
# only). TP's volume grows with the tokens, DP's with the parameters: at this toy size they
# are alike; in Megatron's models TP's dominates, which is why it stays inside a node.

# %%
base = dict(n_layer=4, n_embd=16, n_head=4, block_size=8, batch_size=8, seed=3,
            dtype="float64", grad_clip=0.05, eval_batches=1, sample_tokens=0)  # fmt: skip
config = TrainConfig(**base, strategy="hybrid", dp=2, tp=2, pp=2, micro_batches=4)
STEPS = 4


def train(strategy) -> list[float]:
    count = strategy.config.batch_size
    sampler = DistributedSampler(strategy.task.num_examples, count, *strategy.data_shard, seed=3)
    return [strategy.step(sampler.local_indices(s), 1e-2).loss for s in range(STEPS)]


with STRATEGIES["hybrid"](Task(config, np.float64), config, world) as hybrid:
    before = hybrid.bytes_sent_by_axis()  # building it sent rank 0's weights over DP
    losses = train(hybrid)
    sent = {axis: n - before[axis] for axis, n in hybrid.bytes_sent_by_axis().items()}
    hybrid.gather_model()
    trained = hybrid.task.model.state_dict()
    record = hybrid.record()
    bubble = record["bubble_fraction"]
per_rank = world.comm.gather(sent, root=0)
if rank == 0:
    print("rank   dp KB/step   tp KB/step   pp KB/step")
    for r, s in enumerate(per_rank):
        print(f"{r:4d}  {s['dp'] / STEPS / 1e3:11.1f}  {s['tp'] / STEPS / 1e3:11.1f}  "
              f"{s['pp'] / STEPS / 1e3:11.1f}")  # fmt: skip
    assert all(s["tp"] > s["pp"] > 0 and s["dp"] > 0 for s in per_rank)
    assert all(0.5 < s["tp"] / s["dp"] < 2 for s in per_rank)  # alike at this toy size
print0(f"the recipe's measured bubble: {bubble:.3f}, the mean of {STEPS} steps (formula "
       f"{record['bubble_fraction_formula']:.3f}; what moves it: §2)")  # fmt: skip
assert record["bubble_fraction_formula"] == formula

# %% [markdown]
# ## 4. Equal to one process
# The same config on one rank, data parallelism over a group of one: the per-step losses and
# the trained parameters agree to float64 rounding.

# %%
solo = world.split(rank)
one = TrainConfig(**base)
with DataParallel(Task(one, np.float64), one, solo) as single:
    want_losses = train(single)
    want_params = single.task.model.state_dict()
solo.free()
print0("step   3-D mesh            one process")
for s, (a, b) in enumerate(zip(losses, want_losses)):
    print0(f"{s:4d}   {a:.15f}   {b:.15f}")
np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
for name, value in want_params.items():
    np.testing.assert_allclose(trained[name], value, rtol=1e-10, atol=1e-13)
print0("the 2 x 2 x 2 mesh trains like one process")
mesh.close()
