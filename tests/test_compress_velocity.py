"""`--compress-on velocity` (parallel/compression/velocity.py), DGC's momentum correction with
momentum factor masking: one round conserves mass exactly (what was sent plus the new
residual is the old residual plus the new velocity, bit for bit) and clears the sent
coordinates in both u_w and v_w; every rank sums the same bits; uncompressed (warm-up)
rounds are momentum SGD; replicas stay identical and resuming is exact; bad combinations
are refused in one line."""

from dataclasses import replace

import numpy as np
import pytest
from test_compress_parallel import TINY_GPT, params
from test_compress_update import by_hand
from test_strategy import run as steps  # one step per index, lr 1e-2: the global losses

from minidp import comm, optim
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.models.tasks import Task
from minidp.parallel.compression.table import make_compressor
from minidp.parallel.compression.velocity import MomentumCorrectedSGD, MomentumCorrection
from minidp.parallel.data_parallel.buckets import Bucket

VELOCITY = dict(optimizer="momentum", compress_on="velocity", weight_decay=0.1)


class FlatBucket(Bucket):
    """A bucket of one flat vector, without parameters (what the hook reads: index, data)."""

    def __init__(self, data: np.ndarray):
        self.index, self.data, self.views = 0, data, [data]


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(120)
def test_one_round_conserves_mass_and_masks_what_was_sent():
    group = comm.world()
    rng = np.random.default_rng(group.rank)
    for spec in ("topk:0.1", "randomk:0.1"):
        correction = MomentumCorrection(make_compressor(spec, seed=5), momentum=0.9)
        compressor = correction.compressor
        for _ in range(3):
            x = rng.standard_normal(50)
            u_before = correction.velocity.get(0)
            u = x.copy() if u_before is None else 0.9 * u_before + x
            v = u + compressor.residuals.get(0, 0)  # v_w = v_w + u_w
            bucket = FlatBucket(x.copy())
            correction(bucket, group)
            e, sent = compressor.residuals[0], compressor.sent[0]
            mine = np.zeros_like(v)
            mine[sent] = v[sent]
            np.testing.assert_array_equal(mine + e, v)  # mass: exact
            assert len(sent) == 5 and not e[sent].any()  # v_w[S_w] = 0
            want_u = u.copy()
            want_u[sent] = 0  # u_w[S_w] = 0: momentum factor masking
            np.testing.assert_array_equal(correction.velocity[0], want_u)
            mine_everywhere = group.comm.allgather(mine)
            want_sum = np.zeros_like(v)
            for m in mine_everywhere:  # in rank order, as gather_sum adds them
                want_sum += m
            np.testing.assert_array_equal(bucket.data, want_sum)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.timeout(200)
def test_uncompressed_rounds_are_momentum_sgd():
    """With every step a --compress-warmup step, the velocity path is the gradient path's
    momentum SGD, weight decay in; clipping too on one rank, where clipping each rank's own
    gradient (DGC's local clipping, here) and clipping the global one agree."""
    group = comm.world()
    clip = 0.05 if group.size == 1 else 0.0
    base = TrainConfig(**TINY_GPT, optimizer="momentum", weight_decay=0.1, grad_clip=clip)
    with DataParallel(Task(base, np.float64), base, group) as plain:
        want_losses, want = steps(plain, range(4)), params(plain)
    config = replace(base, compress="topk:0.1", compress_warmup=4, compress_on="velocity")
    with DataParallel(Task(config, np.float64), config, group) as velocity:
        losses, got = steps(velocity, range(4)), params(velocity)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(200)
def test_velocity_training_keeps_replicas_identical_and_resumes_exactly():
    group = comm.world()
    config = TrainConfig(**TINY_GPT, **VELOCITY, compress="topk:0.05", compress_warmup=1)
    with DataParallel(Task(config, np.float64), config, group) as straight:
        steps(straight, range(4))
        want = params(straight)
        assert straight.max_param_diff() == 0.0
        record = straight.record()
        assert record["compression_ratio"] > 2 and record["residual_norm"] > 0
        assert "on the velocity" in straight.describe()
    with DataParallel(Task(config, np.float64), config, group) as first:
        steps(first, range(2))
        state = first.state_dict()
        assert set(state["velocity"]["velocity"]) == set(range(len(first.ddp.buckets)))
    with DataParallel(Task(config, np.float64), config, group) as resumed:
        resumed.load_state_dict(state)
        steps(resumed, range(2, 4))
        np.testing.assert_array_equal(params(resumed), want)


def test_bad_combinations_are_one_line():
    with pytest.raises(BadConfig, match="--compress-on velocity needs --optimizer momentum"):
        TrainConfig(compress="topk:0.01", compress_on="velocity").validate()
    for spec in ("powersgd:2", "sign", "none"):
        with pytest.raises(BadConfig, match="it needs --compress topk or randomk"):
            TrainConfig(compress=spec, optimizer="momentum", compress_on="velocity").validate()
    with pytest.raises(BadConfig, match="--compress-on is a flag of --strategy dp"):
        TrainConfig(
            strategy="hybrid", compress="topk", optimizer="momentum", compress_on="velocity"
        ).validate()
    TrainConfig(compress="randomk:0.1", optimizer="momentum", compress_on="velocity").validate()


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_velocity_pieces_on_a_users_ddp_are_the_strategy_bit_for_bit():
    """MomentumCorrection and MomentumCorrectedSGD around a DDP built by hand, with
    update.LocalGradients (parallel/compression/velocity.py's docstring loop), take the
    same steps as --compress-on velocity, bit for bit."""
    group = comm.world()
    config = replace(TrainConfig(**TINY_GPT, **VELOCITY), compress="topk:0.3")
    with DataParallel(Task(config, np.float64), config, group) as strategy:
        steps(strategy, range(3))
        want = params(strategy)
    hook = MomentumCorrection(make_compressor(config.compress, seed=config.seed), optim.MOMENTUM)

    def sgd(ddp):
        return MomentumCorrectedSGD(ddp, 1e-2, config.weight_decay)

    np.testing.assert_array_equal(by_hand(config, group, hook, sgd), want)
