"""Magnitude pruning in one process (minidp/models/prune/magnitude.py): the masks keep
exactly the largest magnitudes (as torch.nn.utils.prune computes them), the cubic schedule,
masked weights that stay exactly zero through AdamW, resuming with the masks, and one clear
line per bad flag.
"""

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from minidp import Tensor, comm, nn, optim
from minidp.cli.commands import parse_train_args
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.models.data import DistributedSampler
from minidp.models.prune.magnitude import (
    MagnitudePruner,
    cubic_sparsity,
    is_pruning_step,
    magnitude_masks,
    prunable,
)
from minidp.models.tasks import Task

SHAPES = [(6, 5), (4, 7), (3, 3)]


def random_weights(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in SHAPES]


@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.75])
def test_the_mask_keeps_exactly_the_largest_magnitudes(scope, sparsity):
    weights = random_weights()
    masks = magnitude_masks(weights, sparsity, scope)
    groups = [(w, m) for w, m in zip(weights, masks)] if scope == "layer" else None
    if scope == "global":
        groups = [(np.concatenate([w.ravel() for w in weights]),
                   np.concatenate([m.ravel() for m in masks]))]  # fmt: skip
    for w, m in groups:
        assert (~m).sum() == round(sparsity * w.size)
        if 0 < (~m).sum() < w.size:
            assert np.abs(w[m]).min() > np.abs(w[~m]).max()


@pytest.mark.torch
@pytest.mark.parametrize("scope", ["layer", "global"])
def test_the_masks_are_torch_prunes(scope):
    import torch
    from torch.nn.utils import prune

    weights = random_weights(1)
    layers = [torch.nn.Linear(s[1], s[0], bias=False).double() for s in SHAPES]
    for layer, w in zip(layers, weights):
        layer.weight.data = torch.from_numpy(w.copy())
    if scope == "layer":
        for layer in layers:
            prune.l1_unstructured(layer, "weight", amount=0.6)
    else:
        targets = [(layer, "weight") for layer in layers]
        prune.global_unstructured(targets, prune.L1Unstructured, amount=0.6)
    for layer, mask in zip(layers, magnitude_masks(weights, 0.6, scope)):
        np.testing.assert_array_equal(layer.weight_mask.numpy().astype(bool), mask)


def test_ties_go_by_position_and_pruned_weights_stay_pruned():
    assert magnitude_masks([np.ones((2, 3))], 0.5)[0].ravel().tolist() == [0, 0, 0, 1, 1, 1]
    weights = random_weights(2)
    first = magnitude_masks(weights, 0.3)
    grown = [np.where(m, w, 100.0) for w, m in zip(weights, first)]  # pruned ones now huge
    second = magnitude_masks(grown, 0.6, masks=first)
    for a, b in zip(first, second):
        assert not (b & ~a).any(), "a pruned weight came back"
    assert 1 - sum(m.sum() for m in second) / sum(m.size for m in second) == pytest.approx(
        0.6, abs=0.01
    )


def test_the_cubic_schedule_of_zhu_and_gupta():
    target, start, end = 0.9, 10, 20
    assert cubic_sparsity(9, target, start, end) == 0.0
    assert cubic_sparsity(10, target, start, end) == 0.0
    assert cubic_sparsity(15, target, start, end) == pytest.approx(0.9 * (1 - 0.5**3))
    assert cubic_sparsity(20, target, start, end) == target == cubic_sparsity(99, 0.9, 10, 20)
    ramp = [cubic_sparsity(t, target, start, end) for t in range(25)]
    assert ramp == sorted(ramp)
    assert [t for t in range(30) if is_pruning_step(t, 2, 10, 3)] == [2, 5, 8, 10]
    assert cubic_sparsity(5, 0.5, 5, 5) == 0.5  # start == end: one-shot pruning


def test_masked_weights_stay_zero_through_adamw_steps():
    """AdamW's moments remember the pruned weights' past gradients, and weight decay acts on
    every weight: only zeroed moments and gradients keep a pruned weight at exactly 0."""
    rng = np.random.default_rng(0)
    model = nn.MLP([8, 16, 4], rng=rng, dtype=np.float64)
    opt = optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    x, y = Tensor(rng.standard_normal((32, 8))), rng.integers(0, 4, 32)

    def step(pruner=None):
        opt.zero_grad()
        nn.cross_entropy(model(x), y).backward()
        if pruner is not None:
            pruner.mask_grads()
        optim.clip_grad_norm(model.parameters(), 0.5)
        opt.step()

    for _ in range(3):
        step()  # the moments fill up
    pruner = MagnitudePruner(model, opt, target=0.7, start=0, end=0)
    assert pruner.begin_step()
    assert [name for name, _ in prunable(model)] == ["layers.0.weight", "layers.1.weight"]
    before = [p.data.copy() for p in pruner.params]
    for _ in range(4):
        step(pruner)
    for p, mask, old in zip(pruner.params, pruner.masks, before):
        assert (p.data[~mask] == 0).all()
        assert (p.data[mask] != old[mask]).all()  # the rest trains on
    assert pruner.sparsity() == pytest.approx(0.7, abs=0.01)


