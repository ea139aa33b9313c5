"""The pipeline in the step model (cost/pp_step.py): the bytes each rank sends
per axis against what real `--strategy pp` and dp x pp runs count, and the step's length
against the schedule simulator's in unit time; the parameter server's bytes under BSP, ASP and SSP
(cost/ps_step.py) against real runs, workers and servers, and its step's terms."""

import math

import numpy as np
import pytest
from test_cost_step import real_runs  # the runs, and --json's prediction beside them

from minidp import comm
from minidp.cli.commands import main
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.cost import ps_step
from minidp.cost.pp_step import bytes_by_axis, predict_pipeline, stage_params
from minidp.cost.predicted import in_record
from minidp.cost.step import Compute, Layout, Network
from minidp.models.tasks import Task
from minidp.parallel.pipeline.schedules import build_schedule
from minidp.parallel.pipeline.simulate import simulate

TINY = dict(
    n_embd=16, n_head=4, block_size=8, batch_size=10, bucket_mb=0.002, steps=2,
    log_every=100, eval_batches=1, sample_tokens=0,
)  # fmt: skip
HYBRID = dict(strategy="hybrid", pp=2, n_layer=2, micro_batches=2)
CASES = [  # (ranks, flags): uneven micro-batches (10 over 4, 5 over 2), interleaving, dp x pp
    (2, dict(strategy="pp", n_layer=2, micro_batches=4, schedule="gpipe")),  # and tp x pp
    (4, dict(strategy="pp", n_layer=4, micro_batches=4, schedule="1f1b", dtype="float64")),
    (2, dict(strategy="pp", n_layer=4, micro_batches=4, schedule="interleaved", virtual=2)),
    (4, dict(HYBRID, dp=2, schedule="zb-h1", grad_clip=0.0)),
    (4, dict(HYBRID, tp=2, schedule="1f1b")),
    (4, dict(HYBRID, dp=2, zero_stage=1, schedule="gpipe")),
    (4, dict(HYBRID, tp=2, schedule="zb-h1", recompute=True)),  # g again in backward
]


