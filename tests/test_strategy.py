"""The strategy protocol, as the training loop drives it, on its first implementation ("dp"):
resuming from state_dict, the memory report, bytes by axis, the communication hook, the
overlap default, the step meter, and who writes when train() runs on a sub-group."""

import gc
import json
import sys
import threading
from dataclasses import replace

import numpy as np
import pytest

from minidp import comm, optim
from minidp.cli.commands import train_parser
from minidp.cli.strategies import STRATEGIES, DataParallel, Strategy
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.parallel import DistributedDataParallel
from minidp.parallel.data_parallel import ddp as dp_module
from minidp.parallel.data_parallel.comm_thread import allreduce_hook
from minidp.tools.meter import StepMeter

TINY = dict(
    model="mlp", n_layer=1, n_embd=16, n_head=2, block_size=8, hidden=16, seed=3,
    batch_size=10, dtype="float64", bucket_mb=0.002, overlap="on", grad_accum=2,
)  # fmt: skip


def run(strategy: Strategy, steps: range) -> list[float]:
    task, config = strategy.task, strategy.config
    sampler = DistributedSampler(
        task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
    )
    return [strategy.step(sampler.local_indices(s), 1e-2).loss for s in steps]


def params(strategy: Strategy) -> list[np.ndarray]:
    return [p.data.copy() for p in strategy.task.model.parameters()]


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_state_dict_resumes_training_exactly():
    config, group = TrainConfig(**TINY), comm.world()
    with DataParallel(Task(config, np.float64), config, group) as straight:
        want_losses, want = run(straight, range(4)), params(straight)
    with DataParallel(Task(config, np.float64), config, group) as first:
        losses = run(first, range(2))
        state = first.state_dict()
    other = Task(config, np.float64)
    for p in other.model.parameters():  # everything must come from the state
        p.data[...] = np.random.default_rng(7).standard_normal(p.shape)
    with DataParallel(other, config, group) as second:
        second.load_state_dict(state)
        losses += run(second, range(2, 4))
        got = params(second)
    assert losses == want_losses
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_memory_and_bytes_are_counted_from_the_arrays():
    config, group = TrainConfig(**TINY), comm.world()
    with DataParallel(Task(config, np.float64), config, group) as strategy:
        before = strategy.bytes_sent_by_axis()["dp"]
        run(strategy, range(1))
        memory = strategy.memory_bytes()
        model_bytes = sum(p.data.nbytes for p in strategy.task.model.parameters())
        assert memory["parameters"] == model_bytes
        assert memory["gradients"] == model_bytes  # the buckets hold one gradient each
        adam_moments = sum(v.nbytes for s in strategy.optimizer.state for v in s.values())
        assert memory["optimizer"] == adam_moments >= 2 * model_bytes
        assert memory["activations_peak"] > 0
        assert memory["buffers"] > 0  # the ring's scratch chunks
        sent = strategy.bytes_sent_by_axis()["dp"] - before
        counters = strategy.ddp.comm_group.counters["allreduce"]["bytes_sent"]
        assert sent >= counters > 0
        assert set(strategy.bytes_sent_by_axis()) == {"dp"}


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_a_communication_hook_reduces_every_bucket():
    config, group = TrainConfig(**TINY), comm.world()
    with DataParallel(Task(config, np.float64), config, group) as plain:
        want = run(plain, range(2))
    with DataParallel(Task(config, np.float64), config, group) as hooked:
        calls = []
        default = allreduce_hook("ring")

        def hook(bucket, g):
            calls.append(bucket.index)
            default(bucket, g)

        hooked.ddp.register_comm_hook(hook)
        got = run(hooked, range(2))
        n = len(hooked.ddp.buckets)
    assert n > 1
    assert calls == list(range(n)) * 2  # each bucket once a step (not per micro-batch), in order
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_a_dropped_ddp_stops_its_thread_and_restores_the_switch_interval():
    task = Task(TrainConfig(**TINY), np.float64)
    before = sys.getswitchinterval()
    ddp = DistributedDataParallel(task.model, comm.world(), overlap=True)
    assert sys.getswitchinterval() < before
    del ddp  # never closed
    gc.collect()
    for thread in threading.enumerate():
        if thread.name == "minidp-comm":
            thread.join(5)
    assert not [t for t in threading.enumerate() if t.name == "minidp-comm"]
    assert sys.getswitchinterval() == before
    with DistributedDataParallel(task.model, comm.world(), overlap=True) as ddp:
        pass
    assert ddp.comm_group.broken == "freed"  # the context manager closed it


