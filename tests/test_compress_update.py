"""`--compress-warmup`, and `--compress-on update` (parallel/compression/update.py): each
rank's optimizer step is what the hook compresses. At one rank with no compressor that is
the gradient path's training (the step taken as θ - (θ - θ')); over ranks the replicas stay
bitwise identical and the residual holds what the compressed steps left out; the warm-up's
steps are the uncompressed path bit for bit; the flags are refused where they cannot work."""

from dataclasses import replace

import numpy as np
import pytest
from test_compress_parallel import TINY_GPT, params
from test_strategy import run as steps  # one step per index: the global losses

from minidp import comm, optim
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.parallel import DistributedDataParallel
from minidp.parallel.compression.table import make_compressor
from minidp.parallel.compression.update import CompressedUpdate, LocalGradients


def test_update_path_is_the_gradient_path_at_one_rank():
    """One rank: its own optimizer step is the shared one; grad_accum 2 and the clip in."""
    group = comm.world()
    if group.size != 1:
        pytest.skip("serial test")
    base = TrainConfig(**TINY_GPT, grad_accum=2, grad_clip=0.05)
    with DataParallel(Task(base, np.float64), base, group) as plain:
        want_losses, want = steps(plain, range(3)), params(plain)
    config = replace(base, compress_on="update")
    with DataParallel(Task(config, np.float64), config, group) as update:
        losses, got = steps(update, range(3)), params(update)
        assert update.record()["compress_on"] == "update"
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_compress_on_is_refused_where_it_cannot_work():
    with pytest.raises(BadConfig, match="--compress-on is a flag of --strategy dp"):
        TrainConfig(strategy="zero", zero_stage=1, compress_on="update").validate()
    with pytest.raises(BadConfig, match="--compress-on update"):
        TrainConfig(prune=0.5, compress_on="update").validate()
    with pytest.raises(BadConfig, match="--compress-warmup must be >= 0"):
        TrainConfig(compress="sign", compress_warmup=-1).validate()
    with pytest.raises(BadConfig, match="--compress-warmup needs --compress"):
        TrainConfig(compress_warmup=5).validate()
    with pytest.raises(BadConfig, match="--compress with --zero-stage 1: the compressors"):
        TrainConfig(strategy="hybrid", zero_stage=1, compress="topk").validate()  # not ignored


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_update_compression_across_ranks():
    group = comm.world()
    base = replace(TrainConfig(**TINY_GPT), compress_on="update")
    # sign on the step: identical replicas, a residual kept, the compressed bytes sent
    config = replace(base, compress="sign")
    with DataParallel(Task(config, np.float64), config, group) as strategy:
        before = params(strategy)
        assert np.isfinite(steps(strategy, range(3))).all()
        assert strategy.max_param_diff() == 0.0
        record = strategy.record()
        assert record["residual_norm"] > 0 and record["compression_ratio"] > 20
        assert not np.array_equal(params(strategy), before)
    # top-k at density 1 sends every value: the same step as the plain allreduce of steps
    runs = {}
    for spec in ("none", "topk:1"):
        config = replace(base, compress=spec)
        with DataParallel(Task(config, np.float64), config, group) as strategy:
            runs[spec] = (steps(strategy, range(3)), params(strategy))
    np.testing.assert_allclose(runs["topk:1"][1], runs["none"][1], rtol=1e-12, atol=1e-14)
    # --compress-warmup: its steps are the plain allreduce bit for bit, then compression
    plain = replace(TrainConfig(**TINY_GPT), compress="none")
    with DataParallel(Task(plain, np.float64), plain, group) as strategy:
        want_losses, want = steps(strategy, range(2)), params(strategy)
    config = replace(plain, compress="topk:0.05", compress_warmup=2)
    with DataParallel(Task(config, np.float64), config, group) as strategy:
        assert steps(strategy, range(2)) == want_losses
        np.testing.assert_array_equal(params(strategy), want)
        assert not strategy.compressor.residuals  # nothing compressed yet
        steps(strategy, range(2, 3))
        assert strategy.compressor.residual_norm() > 0 and strategy.max_param_diff() == 0.0