@pytest.mark.parallel(nprocs=[4])
def test_pipeline_bytes_by_axis_and_model_states_are_what_real_runs_count(tmp_path):
    for ranks, flags, group, config, final in real_runs(CASES, TINY, tmp_path):
        dp, tp = flags.get("dp", 1), flags.get("tp", 1)
        layout = Layout(
            flags["strategy"], dp=dp, tp=tp, pp=ranks // dp // tp, schedule=flags["schedule"] if
            "schedule" in flags else "1f1b", micro_batches=flags["micro_batches"],
            virtual=flags.get("virtual", 1), clip=config.grad_clip > 0,
            zero_stage=config.zero_stage, recompute=config.recompute,
            bucket_mb=config.bucket_mb,
        )  # fmt: skip
        vocab = Task(config, np.dtype(config.dtype)).model.config.vocab_size
        gpt = (config.n_layer, 16, vocab, 8)
        itemsize = np.dtype(config.dtype).itemsize
        sent = bytes_by_axis(layout, gpt, itemsize, 10, group.rank)
        counted = {axis: b // config.steps for axis, b in final["bytes_sent_by_axis"].items()}
        assert counted == sent, (ranks, flags, group.rank)
        schedule = build_schedule(layout.schedule, layout.pp, layout.micro_batches, layout.virtual)
        p, t = group.rank // tp % layout.pp, group.rank % tp
        held = sum(n for s in schedule.stages_of(p) for n in stage_params(gpt, layout.pp *
                   layout.virtual, s, tp, t))  # fmt: skip
        assert final["memory_bytes"]["parameters"] == itemsize * held, (ranks, flags)
        group.free()


@pytest.mark.parametrize("name, pp, m, virtual", [
    ("gpipe", 2, 4, 1), ("1f1b", 4, 6, 1), ("zb-h1", 3, 4, 1), ("interleaved", 2, 4, 2),
])  # fmt: skip
def test_with_unit_times_and_a_free_network_the_step_is_the_simulated_schedule(
    name, pp, m, virtual
):
    """Every stage a block of equal weight (a head of vocabulary 0), F = B = 1 s: the step
    is the simulator's length in units."""
    stages = pp * virtual
    gpt = (stages, 8, 0, 4)
    layout = Layout("pp", pp=pp, schedule=name, micro_batches=m, virtual=virtual, clip=False)
    compute = Compute(stages * 1.0, stages * 1.0, 0.0, examples=1, params=1)
    for rank in range(pp):
        p = predict_pipeline(layout, gpt, compute, Network(0.0, 1e-30), batch_size=m, rank=rank)
        schedule = build_schedule(name, pp, m, virtual)
        unit = simulate(schedule.compute_actions(), pp, stages, schedule.split_backward)
        assert p.step_s == pytest.approx(unit.length)
        assert p.compute_s == pytest.approx(m * virtual * 2)  # every F and B of its stages
        assert p.exposed_comm_s == pytest.approx(unit.idle(rank))


def test_predict_prints_a_pipeline_and_refuses_what_it_does_not_cover(capsys):
    args = ["predict", "--n-layer", "2", "--micro-batches", "2", "--batch-size", "4"]
    assert main([*args, "--strategy", "pp", "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("predicted step: pp on 2 ranks (dp 1 x tp 1 x pp 2")
    assert "bytes sent per rank per step: dp 0, tp 0, pp " in out
    with pytest.raises(SystemExit):
        main([*args, "--strategy", "pp", "--world", "3"])
    err = capsys.readouterr().err
    assert (
        "--pp 3 x --virtual 1 stages are more than --n-layer 2 blocks" in err
        and err.count("\n") == 1
    )


PS_CASES = [  # (ranks, servers, --grad-clip, --consistency)
    (3, 1, 1.0, "bsp"), (4, 2, 1.0, "bsp"), (4, 1, 0.0, "bsp"),
    (3, 1, 1.0, "asp"), (4, 2, 1.0, "asp"), (4, 2, 1.0, "ssp:1"), (4, 1, 0.0, "ssp:0"),
]  # fmt: skip


@pytest.mark.parallel(nprocs=[4])
def test_parameter_server_bytes_per_rank_are_what_real_runs_count(tmp_path):
    """Workers and servers alike, per step and once per run, under BSP, ASP and SSP
    (cost/ps_step.py: no norm allreduce but BSP's); the run's own record carries the same
    prediction, and the pushes a server holds."""
    world = comm.world()
    for i, (ranks, servers, clip, consistency) in enumerate(PS_CASES):
        group = world.subgroup(list(range(ranks)))
        if group is None:
            continue
        flags = dict(strategy="ps", servers=servers, grad_clip=clip, n_layer=1,
                     consistency=consistency, json=str(tmp_path / f"ps{i}.jsonl"))  # fmt: skip
        config = TrainConfig(**{**TINY, **flags, "bucket_mb": 0.25})
        final = train(config, group, adds=[in_record])  # the prediction, as the CLI's runs
        params = Task(config, np.dtype("float32")).model.num_parameters()
        workers, bsp = ranks - servers, consistency == "bsp"
        per_step = ps_step.bytes_by_axis(workers, servers, params, 4, group.rank, clip and bsp)
        once = ps_step.bytes_per_run(workers, servers, group.rank)
        counted = final["bytes_sent_by_axis"]["dp"]
        case = (ranks, servers, consistency, group.rank)
        assert counted == config.steps * per_step["dp"] + once, case
        assert final["predicted_bytes_by_axis"] == final["bytes_sent_by_axis"], case
        predicted, held = final["predicted_memory_bytes"], final["memory_bytes"]
        assert predicted["gradients"] == held["gradients"], case  # BSP: a push per worker
        assert 0 <= held["optimizer"] - predicted["optimizer"] <= 8, case  # AdamW's step: 8
        turns = (workers - 1) / workers * (config.steps - 1) / config.steps  # equal shares
        expected = 0 if bsp or consistency == "ssp:0" else turns
        assert final["predicted_staleness_mean"] == pytest.approx(expected), case
        group.free()


def test_more_servers_carry_less_each_and_the_bsp_step_adds_up():
    compute = Compute(0.01, 0.02, 0.004, examples=8, params=10_000)
    net = Network(alpha=2e-6, beta=1e-9)
    one, two = (ps_step.predict_ps(workers=2, servers=s, params=10_000, compute=compute, net=net,
                                   batch_size=16, clip=True, rank=2) for s in (1, 2))  # fmt: skip
    assert two.bytes_by_axis["dp"] < one.bytes_by_axis["dp"]  # server 0's replies: half
    assert two.memory_bytes["optimizer"] == one.memory_bytes["optimizer"] // 2
    assert two.step_s < one.step_s  # half the bytes and half the optimizer on each server
    for p in (one, two):
        assert p.step_s == pytest.approx(p.compute_s + p.exposed_comm_s)
        assert p.compute_s == pytest.approx(0.03 * 8 / 8)  # forward + backward on B / W = 8


def test_asp_steps_at_a_workers_own_pace_or_the_servers_and_ssp_0_waits_as_bsp():
    compute = Compute(0.01, 0.02, 0.004, examples=6, params=10_000)
    net = Network(alpha=2e-6, beta=1e-9)
    m = 2 * net.alpha + (64 + 10_000 * 4) * net.beta  # a push or a reply: one shard
    kw = dict(servers=1, params=10_000, compute=compute, net=net, batch_size=16, clip=True)
    bsp, asp, ssp0, ssp2 = (ps_step.predict_ps(workers=3, **kw, bound=b)
                            for b in (None, math.inf, 0, 2))  # fmt: skip
    assert bsp.step_s == pytest.approx(0.03 + 6 * m + 0.004)  # chunks 6, 5, 5: rank 0's 6
    assert asp.step_s == pytest.approx(0.03 + 2 * m + 0.004)  # its own push, update, reply
    assert ssp2.step_s == asp.step_s  # equal workers: the bound never binds
    assert ssp0.step_s == pytest.approx(0.03 + 6 * m + 0.004)  # the last push's update
    rank2 = ps_step.predict_ps(workers=3, **kw, bound=math.inf, rank=2)  # 5 examples
    assert rank2.compute_s == pytest.approx(0.03 * 5 / 6)
    many = ps_step.predict_ps(workers=100, **kw, bound=math.inf)  # the server sets the pace
    assert many.step_s == pytest.approx(100 * (2 * m + 0.004))
    assert many.exposed_comm_s == pytest.approx(many.step_s - many.compute_s)


def test_a_sleeping_worker_slows_asp_only_itself_and_bsp_and_ssp_everyone():
    """--ps-slow-worker-ms: the last worker sleeps 50 ms a step. ASP: rank 0 steps as
    before, the sleeper 50 ms slower; BSP and SSP: every clock (or, over a run, the pace)
    waits for it; the sleep frees its core, so ranks sharing cores stretch its compute,
    not its sleep; staleness: the others run ahead of it, up to K clocks under SSP:K."""
    compute = Compute(0.01, 0.02, 0.004, examples=6, params=10_000)
    kw = dict(servers=1, params=10_000, compute=compute, batch_size=16, clip=True)
    for cores, stretch in ((0, 1.0), (2, 2.0)):  # 4 ranks on 2 cores: compute twice as long
        net = Network(alpha=2e-6, beta=1e-9, cores=cores)
        sleeper = 0.03 * 5 / 6 * stretch + 0.05  # chunks 6, 5, 5: the last worker's 5
        for bound in (None, math.inf, 0, 2):
            awake, slowed = (ps_step.predict_ps(workers=3, **kw, net=net, bound=bound, slow_s=s)
                             for s in (0.0, 0.05))  # fmt: skip
            if bound == math.inf:
                assert slowed.step_s == awake.step_s
                last = ps_step.predict_ps(workers=3, **kw, net=net, bound=bound, rank=2,
                                          slow_s=0.05)  # fmt: skip
                assert last.compute_s == pytest.approx(0.03 * 5 / 6 * stretch + 0.05)
            else:
                want = awake.step_s - 0.03 * stretch + sleeper
                assert slowed.step_s == pytest.approx(want), (cores, bound)
                assert slowed.step_s == pytest.approx(slowed.compute_s + slowed.exposed_comm_s)
    net = Network(alpha=2e-6, beta=1e-9)
    ssp = ps_step.predict_ps(workers=3, **{**kw, "batch_size": 15}, net=net, bound=2)
    plain, slowed = (ps_step.paces(ssp, 3, 15, 0, 2, slow_s=s) for s in (0.0, 0.05))
    assert slowed[2] == pytest.approx(plain[2] + 0.05) and slowed[:2] == plain[:2]
    calm, behind = (ps_step.mean_staleness(each, 41, 2) for each in (plain, slowed))
    assert calm == pytest.approx(2 * 40 / 123)  # equal shares (5, 5, 5): one clock, in turn
    assert behind == pytest.approx(2 * (1 + 39 * 2) / 123)  # the others 2 clocks ahead
    assert ps_step.mean_staleness(slowed, 41, math.inf) > 2 * behind  # ASP: no bound
    busy, sleepy = (ps_step.predict_ps(workers=100, **kw, net=net, bound=2, slow_s=s)
                    for s in (0.0, 0.01))  # fmt: skip
    assert sleepy.step_s == busy.step_s  # the server's pace (0.4 s) hides a 10 ms sleep
    server_bound = ps_step.predict_ps(workers=100, **kw, net=net, bound=math.inf)
    each = ps_step.paces(server_bound, 100, 16, 0, math.inf, slow_s=10.0)
    assert each[:99] == [server_bound.step_s] * 99 and each[99] > 10.0  # slower than it


def test_staleness_is_w_minus_1_over_w_taking_turns_and_grows_with_unequal_shares():
    equal = [0.02] * 3
    assert [ps_step.mean_staleness(equal, 11, b) for b in (None, 0, 1, math.inf)] == pytest.approx(
        [0, 0, 2 / 3 * 10 / 11, 2 / 3 * 10 / 11])  # fmt: skip
    unequal = [4.0, 3.0, 3.0]  # rank 0 the slowest: the others 1/4 clock ahead per clock
    asp = ps_step.mean_staleness(unequal, 41, math.inf)
    assert asp == pytest.approx(2 * sum(max(1, math.ceil(c / 4)) for c in range(1, 41)) / 123)
    assert ps_step.mean_staleness(unequal, 41, 2) == pytest.approx(2 * (4 + 2 * 36) / 123)
    assert asp > 3 and ps_step.mean_staleness(unequal, 81, math.inf) > 2 * asp - 1  # grows
    compute = Compute(0.01, 0.02, 0.004, examples=6, params=10_000)
    kw = dict(servers=1, params=10_000, compute=compute, net=Network(alpha=2e-6, beta=1e-9),
              batch_size=16, clip=True, bound=math.inf)  # fmt: skip
    p0, p1 = (ps_step.predict_ps(workers=3, **kw, rank=r) for r in (0, 1))  # 6 and 5 examples
    assert ps_step.paces(p0, 3, 16, 0, math.inf) == pytest.approx([p0.step_s, p1.step_s, p1.step_s])
    assert ps_step.paces(p1, 3, 16, 1, math.inf) == pytest.approx([p0.step_s, p1.step_s, p1.step_s])
    busy = ps_step.predict_ps(workers=100, **{**kw, "batch_size": 300})  # the server's pace
    assert ps_step.paces(busy, 100, 300, 0, math.inf) == [busy.step_s] * 100