def test_overlap_auto_follows_the_cores(monkeypatch):
    from minidp.tools import info

    monkeypatch.setattr(info, "cores", lambda: 2)  # an unbound rank sees the whole machine
    monkeypatch.setattr(info.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(info, "local_ranks", lambda: 2)
    on, why = dp_module.overlap_helps(2)
    assert not on and "none to spare" in why
    monkeypatch.setattr(info.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(info, "cores", lambda: 8)
    assert dp_module.overlap_helps(2)[0]  # 8 cores for 2 ranks
    monkeypatch.setattr(info, "cores", lambda: 1)  # bound by the launcher to one core each
    assert not dp_module.overlap_helps(2)[0]
    monkeypatch.setattr(info, "cores", lambda: 2)  # bound to two cores each
    assert dp_module.overlap_helps(2)[0]
    assert not dp_module.overlap_helps(1)[0]  # one rank: nothing to overlap
    task = Task(TrainConfig(**TINY), np.float64)
    with DistributedDataParallel(task.model, comm.world(), overlap=False) as ddp:
        assert not ddp.overlap and ddp.overlap_reason == "forced"


def test_the_strategy_table_is_the_flag_choices():
    action = next(a for a in train_parser()._actions if a.dest == "strategy")
    assert tuple(action.choices) == tuple(STRATEGIES)
    for name, make in STRATEGIES.items():  # a Strategy class, or a function picking one
        assert make.name == name
        picks = name in ("dp", "hybrid")  # dp: Experts with --experts; hybrid: the mesh's too
        assert issubclass(make, Strategy) if isinstance(make, type) else picks


class _Counting:
    comm_seconds, exposed_seconds, sent = 0.0, 0.0, 0

    def bytes_sent_by_axis(self):
        return {"dp": self.sent, "tp": 2 * self.sent}


def test_the_step_meter_reports_each_window_alone():
    s = _Counting()
    meter = StepMeter(s)
    for _ in range(3):
        s.comm_seconds += 1.0
        s.exposed_seconds += 0.5
        s.sent += 10
        meter.count()
    first = meter.window()
    assert (first.steps, first.comm_s, first.exposed_s, first.bytes_sent) == (3, 3.0, 1.5, 90)
    s.comm_seconds += 2.0
    s.sent += 1
    meter.count()
    second = meter.window()
    assert (second.steps, second.comm_s, second.exposed_s, second.bytes_sent) == (1, 2.0, 0, 3)
    total = meter.total()
    assert (total.steps, total.comm_s, total.bytes_sent) == (4, 5.0, 93)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_on_a_sub_group_its_rank_0_writes_everything(tmp_path_factory, capsys):
    world = comm.world()
    path = str(tmp_path_factory.getbasetemp() / f"r{world.rank}.json")
    group = world.split(0 if world.rank == 1 else None)  # world rank 1 trains alone
    if group is not None:
        config = replace(TrainConfig(**TINY), steps=2, log_every=1, json=path, overlap="auto")
        train(config, group)
    out = capsys.readouterr().out
    if world.rank == 1:  # rank 0 of its group: it prints and writes the records
        assert "minidp train" in out and "done: 2 steps" in out
        assert "overlap off (auto: one rank, nothing to communicate)" in out  # says why
        records = [json.loads(line) for line in open(path)]
        assert records[-1]["world_size"] == 1 and len(records) == 3
    else:
        assert out == ""
    world.comm.Barrier()


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_adamw_is_the_default_optimizer_with_the_config_weight_decay():
    config, group = TrainConfig(**TINY), comm.world()
    with DataParallel(Task(config, np.float64), config, group) as strategy:
        assert type(strategy.optimizer) is optim.AdamW
        assert strategy.optimizer.hyper["weight_decay"] == config.weight_decay


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_a_failing_comm_hook_stops_the_reductions_instead_of_pairing_the_wrong_buckets():
    """After a hook fails on one rank, that rank must reduce no later bucket: its next
    allreduce would pair with the other rank's previous bucket (same shapes, so the
    fingerprints agree). The error reaches the main thread; the other rank times out."""
    world = comm.world()
    task = Task(TrainConfig(**TINY), np.float64)
    ddp = DistributedDataParallel(task.model, world, bucket_cap_mb=0.002, overlap=True)
    ddp.comm_group.timeout = 2.0
    calls, default = [], allreduce_hook("ring")

    def hook(bucket, g):
        calls.append(bucket.index)
        if world.rank == 0 and bucket.index == 0:
            raise RuntimeError("planted hook failure")
        default(bucket, g)

    ddp.register_comm_hook(hook)
    x, y = task.batch(np.arange(4))
    ddp.zero_grad()
    task.loss(x, y).backward()
    assert len(ddp.buckets) >= 3
    if world.rank == 0:
        with pytest.raises(RuntimeError, match="planted"):
            ddp.finish_gradient_sync()
        assert calls == [0]  # nothing after the failure
    else:
        with pytest.raises(comm.CollectiveTimeout):
            ddp.finish_gradient_sync()
    ddp.close()
    world.comm.Barrier()


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_the_final_record_counts_training_traffic_only():
    config = replace(TrainConfig(**TINY), steps=3, log_every=1)
    final = train(config)
    by_axis = {"dp": final["bytes_sent_per_rank"], "tp": 0, "pp": 0, "cp": 0, "ep": 0}
    assert final["bytes_sent_by_axis"] == by_axis
    # not the first broadcast, nor the spread check after training
    assert final["bytes_sent_by_axis"]["dp"] == final["bytes_sent_per_rank"] > 0
    assert set(final["memory_bytes"]) == {
        "parameters", "gradients", "optimizer", "activations_peak", "buffers"
    }  # fmt: skip
