"""The compressors over real ranks, in one launch at 3 (a size that is not a power of two,
whose chunks are uneven): every rank gets the same bits, and they are Σ_w C(Δ_w); training
leaves identical parameters on every rank; the bytes on the wire are what the arithmetic
says; resuming is exact; `--compress none` is the uncompressed path bit for bit."""

from dataclasses import replace

import numpy as np
import pytest
from test_strategy import run as steps  # one step per index, lr 1e-2: the global losses

from minidp import comm
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.models.tasks import Task
from minidp.parallel.compression.sparse import kept
from minidp.parallel.compression.table import COMPRESSORS, make_compressor
from minidp.parallel.data_parallel.comm_thread import allreduce_hook

SPECS = ["fp16", "bf16", "topk:0.05", "randomk:0.05", "sign", "sign-noef", "qsgd:3", "powersgd:2"]
TINY_GPT = dict(
    model="gpt", n_layer=1, n_embd=16, n_head=2, block_size=8, batch_size=6, seed=3,
    dtype="float64", bucket_mb=0.01, overlap="on", sample_tokens=0, eval_batches=1,
    log_every=100,
)  # fmt: skip


def params(strategy: DataParallel) -> np.ndarray:
    return np.concatenate([p.data.ravel() for p in strategy.task.model.parameters()])


def check_one_bucket(spec: str, group: comm.Group) -> None:
    """Two rounds on different per-rank gradients: identical bits on every rank, equal to
    the sum of what each rank sent (C(Δ_w) = Δ_w - e_w)."""
    rng = np.random.default_rng(group.rank)
    compressor, shapes = make_compressor(spec, seed=11), [(9, 7), (5,)]
    for _ in range(2):
        g = rng.standard_normal(68)
        delta = g + compressor.residuals.get(0, 0)
        out = g.copy()
        compressor.reduce(out, 0, group, shapes)
        every = comm.allgather(out, group=group)
        assert (every == every[0]).all(), f"{spec}: ranks disagree"
        mine = delta - compressor.residuals[0] if compressor.error_feedback else None
        if mine is not None:
            np.testing.assert_allclose(comm.allreduce(mine, group=group), out, atol=1e-12)
        truth = comm.allreduce(g if mine is None else delta, group=group)
        rtol = {"fp16": 2e-3, "bf16": 1e-2}.get(spec)
        if rtol:  # the casts: each value and the sum rounded once to 16 bits
            assert np.linalg.norm(out - truth) < rtol * np.linalg.norm(truth), spec


@pytest.mark.parallel(nprocs=[3])
@pytest.mark.timeout(240)
def test_compressed_training_across_ranks():
    group, p = comm.world(), comm.world().size
    assert {s.split(":")[0] for s in SPECS} == set(COMPRESSORS)
    for spec in SPECS:
        check_one_bucket(spec, group)

    # every compressor trains, and every rank ends with the same parameters
    base = TrainConfig(**TINY_GPT)
    for spec in SPECS:
        config = replace(base, compress=spec)
        with DataParallel(Task(config, np.float64), config, group) as strategy:
            losses = steps(strategy, range(3))
            assert np.isfinite(losses).all()
            assert strategy.max_param_diff() == 0.0, spec

    # top-k's counted bytes: (p - 1)·k·(4 + 8) per bucket, allgathered (int32 + float64)
    final = train(replace(base, compress="topk:0.05", steps=2))
    with DataParallel(Task(base, np.float64), base, group) as plain:
        sizes = [b.data.size for b in plain.ddp.buckets]
    assert final["grad_bytes_sent"] == sum((p - 1) * kept(n, 0.05) * 12 for n in sizes)
    baseline = sum(2 * (p - 1) / p * 8 * n for n in sizes)
    assert final["compression_ratio"] == pytest.approx(baseline / final["grad_bytes_sent"])
    assert final["residual_norm"] > 0 and 0 < final["compression_error"] < 1

    # resuming: residuals, round counters and the warm start travel in the state
    for spec in ("powersgd:1", "topk:0.05"):
        config = replace(base, compress=spec)
        with DataParallel(Task(config, np.float64), config, group) as straight:
            want_losses, want = steps(straight, range(4)), params(straight)
        with DataParallel(Task(config, np.float64), config, group) as first:
            losses, state = steps(first, range(2)), first.state_dict()
        with DataParallel(Task(config, np.float64), config, group) as second:
            second.load_state_dict(state)
            losses += steps(second, range(2, 4))
            np.testing.assert_array_equal(params(second), want)
        assert losses == want_losses

    # --compress none: no hook but DDP's own allreduce, the same bits as never asking
    config = replace(base, compress="none")
    with DataParallel(Task(config, np.float64), config, group) as none:
        assert none.compressor is None and none.ddp.reducer.hook.__name__ == "allreduce_bucket"
        got_losses, got = steps(none, range(3)), params(none)
    with DataParallel(Task(base, np.float64), base, group) as plain:
        plain.ddp.register_comm_hook(allreduce_hook(base.allreduce))
        assert steps(plain, range(3)) == got_losses
        np.testing.assert_array_equal(params(plain), got)
