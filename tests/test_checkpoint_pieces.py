"""Checkpoints of the pieces on a user's model reshard: a model with a tied weight and a
frozen bias, trained 3 steps on 4 ranks under one wrapping, saved with
checkpoint.get_state_dict, loaded in place on 2 ranks under another (checkpoint.load,
set_state_dict) and trained 3 more, ends where 6 steps of one process end (float64,
1e-9): DDP, FSDP ("full" and "grad_op"), ZeRO-1 + DDP, FSDP -> DDP, DDP -> FSDP; a TP MLP
over 2 ranks -> 1; a pipeline of 4 stages -> 2. ZeroRedundancyOptimizer's
consolidate_state_dict gathers the whole state on one rank.
"""

import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel import (
    ColumnParallelLinear,
    DistributedDataParallel,
    FullyShardedDataParallel,
    PipelineStage,
    RowParallelLinear,
    ZeroRedundancyOptimizer,
    build_schedule,
    checkpoint,
    run_schedule,
    split_batch,
)
from minidp.parallel.pipeline.split import RankStages
from minidp.tools.chunks import chunk_range

BATCH, SAVED, STEPS = 8, 3, 6
ADAMW = dict(lr=0.02, weight_decay=0.1)


class Net(nn.Module):
    """A user's MLP: fc3 reuses fc2's weight (tied), fc2's bias is frozen."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.fc1, self.fc2, self.fc3, self.fc4 = (
            nn.Linear(a, b, rng=rng, dtype=np.float64) for a, b in ((6, 9), (9, 9), (9, 9), (9, 4))
        )
        self.fc3.weight = self.fc2.weight
        self.fc2.bias.requires_grad = False

    def forward(self, x):
        h = self.fc3(self.fc2(self.fc1(x, relu=True), relu=True), relu=True)
        return self.fc4(h)


def batch(step: int):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((BATCH, 6)), rng.integers(0, 4, BATCH)


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def one_process(model, opt, steps):
    """One process, the whole batch of each step."""
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        cross_entropy(model(Tensor(x)), y).backward()
        opt.step()
    return model


def reference() -> dict:
    """One process, STEPS steps: the parameters by name."""
    model = Net()
    return one_process(model, optim.AdamW(trainable(model), **ADAMW), range(STEPS)).state_dict()


def wrap(kind: str, model, group):
    """(the wrapper to train and checkpoint, its optimizer, {name: whole array} after)."""
    if kind == "ddp":
        ddp = DistributedDataParallel(model, group)
        return ddp, optim.AdamW(trainable(model), **ADAMW), model.state_dict
    if kind == "zero1":
        ddp = DistributedDataParallel(model, group)
        opt = ZeroRedundancyOptimizer(trainable(model), optim.AdamW, group, **ADAMW)
        return ddp, opt, model.state_dict
    fsdp = FullyShardedDataParallel(model, group, sharding=kind)
    return fsdp, optim.AdamW(fsdp.parameters(), **ADAMW), fsdp.full_state_dict


def train(wrapper, opt, group, steps) -> None:
    for step in steps:
        x, y = batch(step)
        lo, hi = chunk_range(BATCH, group.size, group.rank)
        wrapper.set_batch_share(hi - lo, BATCH)
        if hasattr(opt, "zero_grad"):
            opt.zero_grad()
        cross_entropy(wrapper(Tensor(x[lo:hi])), y[lo:hi]).backward()
        wrapper.finish_gradient_sync()
        opt.step()


def folder_on(group, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pieces")) if group.rank == 0 else ""
    return comm.broadcast_text(path, root=0, group=group)


@pytest.mark.parallel(nprocs=[4])
@pytest.mark.parametrize(
    "saved, loaded",
    [("grad_op", "grad_op"), ("zero1", "zero1"), ("full", "ddp"), ("ddp", "full")],
)  # fmt: skip
def test_saved_on_4_ranks_loaded_on_2_equals_one_process(saved, loaded, tmp_path_factory):
    world, want = comm.world(), reference()
    path = folder_on(world, tmp_path_factory) + "/step_3"
    wrapper, opt, _ = wrap(saved, Net(), world)
    train(wrapper, opt, world, range(SAVED))
    model_sd, optim_sd = checkpoint.get_state_dict(wrapper, opt)
    checkpoint.save({"model": model_sd, "optim": optim_sd}, path, world, step=SAVED)
    wrapper.close()
    half = world.split(0 if world.rank < 2 else None)
    if half is None:
        return
    wrapper, opt, whole = wrap(loaded, Net(seed=7), half)  # other weights: all must load
    model_sd, optim_sd = checkpoint.get_state_dict(wrapper, opt)
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.load(state, path, half)
    checkpoint.set_state_dict(
        wrapper, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    train(wrapper, opt, half, range(SAVED, STEPS))
    got = whole()
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
    wrapper.close()


@pytest.mark.parallel(nprocs=[2])
def test_a_zero_optimizers_consolidated_state_is_one_processes():
    """consolidate_state_dict(to=0): rank 0's state_dict() is the whole AdamW state, equal
    to one process's (the parameters' order); loaded back, each rank keeps its chunk."""
    group = comm.world()
    model = Net()
    zero = ZeroRedundancyOptimizer(trainable(model), optim.AdamW, group, **ADAMW)
    train(DistributedDataParallel(model, group), zero, group, range(SAVED))
    alone = Net()
    plain = optim.AdamW(trainable(alone), **ADAMW)
    one_process(alone, plain, range(SAVED))
    mine = [{k: np.array(v) for k, v in state.items()} for state in zero.optimizer.state]
    zero.consolidate_state_dict(to=0)
    if group.rank == 0:
        whole = zero.state_dict()
        assert sorted(whole["whole"]) == list(range(len(plain.params)))
        for i, state in whole["whole"].items():
            for key, value in state.items():
                np.testing.assert_allclose(value, plain.state[i][key], rtol=1e-10, err_msg=key)
        zero.load_state_dict(whole)  # loaded back: this rank keeps its chunk of it
        for state, kept in zip(zero.optimizer.state, mine):
            for key, value in kept.items():
                np.testing.assert_array_equal(state[key], value, err_msg=key)
    else:
        assert "whole" not in zero.state_dict()


class Mlp(nn.Module):
    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.fc1 = nn.Linear(6, 12, rng=rng, dtype=np.float64)
        self.fc2 = nn.Linear(12, 4, rng=rng, dtype=np.float64)

    def forward(self, x):
        return self.fc2(self.fc1(x, relu=True))


class TPMlp(nn.Module):
    """The user's Mlp cut over a TP group: fc1 by columns, fc2 by rows."""

    def __init__(self, whole: Mlp, group):
        self.fc1 = ColumnParallelLinear(whole.fc1, group)
        self.fc2 = RowParallelLinear(whole.fc2, group)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def mlp_reference() -> dict:
    model = Mlp()
    return one_process(model, optim.AdamW(model.parameters(), **ADAMW), range(STEPS)).state_dict()


