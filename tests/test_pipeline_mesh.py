"""`--strategy hybrid --dp D --tp T --pp P` trains like one process: the tiny float64 GPT,
AdamW, clipping on, at (dp, tp, pp) = (1,1,2), (1,1,4), (1,2,2), (2,1,2) and (2,2,2), every
schedule at each, recomputation on for half of them (every schedule and every mesh sees it
on and off), ZeRO-1 on the DP axis of (2,1,2) and (2,2,2), sequence parallelism at
(2,2,2) with DDP and with ZeRO-1: the same per-step losses on every rank and, after
gather_model, the same whole model (1e-10).

Eight ranks, split into groups that run their cases side by side: the 8-rank mesh alone,
the 4-rank meshes two at a time, the 2-rank one four at a time. Then the bad mesh flags,
one line each."""

import numpy as np
import pytest

from minidp import comm
from minidp.cli.strategies import STRATEGIES
from tests.test_pipeline_strategy import TINY, reference, refused, run

SCHEDULES = [
    dict(schedule="gpipe"),
    dict(schedule="1f1b"),
    dict(schedule="interleaved", virtual=2),
    dict(schedule="zb-h1"),
]
MESHES = [(1, 1, 2), (1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 2)]


def cases() -> list[dict]:
    """Every mesh x every schedule, recompute on every other one; then ZeRO-1 and SP."""
    out = []
    for i, (dp, tp, pp) in enumerate(MESHES):
        for j, flags in enumerate(SCHEDULES):
            n_layer = 8 if pp * flags.get("virtual", 1) > 4 else 4
            case = dict(dp=dp, tp=tp, pp=pp, n_layer=n_layer, recompute=(i + j) % 2 == 1)
            out.append({**case, **flags})
    out.append(dict(dp=2, tp=1, pp=2, n_layer=4, schedule="1f1b", zero_stage=1))
    out.append(dict(dp=2, tp=1, pp=2, n_layer=4, schedule="zb-h1", zero_stage=1, recompute=True))
    out.append(dict(dp=2, tp=2, pp=2, n_layer=4, schedule="1f1b", sequence_parallel=True,
                    resume=True))  # fmt: skip
    # 7 examples over 2 replicas (4 and 3), cut into 3 micro-batches: unequal shares
    out.append(dict(dp=2, tp=1, pp=2, n_layer=4, schedule="1f1b", batch_size=7, micro_batches=3))
    out.append(dict(dp=2, tp=2, pp=2, n_layer=4, schedule="zb-h1", batch_size=7,
                    micro_batches=3, zero_stage=1))  # fmt: skip
    out.append(dict(dp=2, tp=2, pp=2, n_layer=4, schedule="gpipe", zero_stage=1, resume=True))
    out.append(dict(dp=2, tp=2, pp=2, n_layer=4, schedule="zb-h1", zero_stage=1,
                    sequence_parallel=True, recompute=True))  # fmt: skip
    return out


def rounds(world_size: int) -> list[list[dict]]:
    """The cases grouped by size, as many at once as the world holds."""
    by_size: dict[int, list[dict]] = {}
    for case in cases():
        by_size.setdefault(case["dp"] * case["tp"] * case["pp"], []).append(case)
    out = []
    for size, group in sorted(by_size.items()):
        at_once = world_size // size
        out += [group[k : k + at_once] for k in range(0, len(group), at_once)]
    return out


@pytest.mark.parallel(nprocs=[8])
@pytest.mark.timeout(600)
def test_the_3d_mesh_trains_like_one_process():
    from minidp.cli.training.config import TrainConfig
    from minidp.models.tasks import Task

    world = comm.world()
    keys = sorted({(c["n_layer"], c.get("batch_size", TINY["batch_size"])) for c in cases()})
    want = {key: reference(TrainConfig(**{**TINY, **dict(zip(KEY, key))})) for key in keys}
    for batch in rounds(world.size):
        size = batch[0]["dp"] * batch[0]["tp"] * batch[0]["pp"]
        color = world.rank // size
        group = world.split(color)
        if color < len(batch):
            case = {"micro_batches": 4, "batch_size": TINY["batch_size"], **batch[color]}
            key = case["n_layer"], case["batch_size"]
            flags = {k: v for k, v in case.items() if k != "resume"}
            config = TrainConfig(**{**TINY, **flags, "strategy": "hybrid"})
            with STRATEGIES["hybrid"](Task(config, np.float64), config, group) as s:
                check(s, case, group, *want[key])
                if case.get("resume"):  # a fresh recipe from each rank's state: the same step
                    check_resume(s, config, group)
        group.free()