TINY_GPT = dict(
    model="gpt", n_layer=1, n_embd=16, n_head=2, block_size=8, seed=3, batch_size=6,
    dtype="float64", bucket_mb=0.002, steps=8, prune=0.8, prune_start=1, prune_end=4,
    prune_every=1,
)  # fmt: skip


def train_steps(strategy, steps):
    task, config = strategy.task, strategy.config
    sampler = DistributedSampler(task.num_examples, config.batch_size, seed=config.seed)
    return [strategy.step(sampler.local_indices(s), 1e-2).loss for s in steps]


def test_the_masks_are_state_and_resume_training_exactly():
    config, group = TrainConfig(**TINY_GPT), comm.world()
    with DataParallel(Task(config, np.float64), config, group) as straight:
        want = train_steps(straight, range(6))
        want_params = [p.data.copy() for p in straight.task.model.parameters()]
    with DataParallel(Task(config, np.float64), config, group) as first:
        got = train_steps(first, range(3))
        state = first.state_dict()
    assert set(state["prune"]["masks"]) == {n for n, _ in prunable(first.task.model)}
    with DataParallel(Task(config, np.float64), config, group) as second:
        second.load_state_dict(state)
        got += train_steps(second, range(3, 6))
        assert second.record()["prune_sparsity"] == pytest.approx(0.8, abs=1e-3)
        got_params = [p.data.copy() for p in second.task.model.parameters()]
    assert got == want
    for a, b in zip(got_params, want_params):
        np.testing.assert_array_equal(a, b)


BAD = [
    (dict(prune=1.0), "--prune must be in [0, 1)"),
    (dict(prune=-0.1), "--prune must be in [0, 1)"),
    (dict(prune=float("nan")), "--prune must be in [0, 1)"),
    (dict(prune=0.5, prune_start=30, prune_end=20), "bad pruning schedule"),
    (dict(prune=0.5, prune_every=0), "--prune-every must be >= 1"),
    (dict(prune=0.5, steps=100, prune_end=100), "--prune-end 100 is past the last step"),
    (dict(prune_every=5), "--prune-every shape the schedule of --prune SPARSITY"),
    (dict(prune=0.5, strategy="ps"), "--prune is a flag of --strategy dp"),
]


@pytest.mark.parametrize("fields, message", BAD, ids=[m for _, m in BAD])
def test_bad_pruning_flags_are_one_clear_line(fields, message):
    with pytest.raises(BadConfig, match=re.escape(message)):
        TrainConfig(**fields).validate()


def test_pruning_with_compression_is_refused_until_it_is_supported():
    config = TrainConfig(prune=0.5)
    config.compress = "topk:0.01"  # the field gradient compression brings
    with pytest.raises(
        BadConfig,
        match=re.escape("--prune together with --compress (or --compress-on update) is not yet"),
    ):
        config.validate()
    replace(TrainConfig(prune=0.5)).validate()  # without it: fine


def test_the_command_line_says_it_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_train_args(["--prune", "1.5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prune must be in [0, 1), got 1.5" in err
    config = parse_train_args(["--prune", "0.9", "--prune-scope", "layer"])
    assert (config.prune, config.prune_scope) == (0.9, "layer")


def test_bench_prune_smoke(tmp_path, capsys):
    from minidp_bench import prune as bench

    out = tmp_path / "rows.json"
    tiny = "--steps 6 --sparsities 0,0.5 --widths 16,8 --n-layer 1 --block-size 8 --batch-size 4"
    argv = [*tiny.split(), "--out", str(tmp_path), "--json", str(out)]
    assert bench.main(argv) == 0
    rows = [json.loads(line) for line in open(out)]
    assert [(r["width"], r["sparsity"]) for r in rows] == [(16, 0), (16, 0.5), (8, 0), (8, 0.5)]
    for dense, pruned in (rows[:2], rows[2:]):
        assert pruned["nonzero_weights"] == dense["nonzero_weights"] // 2
        assert np.isfinite(pruned["val_loss"]) and pruned["step_ms"] > 0
    assert "val_vs_dense" in capsys.readouterr().out
    assert (tmp_path / "prune_loss_vs_sparsity.png").stat().st_size > 0


def test_the_pruner_needs_no_mpi():
    """minidp/models/prune/magnitude.py sits below the comm layer (test_layering.py)."""
    from test_layering import BLOCK_MPI4PY, python

    result = python(BLOCK_MPI4PY + "import minidp.models.prune.magnitude\n")
    assert result.returncode == 0, result.stderr
