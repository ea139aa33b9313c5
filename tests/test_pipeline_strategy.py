"""`--strategy pp` trains like one process: the tiny float64 GPT (4 blocks), AdamW, clipping
on, every schedule (interleaved with V = 2, recomputation on for one) at pp = 2, 1F1B and
ZB-H1 at pp = 4: the same per-step losses on every rank and, after gather_model, the same
whole model (1e-10); the record's bytes per axis and bubble fields; resuming from a rank's
state. Then the bad flags, one line each."""

import numpy as np
import pytest

from minidp import comm
from minidp.cli.commands import main
from minidp.cli.strategies import STRATEGIES, DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.parallel.pipeline.schedules import SCHEDULES
from minidp.tools.names import PIPELINE_SCHEDULES

STEPS = 3
TINY = dict(
    n_layer=4, n_embd=16, n_head=4, block_size=8, batch_size=8, seed=3, dtype="float64",
    grad_clip=0.05, eval_batches=1, sample_tokens=0,
)  # fmt: skip
PIPELINE = [
    dict(schedule="gpipe"),
    dict(schedule="1f1b"),
    dict(schedule="interleaved", virtual=2),
    dict(schedule="zb-h1", recompute=True),
]


def run(strategy) -> list[float]:
    sampler = DistributedSampler(
        strategy.task.num_examples, strategy.config.batch_size, *strategy.data_shard, seed=3
    )
    return [strategy.step(sampler.local_indices(step), 1e-2).loss for step in range(STEPS)]


def reference(config):
    """One process: DataParallel over a group of one."""
    solo = comm.world().split(comm.world().rank)
    with DataParallel(Task(config, np.float64), config, solo) as strategy:
        losses = run(strategy)
        params = strategy.task.model.state_dict()
    solo.free()
    return losses, params


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(240)
def test_every_schedule_trains_like_one_process():
    check_like_one_process(PIPELINE)


@pytest.mark.parallel(nprocs=[4])
@pytest.mark.timeout(240)
def test_four_stages_train_like_one_process():
    check_like_one_process([dict(schedule="1f1b"), dict(schedule="zb-h1")])


def check_like_one_process(schedules: list[dict]) -> None:
    world = comm.world()
    want_losses, want_params = reference(TrainConfig(**TINY))
    for flags in schedules:
        config = TrainConfig(**TINY, strategy="pp", pp=world.size, micro_batches=4, **flags)
        with STRATEGIES["pp"](Task(config, np.float64), config, world) as s:
            losses = run(s)
            np.testing.assert_allclose(losses, want_losses, rtol=1e-10, err_msg=str(flags))
            assert len(set(world.comm.allgather(tuple(losses)))) == 1  # every rank's alike
            sent = s.bytes_sent_by_axis()
            assert sent["dp"] == sent["tp"] == 0 and sent["pp"] > 0
            s.gather_model()
            got = s.task.model.state_dict()
            assert got.keys() == want_params.keys()
            for name, value in want_params.items():
                np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-13)
            assert s.max_param_diff() == 0.0
            l2 = np.sqrt(sum(float(np.vdot(a, a)) for a in want_params.values()))
            assert s.param_l2() == pytest.approx(l2, rel=1e-12)
            record = s.record()
            assert 0 <= record["bubble_fraction"] < 1
            assert 0 < record["bubble_fraction_formula"] < 1
            assert set(s.memory_bytes()) >= {"parameters", "activations_peak"}
            if flags["schedule"] == "1f1b":  # resuming from this rank's state: the same step
                check_resume(s, config, world)


def check_resume(s, config, group):
    state = s.state_dict()  # this rank's stages and their AdamW moments
    with STRATEGIES["pp"](Task(config, np.float64), config, group) as again:
        again.load_state_dict(state)
        assert again.param_l2() == s.param_l2()
        assert again.step(np.arange(8), 1e-2) == s.step(np.arange(8), 1e-2)
        assert again.param_l2() == s.param_l2()  # the moments came too


@pytest.mark.parametrize(
    "args, words",
    [
        (["--n-layer", "2", "--pp", "4"], "--pp 4 x --virtual 1 stages are more than --n-layer 2"),
        (["--micro-batches", "0"], "--micro-batches must be in [1, --batch-size 16], got 0"),
        (["--virtual", "2"], "--virtual 2: only --schedule interleaved"),
        (["--schedule", "interleaved", "--virtual", "2", "--pp", "2", "--n-layer", "6"],
         "--pp 2 x --virtual 2 must divide --n-layer 6"),
        (["--pp", "2"], "--pp 2 must be the world's 1 ranks"),
        (["--model", "mlp"], "--strategy pp cuts the GPT's blocks into stages, not --model mlp"),
        (["--pp", "-1"], "--pp must be >= 0"),
    ],
)  # fmt: skip
def test_a_bad_pipeline_flag_is_one_line_naming_it(args, words, capsys):
    refused(["--strategy", "pp", *args], words, capsys)


def refused(argv: list[str], words: str, capsys) -> None:
    """`argv` ends the run with exit code 2 and one line that holds `words`."""
    with pytest.raises(SystemExit) as exit:
        main(["--steps", "1", "--sample-tokens", "0", *argv])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err


def test_a_pipeline_flag_under_another_strategy_is_refused(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--strategy", "dp", "--micro-batches", "2"])
    assert exit.value.code == 2
    assert "--micro-batches is a flag of --strategy pp or hybrid, not of --strategy dp" in (
        capsys.readouterr().err
    )


def test_the_schedule_flag_choices_are_the_schedule_table():
    """--schedule's choices (names.py: config.py imports no MPI) are SCHEDULES' names."""
    assert PIPELINE_SCHEDULES == tuple(SCHEDULES)
