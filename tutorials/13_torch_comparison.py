# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 13 · The same model three ways: minidp on NumPy, minidp on torch, plain PyTorch
#
# Launch line:
#
# mpiexec -n 2 python tutorials/13_torch_comparison.py
#
# minidp's engine runs on NumPy arrays, or on torch tensors with `--backend torch` (torch as
# an array library only: minidp's autograd, torch's switched off). And the same MLP and GPT
# are written in plain PyTorch (minidp/models/torch_ref.py), loadable from a minidp state dict. So
# one model, one set of initial weights, one data order can be trained three ways and the
# losses compared, then data parallel: minidp's DP against PyTorch DDP over gloo.

# %%
import os
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch

from minidp import Tensor, comm, functional
from minidp.cli.training.config import TrainConfig
from minidp.engine import backend
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0
from minidp.tools.plots import pyplot, save
from minidp_bench.torch_train import MinidpRun, minidp_losses, train_reference

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores

group = comm.world()
alone = group.split(group.rank)  # a group of one: single-process training on each rank
torch.set_num_threads(1)

# %% [markdown]
# ## One op, two array libraries
#
# An op resolves the namespace of its data once, `xp = namespace(x.data)`: the numpy module
# itself for NumPy arrays (so the NumPy path runs the very calls it always ran), a small shim
# with NumPy's names for torch tensors (backend.py says why a shim and not array-api-compat).

# %%
a = np.array([[1.0, -2.0, 3.0]])
print0(backend.namespace(a).__name__, "|", backend.namespace(torch.from_numpy(a)).__name__)
grads = []
for x in (Tensor(a, requires_grad=True), Tensor(torch.from_numpy(a.copy()), requires_grad=True)):
    functional.cross_entropy(x.relu() * 2.0, np.array([2])).backward()
    grads.append(backend.to_numpy(x.grad))
    assert not getattr(x.data, "requires_grad", False)  # torch's autograd never switched on
np.testing.assert_allclose(grads[1], grads[0], rtol=1e-15)
print0("d loss / d x, both libraries:", grads[0].round(4).tolist())

# %% [markdown]
# ## The same GPT three ways, one process
#
# 20 steps of minidp/cli/training/loop.py's step (AdamW, warmup-cosine, clipping) in float64:
# the losses agree to rounding, far inside the 1e-10 the tests ask.

# %%
config = TrainConfig(
    n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=8, steps=20, warmup=2,
    lr=1e-2, dtype="float64", threads=1, overlap="off",
)  # fmt: skip
curves = {
    "minidp numpy": minidp_losses(config, alone)[0],
    "minidp torch": minidp_losses(replace(config, backend="torch"), alone)[0],
    "pytorch": train_reference(config)[0],
}
backend.use("numpy")
for name, losses in curves.items():
    gap = np.max(np.abs(np.subtract(losses, curves["minidp numpy"])) / curves["minidp numpy"])
    print0(f"{name:13s} loss {losses[0]:.6f} -> {losses[-1]:.6f} | max relative gap {gap:.1e}")
    assert gap < 1e-13  # rounding: a few units in the last place, far inside 1e-10
assert curves["pytorch"][-1] < curves["pytorch"][0]

# %% [markdown]
# ## Data parallel: minidp DP against PyTorch DDP
#
# Both over this job's ranks: minidp's allreduce over MPI, PyTorch's over gloo on 127.0.0.1
# (rank, world and the port all from MPI). Both give single-process training's losses.

# %%
dp_curves = {
    "minidp DP": minidp_losses(config, group)[0],
    "pytorch DDP": train_reference(config, group)[0],
}
for name, losses in dp_curves.items():
    np.testing.assert_allclose(losses, curves["minidp numpy"], rtol=1e-10)
    print0(f"{name:13s} on {group.size} ranks: the single-process losses (to 1e-10)")

# %% [markdown]
# ## Where the time goes
#
# The same step, timed: the mean of 8 steps, in one run, the first step included; minidp's
# strategy counts its communication. No time is asserted: the lines show what this run
# measured, on a machine others share. On this CPU a torch tensor's bucket goes to MPI as a
# NumPy view of its own memory (no copy), and the torch backend pays torch's per-call
# dispatch for every small op (on this tiny model its compute is usually the slower). On a
# GPU each bucket is copied to a kept, pinned host buffer and back
# (parallel/data_parallel/host_stage.py, DDP's `host_stage` trick, on for CUDA tensors): the
# staging column counts those copies, and the arithmetic gets cheap.

# %%
timed = {}
for name, cfg in (("minidp numpy", config), ("minidp torch", replace(config, backend="torch"))):
    run = MinidpRun(replace(cfg, steps=8), group)
    start = time.perf_counter()
    for step in range(8):
        run.step(step)
    total = (time.perf_counter() - start) / 8
    ddp = run.strategy.ddp
    timed[name] = (1e3 * total, 1e3 * ddp.comm_seconds / 8, 1e3 * ddp.stage.seconds / 8)
    run.close()
backend.use("numpy")
for name, (step_ms, comm_ms, stage_ms) in timed.items():
    print0(
        f"{name:13s} DP step {step_ms:6.2f} ms | communication {comm_ms:5.2f} ms "
        f"(of which staging {stage_ms:4.2f} ms) | compute {step_ms - comm_ms:6.2f} ms"
    )
assert timed["minidp numpy"][2] == timed["minidp torch"][2] == 0  # CPU: nothing staged

# %%
plt = pyplot() if group.rank == 0 else None
if plt is not None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, losses in {**curves, **dp_curves}.items():
        left.plot(losses, label=name, linestyle="--" if "DP" in name else "-")
    left.set(xlabel="step", ylabel="training loss", title="five runs, one curve")
    left.legend()
    names = list(timed)
    right.barh(names, [timed[n][0] - timed[n][1] for n in names], label="compute")
    right.barh(names, [timed[n][1] for n in names], left=[timed[n][0] - timed[n][1] for n in names],
               label="communication (incl. staging)")  # fmt: skip
    right.set(xlabel="ms per DP step", title="where the time goes")
    right.legend()
    fig.tight_layout()
    save(fig, os.path.join(tempfile.gettempdir(), "minidp_13_torch_comparison.png"))
