"""The executor against one process: a tiny float64 GPT (4 blocks) cut into stages and
trained a few AdamW steps by `run_schedule` driving each schedule's own action lists
(GPipe, 1F1B, interleaved with V = 2, ZB-H1) equals the whole model trained on the whole
batch in one process: every step's loss and the final parameters, to 1e-10. Each stage's
measured peak of micro-batches in flight equals the simulator's peak activations; the
measured bubble is a fraction. Bad arguments raise errors that name them."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_pipeline_stage import MICRO, batches, tiny_gpt, train_whole  # 3 steps of 8, m = 4

from minidp import comm, optim
from minidp.comm.trace import Timeline
from minidp.parallel.pipeline.executor import measured_bubble, run_schedule, split_batch
from minidp.parallel.pipeline.schedules import build_schedule
from minidp.parallel.pipeline.simulate import summary
from minidp.parallel.pipeline.split import split_model
from minidp.parallel.pipeline.stage import PipelineStage

F64 = np.float64
N_LAYER = 4  # interleaved at pp = 2 with V = 2: four stages of one block


def train_pipelined(model, schedule, recompute=False):
    """The model cut into the schedule's stages over the world, trained by run_schedule.
    Returns (stages, per-step losses, per-step peaks in flight per stage and of the rank,
    per-step bubbles)."""
    group = comm.world()
    parts = split_model(model, schedule.num_stages, recompute=recompute)
    stages = {
        s: PipelineStage(parts[s], s, schedule.num_stages, group)
        for s in schedule.stages_of(group.rank)
    }
    opt = optim.AdamW([p for st in stages.values() for p in st.parameters()], lr=1e-2)
    losses, peaks, rank_peaks, bubbles = [], [], [], []
    timeline = Timeline()
    for inputs, targets in batches(model):
        model.zero_grad()
        for stage in stages.values():
            stage.reset_peaks()
        first_event = len(timeline.events)
        micro_in, micro_t, shares = split_batch(inputs, targets, schedule.micro_batches)
        mine = run_schedule(schedule, stages, micro_in, micro_t, shares, timeline=timeline)
        for stage in stages.values():
            assert stage.in_flight == stage.held_bytes == 0 and not stage._weight_grads
        opt.step()
        root = schedule.stage_rank(schedule.num_stages - 1)
        losses.append(comm.broadcast(np.array([sum(mine)], F64), root=root)[0])
        peaks.append({s: st.peak_in_flight for s, st in stages.items()})
        rank_peaks.append(mine.peak_in_flight)
        assert mine.peak_bytes >= max(st.peak_bytes for st in stages.values())
        bubbles.append(measured_bubble(timeline, group, first_event))
    assert len(timeline.events) == len(batches(model)) * sum(
        len(stage_actions(schedule, s)) for s in stages
    )
    return stages, losses, peaks, rank_peaks, bubbles


def stage_actions(schedule, stage: int) -> list:
    rank = schedule.stage_rank(stage)
    return [a for a in schedule.actions()[rank] if a.is_compute and a.stage == stage]


def check_equal(name: str, virtual: int = 1, recompute: bool = False) -> None:
    pp = comm.world().size
    schedule = build_schedule(name, pp, MICRO, virtual)
    ref = tiny_gpt(N_LAYER)
    want = train_whole(ref)
    stages, got, peaks, rank_peaks, bubbles = train_pipelined(
        tiny_gpt(N_LAYER), schedule, recompute
    )
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=0)
    ref_parts = split_model(ref, schedule.num_stages)
    for s, stage in stages.items():
        for p, q in zip(stage.parameters(), ref_parts[s].parameters()):
            np.testing.assert_allclose(p.data, q.data, rtol=1e-10, atol=1e-12)
    expected = summary(schedule)["peak_activations_per_stage"]
    for step_peaks in peaks:
        assert step_peaks == {s: expected[s] for s in stages}
    rank = comm.world().rank
    assert rank_peaks == [summary(schedule)["peak_activations_per_rank"][rank]] * len(peaks)
    assert all(0 <= b < 1 for b in bubbles)


# ---- two ranks ----------------------------------------------------------------------------
@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
)
def test_every_schedule_equals_one_process(name, virtual):
    check_equal(name, virtual)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_recomputation_equals_one_process():
    check_equal("interleaved", 2, recompute=True)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_the_waits_count_on_the_groups_clock():
    """The pipeline's blocking waits add to `group.seconds` (what `--strategy pp` reports
    as comm_seconds): rank 0 starts 0.2 s late, so rank 1 waits at least that long for its
    first forward message; rank 0 waits for its gradients."""
    group = comm.world().dup()  # a clock of its own, at 0
    schedule = build_schedule("1f1b", 2, 2)
    parts = split_model(tiny_gpt(2), 2)
    stages = {group.rank: PipelineStage(parts[group.rank], group.rank, 2, group)}
    inputs, targets = batches(tiny_gpt(2))[0]
    assert group.seconds == 0.0
    if group.rank == 0:
        time.sleep(0.2)
    run_schedule(schedule, stages, *split_batch(inputs, targets, 2))
    assert group.seconds > (0.1 if group.rank == 1 else 0.0)
    group.free()


# ---- four ranks ---------------------------------------------------------------------------
@pytest.mark.parallel(nprocs=[4])
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_four_stages_equal_one_process(name):
    check_equal(name)


# ---- errors (one process) -----------------------------------------------------------------
def test_errors_name_the_argument():
    schedule = build_schedule("1f1b", 2, 2)
    group = SimpleNamespace(size=2, rank=0)
    parts = split_model(tiny_gpt(N_LAYER), 2)
    with pytest.raises(ValueError, match="stages is empty"):
        run_schedule(schedule, {})
    stage1 = PipelineStage(parts[1], 1, 2, SimpleNamespace(size=2, rank=1))
    with pytest.raises(ValueError, match="rank 1 holds stages \\[1\\]"):
        run_schedule(build_schedule("1f1b", 2, 2), {0: stage1})
    stage0 = PipelineStage(parts[0], 0, 2, group)
    with pytest.raises(ValueError, match="the schedule pp=4"):
        run_schedule(build_schedule("1f1b", 4, 2), {0: stage0})
    with pytest.raises(ValueError, match="shares has 3 entries"):
        run_schedule(schedule, {0: stage0}, shares=[0.5, 0.25, 0.25])
    with pytest.raises(ValueError, match="inputs: the schedule has 2 micro-batches, got None"):
        run_schedule(schedule, {0: stage0})
    with pytest.raises(ValueError, match="micro_batches \\(9\\) exceeds the batch's 8"):
        split_batch(*batches(tiny_gpt(N_LAYER))[0], 9)
    micro_in, micro_t, shares = split_batch(np.arange(5), np.arange(5), 2)
    assert [len(x) for x in micro_in] == [3, 2] and shares == [0.6, 0.4]


def test_the_bubble_is_idle_time_over_the_window():
    """One rank: F 0.0 over [0, 1) s, an idle second, B 0.0 over [2, 3): busy 2 of 3; other
    spans (the optimizer's) and those before `first_event` do not count."""
    timeline = Timeline()
    t0 = timeline.t0
    timeline.add("optimizer", "compute", t0 - 5, t0 - 4)
    first = len(timeline.events)
    for name, start in (("F 0.0", 0.0), ("optimizer", 1.0), ("B 0.0", 2.0)):
        timeline.add(name, "compute", t0 + start, t0 + start + 1)
    solo = comm.world().split(comm.world().rank)
    assert measured_bubble(timeline, solo, first) == pytest.approx(1 / 3)
    solo.free()