KEY = ("n_layer", "batch_size")


def check_resume(s, config, group) -> None:
    """A fresh recipe loaded with each rank's state (after training and gather_model) steps
    as the trained one does, bit for bit."""
    from minidp.models.tasks import Task

    state = s.state_dict()
    with STRATEGIES["hybrid"](Task(config, np.float64), config, group) as again:
        again.load_state_dict(state)
        assert again.param_l2() == s.param_l2()
        local = np.arange(config.batch_size)[again.data_shard[0] :: again.data_shard[1]]
        assert again.step(local, 1e-2) == s.step(local, 1e-2)
        assert again.param_l2() == s.param_l2()  # the moments came too


def check(s, case, group, want_losses, want_params) -> None:
    losses = run(s)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10, err_msg=str(case))
    assert len(set(group.comm.allgather(tuple(losses)))) == 1  # every rank's alike
    sent = s.bytes_sent_by_axis()
    assert sent["pp"] > 0, case
    assert (sent["tp"] > 0) == (case["tp"] > 1), (case, sent)
    assert (sent["dp"] > 0) == (case["dp"] > 1), (case, sent)
    s.gather_model()
    got = s.task.model.state_dict()
    assert got.keys() == want_params.keys()
    for name, value in want_params.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-13, err_msg=str(case))
    assert s.max_param_diff() == 0.0
    l2 = np.sqrt(sum(float(np.vdot(a, a)) for a in want_params.values()))
    assert s.param_l2() == pytest.approx(l2, rel=1e-12)
    record = s.record()
    assert record["mesh"] == {"dp": case["dp"], "tp": case["tp"], "pp": case["pp"], "cp": 1}
    assert 0 <= record["bubble_fraction"] < 1


@pytest.mark.parametrize(
    "args, words",
    [
        (["--tp", "1", "--pp", "3", "--n-layer", "3"], "--pp 3 does not divide the world"),
        (["--tp", "1", "--schedule", "gpipe"], "--schedule: a pipeline needs"),
        (["--tp", "1", "--pp", "2", "--zero-stage", "2"], "--zero-stage 2 with --pp"),
        (["--tp", "1", "--pp", "2", "--compress", "fp16"], "--compress does not run with --pp"),
        (["--tp", "1", "--pp", "2", "--grad-accum", "2"], "--grad-accum does not run with --pp"),
    ],
)  # fmt: skip
def test_a_bad_mesh_flag_is_one_line_naming_it(args, words, capsys):
    refused(["--strategy", "hybrid", *args], words, capsys)


def test_a_mesh_that_does_not_fill_the_world_is_refused():
    from minidp.cli.strategies.pp import pipeline_mesh
    from minidp.cli.training.config import BadConfig, TrainConfig

    config = TrainConfig(strategy="hybrid", dp=2, tp=2, pp=2, n_layer=4)
    assert pipeline_mesh(config, 8) == (2, 2, 2)
    with pytest.raises(BadConfig, match=r"dp x tp x pp = 2 x 2 x 2 = 8, but the world has 4"):
        pipeline_mesh(config, 4)
    with pytest.raises(BadConfig, match=r"--pp 2 does not divide the world's 3 ranks"):
        pipeline_mesh(config, 3)
    # --pp alone: the rest of the world is data parallel
    assert pipeline_mesh(TrainConfig(strategy="hybrid", pp=2, n_layer=4), 8) == (4, 1, 2)


@pytest.mark.parallel(nprocs=[2])
def test_make_alike_takes_tp_rank_0s_or_the_sum():
    """The replicated gradients made alike over TP: summed (sequence parallelism), TP rank
    0's (dp > 2, where the DP sums may differ by rank), or left as they are."""
    from minidp.nn import Parameter
    from minidp.parallel.tensor_parallel.replicated import make_alike

    world = comm.world()
    p = Parameter(np.zeros(3))
    for dp, partial, want in ((2, False, world.rank), (3, False, 0), (2, True, 1)):
        p.grad = np.full(3, float(world.rank))
        make_alike([p], world, partial, take_rank0=dp > 2)
        np.testing.assert_array_equal(p.grad, np.full(3, float(want)))
