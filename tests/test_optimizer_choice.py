"""`--optimizer adamw|momentum|sgd` (minidp/engine/optim.py, OPTIMIZERS): data parallelism with
momentum SGD is one process's momentum SGD, split (float64, 1e-10), with torch's weight
decay added to the gradient; ZeRO builds the same optimizer over its pieces; the velocity is
in the strategy's state_dict; a strategy that ignores the flag refuses it in one line."""

from dataclasses import replace

import numpy as np
import pytest
from test_strategy import TINY, params

from minidp import comm, optim
from minidp.cli.strategies import DataParallel, ZeRO
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task

STEPS, LR = 3, 0.05
BASE = TrainConfig(**{**TINY, "model": "gpt"}, grad_clip=0.0, weight_decay=0.1)


def steps(strategy) -> list[float]:
    config = strategy.config
    sampler = DistributedSampler(
        strategy.task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
    )
    return [strategy.step(sampler.local_indices(s), LR).loss for s in range(STEPS)]


def reference(config, momentum: float):
    """One process, the global batch, torch.optim.SGD's rule written out here again:
    g += wd·w; v = momentum·v + g (v = g at first); w -= lr·v."""
    task = Task(config, np.float64)
    sampler = DistributedSampler(task.num_examples, config.batch_size, seed=config.seed)
    parameters, velocity, losses = task.model.parameters(), {}, []
    for step in range(STEPS):
        for p in parameters:
            p.grad = None
        loss = task.loss(*task.batch(sampler.local_indices(step)))
        loss.backward()
        losses.append(loss.item())
        for i, p in enumerate(parameters):
            g = p.grad + config.weight_decay * p.data
            velocity[i] = momentum * velocity[i] + g if i in velocity else g
            p.data -= LR * velocity[i]
    return losses, [p.data.copy() for p in parameters]


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.timeout(200)
def test_dp_with_sgd_matches_one_process():
    group = comm.world()
    for name, momentum in (("momentum", 0.9), ("sgd", 0.0)):
        config = replace(BASE, optimizer=name)
        want_losses, want = reference(config, momentum)
        with DataParallel(Task(config, np.float64), config, group) as strategy:
            assert type(strategy.optimizer) is optim.SGD
            losses, got = steps(strategy), params(strategy)
            assert strategy.max_param_diff() == 0.0
            saved = strategy.state_dict()["optimizer"]
        np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
        for p, q in zip(got, want, strict=True):
            np.testing.assert_allclose(p, q, rtol=1e-10, atol=1e-12)
        first = next(iter(saved["state"].values()))  # by parameter name
        assert ("velocity" in first) == (name == "momentum")
        assert saved["param_groups"][0]["hyper"]["weight_decay"] == config.weight_decay


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(200)
def test_zero_builds_the_same_optimizer_over_its_pieces():
    """ZeRO stage 2 with --optimizer momentum trains as dp with it does (the same sums,
    another order of reduction: 1e-10)."""
    group = comm.world()
    config = replace(BASE, optimizer="momentum")
    with DataParallel(Task(config, np.float64), config, group) as dp:
        want_losses, want = steps(dp), params(dp)
    zero_config = replace(config, strategy="zero", zero_stage=2)
    with ZeRO(Task(zero_config, np.float64), zero_config, group) as zero:
        assert type(zero.optimizer) is optim.SGD
        assert zero.optimizer.hyper["momentum"] == optim.MOMENTUM
        losses = steps(zero)
        zero.gather_model()
        got = params(zero)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    for p, q in zip(got, want, strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-10, atol=1e-12)


def test_the_flag_is_refused_where_it_is_ignored():
    with pytest.raises(BadConfig, match="--optimizer is a flag of --strategy dp or tp or"):
        TrainConfig(strategy="ps", optimizer="momentum").validate()
    TrainConfig(strategy="ps", ps_optimizer="momentum").validate()  # ps has its own
    assert tuple(optim.OPTIMIZERS) == ("adamw", "momentum", "sgd")
    assert TrainConfig().optimizer == "adamw"
