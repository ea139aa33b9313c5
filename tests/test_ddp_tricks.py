"""DDP's plain version and its speed tricks: the plain version trains like one process, and
every trick (data_parallel.TRICKS) gives, bit for bit, the gradients and parameters of the
path without it, after a few steps with uneven slices, overlap on and off. They compare
with algo "shm" (the one the arena serves): with "auto", the arena is what makes auto pick
shm (the ring's bits) where plain buckets would go by size (maybe another algorithm's bits).
"""

from dataclasses import replace

import numpy as np
import pytest

from minidp import Tensor, comm, nn, optim
from minidp.comm import auto
from minidp.parallel import DistributedDataParallel
from minidp.parallel.data_parallel import ddp as dp
from minidp.parallel.data_parallel.plain import SimpleDistributedDataParallel

STEPS = 3
SIZES = [12, 40, 40, 40, 5]  # float32; a tiny bucket cap below cuts it into several buckets


def make_model():
    return nn.MLP(SIZES, rng=np.random.default_rng(1), dtype=np.float32)


def batch(step: int, n: int):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((n, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], n)


def slice_of(step: int, group):
    """This rank's rows of a global batch of 2p + 1 (uneven: rank 0 has one more)."""
    x, y = batch(step, 2 * group.size + 1)
    bounds = comm.chunk_bounds(len(x), group.size)
    lo, hi = bounds[group.rank], bounds[group.rank + 1]
    return x[lo:hi], y[lo:hi], len(x)


def train(group, overlap: bool, algo: str = "auto", **tricks) -> tuple[list, list, dict]:
    """STEPS SGD steps of DDP with `tricks`: (every step's gradients, final parameters, the
    facts that show the tricks ran)."""
    model = make_model()
    ddp = DistributedDataParallel(
        model, group, bucket_cap_mb=0.004, algo=algo, overlap=overlap, tricks=tricks
    )
    opt = optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    grads, facts = [], {"buckets": len(ddp.buckets), "arena": ddp.arena is not None}
    ddp.comm_group.reset_counters()
    for step in range(STEPS):
        x, y, total = slice_of(step, group)
        ddp.set_batch_share(len(x), total)
        ddp.zero_grad()
        nn.cross_entropy(ddp(Tensor(x)), y).backward()
        facts["switch_interval"] = _switch_interval()
        ddp.finish_gradient_sync()
        grads.append([p.grad.copy() for p in model.parameters()])
        opt.step()
    facts["calls"] = ddp.comm_group.counters["allreduce"]["calls"]
    ddp.close()
    return grads, [p.data.copy() for p in model.parameters()], facts


def _switch_interval() -> float:
    import sys

    return sys.getswitchinterval()


def assert_bit_equal(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, list):
            assert_bit_equal(x, y)
        else:
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.timeout(120)
def test_the_plain_version_averages_like_one_process():
    """One allreduce(avg) per parameter after backward: one process's gradients on the
    whole batch (equal slices), and its steps."""
    group = comm.world()
    model, single = make_model(), make_model()
    ddp = SimpleDistributedDataParallel(model, group)
    opt, opt_single = optim.SGD(ddp.parameters(), lr=0.1), optim.SGD(single.parameters(), lr=0.1)
    group.reset_counters()
    for step in range(STEPS):
        x, y = batch(step, 4 * group.size)
        mine = slice(4 * group.rank, 4 * group.rank + 4)
        for p in model.parameters():
            p.grad = None
        nn.cross_entropy(ddp(Tensor(x[mine])), y[mine]).backward()
        ddp.finish_gradient_sync()
        opt_single.zero_grad()
        nn.cross_entropy(single(Tensor(x)), y).backward()
        for p, q in zip(model.parameters(), single.parameters(), strict=True):
            np.testing.assert_allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        opt.step()
        opt_single.step()
    n = len(list(model.parameters()))
    assert group.counters["allreduce"]["calls"] == STEPS * n  # one per parameter per step
    for p, q in zip(model.parameters(), single.parameters(), strict=True):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-5, atol=1e-6)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(300)
def test_each_trick_gives_the_bits_of_the_path_without_it():
    group = comm.world()
    for overlap in (False, True):
        on = train(group, overlap, "shm")  # every trick on, as by default
        for trick in ("shared_memory", "coalesce", "quick_gil"):
            off = train(group, overlap, "shm", **{trick: False})
            assert_bit_equal(on[0], off[0])  # every step's averaged gradients
            assert_bit_equal(on[1], off[1])  # the parameters after the last step
            assert off[2]["buckets"] > 1
        plain = train(group, overlap, "shm", shared_memory=False, coalesce=False, quick_gil=False)
        assert_bit_equal(on[0], plain[0])
        assert_bit_equal(on[1], plain[1])


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_each_trick_runs_when_on_and_not_when_off(monkeypatch):
    import sys

    monkeypatch.setattr(auto, "SHM_MIN", 0)  # the tiny buckets reduced by shm, as large ones
    group, before = comm.world(), sys.getswitchinterval()
    on, off = train(group, False)[2], train(group, False, shared_memory=False)[2]
    assert on["arena"] and not off["arena"]  # algo auto, one machine: buckets in an arena
    on, off = train(group, False)[2], train(group, False, coalesce=False)[2]
    assert on["calls"] == STEPS < off["calls"] == STEPS * on["buckets"]  # one call per sync
    on, off = train(group, True)[2], train(group, True, quick_gil=False)[2]
    assert on["switch_interval"] < before == off["switch_interval"]
    assert sys.getswitchinterval() == before


def test_an_unknown_trick_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown tricks \\['fast'\\]"):
        DistributedDataParallel(make_model(), comm.world(), tricks={"fast": True})


@pytest.mark.torch
@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(300)
def test_host_staging_gives_the_bits_of_plain_staging(monkeypatch):
    """--backend torch, overlap and micro-batches: the same losses and parameters, bit for
    bit, with DDP's host buffers (HostStage) and without (PlainStage: a view on the CPU)."""
    from minidp.cli.training.config import TrainConfig
    from minidp.engine import backend
    from minidp_bench.torch_train import minidp_losses

    config = TrainConfig(
        n_layer=1, n_embd=16, n_head=2, block_size=8, seed=5, batch_size=5, lr=1e-2,
        threads=1, steps=4, bucket_mb=0.01, dtype="float32", backend="torch", overlap="on",
        grad_accum=2,
    )  # fmt: skip
    runs = {}
    for staged in (True, False):
        monkeypatch.setitem(dp.TRICKS, "host_stage", staged)
        losses, run = minidp_losses(replace(config), comm.world())
        params = [backend.to_numpy(p.data).copy() for p in run.strategy.ddp.parameters()]
        runs[staged] = (losses, params, run.strategy.record().get("stage_copies", 0))
    backend.use("numpy")
    assert runs[True][0] == runs[False][0]
    assert_bit_equal(runs[True][1], runs[False][1])
    assert runs[True][2] > 0 and runs[False][2] == 0  # on the CPU the plain way copies nothing