def by_hand(config, group, hook, make_optimizer, frozen=()) -> np.ndarray:
    """Three steps of the placements' docstring loop on a DDP built by hand, with `hook`
    and the optimizer `make_optimizer(ddp)` (lr 1e-2, as steps()), the parameters named in
    `frozen` frozen first; the parameters, flat."""
    task = Task(config, np.float64)
    model = task.model
    for name, p in model.named_parameters():
        p.requires_grad = name not in frozen
    ddp = DistributedDataParallel(model, group, bucket_cap_mb=config.bucket_mb, overlap=True)
    ddp.register_comm_hook(hook)
    sync, opt = LocalGradients(ddp), make_optimizer(ddp)
    sampler = DistributedSampler(
        task.num_examples, config.batch_size, group.rank, group.size, seed=config.seed
    )
    with ddp:
        for step in range(3):
            local = sampler.local_indices(step)
            sync.zero_grad()
            sync.set_batch_share(len(local), config.batch_size)
            with sync.no_sync():  # this rank's own gradient, unreduced
                task.loss(*task.batch(local)).backward()
            optim.clip_grad_norm(model.parameters(), config.grad_clip)  # local clipping
            opt.step()
    return np.concatenate([p.data.ravel() for p in model.parameters()])


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_update_pieces_on_a_users_ddp_are_the_strategy_bit_for_bit():
    """LocalGradients and CompressedUpdate around a DDP built by hand
    (parallel/compression/update.py's docstring loop) take the same steps as --compress-on update,
    bit for bit."""
    group = comm.world()
    config = replace(TrainConfig(**TINY_GPT), compress="topk:0.3", compress_on="update")
    with DataParallel(Task(config, np.float64), config, group) as strategy:
        steps(strategy, range(3))
        want = params(strategy)

    def adamw(ddp):
        inner = optim.make_optimizer(config.optimizer, ddp.parameters(), 1e-2, config.weight_decay)
        return CompressedUpdate(inner, ddp)

    hook = make_compressor(config.compress, seed=config.seed)
    np.testing.assert_array_equal(by_hand(config, group, hook, adamw), want)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_both_placements_leave_a_frozen_parameter_alone():
    """A user's model with a frozen parameter: CompressedUpdate and MomentumCorrectedSGD step
    the rest, never the frozen one (it has no .grad), and the replicas stay identical."""
    from minidp.parallel.compression.velocity import MomentumCorrectedSGD, MomentumCorrection

    group = comm.world()
    config = replace(TrainConfig(**TINY_GPT), compress="topk:0.3")
    named = list(Task(config, np.float64).model.named_parameters())
    start = np.concatenate([p.data.ravel() for _, p in named])
    frozen = ("wpe.weight",)
    i = [name for name, _ in named].index(frozen[0])
    lo, n = sum(p.size for _, p in named[:i]), named[i][1].size

    def update(ddp):
        inner = optim.make_optimizer(config.optimizer, ddp.parameters(), 1e-2, 0.1)
        return CompressedUpdate(inner, ddp)

    def velocity(ddp):
        return MomentumCorrectedSGD(ddp, 1e-2, weight_decay=0.1)

    for make, hook in (
        (update, make_compressor(config.compress, seed=config.seed)),
        (velocity, MomentumCorrection(make_compressor(config.compress, seed=1), 0.9)),
    ):
        got = by_hand(config, group, hook, make, frozen=frozen)
        np.testing.assert_array_equal(got[lo : lo + n], start[lo : lo + n])  # never moved
        assert not np.array_equal(got, start)  # the rest trained
        every = comm.allgather(got, group=group).reshape(group.size, -1)
        assert (every == every[0]).all()