@pytest.mark.parallel(nprocs=[2])
def test_tensor_parallel_on_2_ranks_loads_into_one_process(tmp_path_factory):
    world, want = comm.world(), mlp_reference()
    path = folder_on(world, tmp_path_factory) + "/step_3"
    tp = TPMlp(Mlp(), world)
    opt = optim.AdamW(tp.parameters(), **ADAMW)
    one_process(tp, opt, range(SAVED))  # TP: every rank of the group on the whole batch
    model_sd, optim_sd = checkpoint.get_state_dict(tp, opt)
    assert isinstance(model_sd["fc1.weight"], checkpoint.Sharded), "a TP weight is a slice"
    checkpoint.save({"model": model_sd, "optim": optim_sd}, path, world, step=SAVED)
    alone = world.split(0 if world.rank == 0 else None)
    if alone is None:
        return
    model = Mlp(seed=7)
    opt = optim.AdamW(model.parameters(), **ADAMW)
    model_sd, optim_sd = checkpoint.get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.load(state, path, alone)
    checkpoint.set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    one_process(model, opt, range(SAVED, STEPS))
    for name, value in want.items():
        np.testing.assert_allclose(model.state_dict()[name], value, rtol=1e-9, err_msg=name)


def deep(seed: int = 0) -> nn.MLP:
    return nn.MLP([6, 8, 8, 8, 4], rng=np.random.default_rng(seed), dtype=np.float64)


def pipeline_steps(parts_here, stages, schedule, opt, steps) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        micro_in, micro_t, shares = split_batch(x, y, schedule.micro_batches)
        run_schedule(schedule, stages, micro_in, micro_t, shares)
        opt.step()


@pytest.mark.parallel(nprocs=[4])
def test_a_pipeline_of_4_stages_loads_into_2(tmp_path_factory):
    from minidp.parallel import split_model

    world = comm.world()
    path = folder_on(world, tmp_path_factory) + "/step_3"
    ref = deep()
    plain = optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(STEPS):
        x, y = batch(step)
        plain.zero_grad()
        cross_entropy(ref(Tensor(x)), y).backward()
        plain.step()
    runs = ((world, range(SAVED), 0, "1f1b", 1), (None, range(SAVED, STEPS), 7, "interleaved", 2))
    for group, steps, seed, name, virtual in runs:
        if group is None:
            group = world.split(0 if world.rank < 2 else None)
            if group is None:
                return
        schedule = build_schedule(name, group.size, 4, virtual)
        parts = split_model(deep(seed), 4)
        mine = schedule.stages_of(group.rank)
        stages = {s: PipelineStage(parts[s], s, 4, group) for s in mine}
        here = RankStages([parts[s] for s in mine])
        opt = optim.AdamW(here.parameters(), **ADAMW)
        model_sd, optim_sd = checkpoint.get_state_dict(here, opt)
        state = {"model": model_sd, "optim": optim_sd}
        if steps.start:  # the second half: load first
            checkpoint.load(state, path, group)
            checkpoint.set_state_dict(
                here, opt, model_state_dict=model_sd, optim_state_dict=optim_sd
            )
        pipeline_steps(here, stages, schedule, opt, steps)
        if not steps.start:
            model_sd, optim_sd = checkpoint.get_state_dict(here, opt)
            checkpoint.save({"model": model_sd, "optim": optim_sd}, path, group, step=SAVED)
    want = ref.state_dict()
    for name, p in here.named_parameters():
        np.testing.assert_allclose(p.data, want[name], rtol=1e-9, err_msg=name)
