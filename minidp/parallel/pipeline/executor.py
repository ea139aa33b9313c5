"""The executor: one rank runs its list of a schedule's actions on its PipelineStages.

The schedule is data (schedules.py): `schedule.actions()[rank]` is the rank's lowered list,
validated and dry-run once. The executor walks that list in order and nothing else decides
what runs when (nothing is scheduled twice), as torch.distributed.pipelining's
`schedule.step(x, target=...)` does. 1F1B, pp = 2, m = 3, rank 1's list and what runs:

    action     what the executor does                        span (busy)
    1RECV_F0   wait until stage 0's activation of mb 0 is here   -  (idle)
    1F0        stage1.forward(0, targets=t[0], share=s[0])   F 1.0  (receives it, computes)
    1B0        stage1.backward(0)                            B 1.0  (isends dL/dx upstream)
    1SEND_B0   nothing: B isent it already                   -
    1RECV_F1   wait until mb 1's activation is here          -  (idle)
    1F1        stage1.forward(1, ...)                        F 1.1
    ...
    end        stage.wait_sends() on every stage: until every send has been received

    action     the stage's call                        with schedule.split_backward
    sFj        stages[s].forward(j, inputs, targets, share)
    sBj        stages[s].backward(j)                   stages[s].backward_input(j)
    sWj        -                                       stages[s].backward_weight(j)
    SEND_*     nothing: the stage isends inside the compute action just before it
    RECV_*     wait (communications.await_message, a probe) until the message the next
               compute action receives has arrived; that action then receives it without
               waiting. Every such wait adds to the group's clock, `group.seconds`

So a wait for a neighbour is idle time between spans, never inside one, and the bubble
read off the spans is the schedule's (plus what a message costs: the probe yields the
core between polls and answers at once; it napped up to 1 ms a wait before 2026-12-04).

Why it cannot deadlock: lowering places every RECV right before its compute action and
every SEND right after its compute action, and the stage sends with a non-blocking
`isend`: running the list is exactly the dry run's model of execution, where a rank blocks
only at a receive, never at a send. `schedule.actions()` has been dry-run to completion
under that model (dry_run.py), and messages are matched by tag (micro-batch, boundary,
direction: communications.py), so the order in which they arrive does not matter. Hence
the real run completes as the dry run did. (A message that never comes: the probe gives
up after the group's timeout and the stage's own receive raises, naming the peer.)

The executor splits nothing: it takes the step's micro-batches as lists (inputs for the
first stage, targets for the last) and each micro-batch's `share` of the step's examples
(B_j / B): the last stage's weighted losses then sum to the mean loss over the batch, and
the gradients to its gradient. `split_batch` cuts a batch for it.

Each compute action is one span on a `minidp.comm.trace.Timeline` (named "F 0.3": forward of
stage 0 on micro-batch 3); `measured_bubble` turns a step's spans into the bubble fraction,
idle over the step's window on every rank, as simulate.py defines it in unit time:

    bubble = sum over ranks of (window - busy(rank)) / (pp · window)
    window = the latest end - the earliest start of any compute span of the step, any rank
"""

import contextlib

import numpy as np

from minidp import comm
from minidp.parallel.pipeline import communications as msg
from minidp.parallel.pipeline.actions import RECV_B, RECV_F, Action, B, F, W, peer_rank
from minidp.parallel.pipeline.stage import PipelineStage

__all__ = ["RunResult", "check_stages", "measured_bubble", "run_schedule", "split_batch"]


class RunResult(list):
    """What `run_schedule` returns: the list of the last stage's weighted losses per
    micro-batch ([] off its rank), with this rank's peaks over the run, all its stages
    together, read after each compute action: `peak_in_flight` (micro-batches) and
    `peak_bytes` (activations held). Not the sum of each stage's own peak: two stages of one
    rank (interleaved, V > 1) peak at different times."""

    peak_in_flight: int = 0
    peak_bytes: int = 0


def split_batch(inputs, targets, micro_batches: int) -> tuple[list, list, list[float]]:
    """The batch cut along its first axis into `micro_batches` contiguous micro-batches
    (the first B % M one example longer): (inputs, targets, shares), share = B_j / B."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, not {micro_batches!r}")
    size = len(targets)
    if micro_batches > size:
        raise ValueError(f"micro_batches ({micro_batches}) exceeds the batch's {size} examples")
    micro_in = np.array_split(np.asarray(inputs), micro_batches)
    micro_t = np.array_split(np.asarray(targets), micro_batches)
    return micro_in, micro_t, [len(t) / size for t in micro_t]


def run_schedule(
    schedule,
    stages: dict[int, PipelineStage],
    inputs=None,
    targets=None,
    shares=None,
    timeline=None,
) -> RunResult:
    """Run this rank's `schedule.actions()[rank]` on `stages` (stage index -> this rank's
    PipelineStage, every stage of `schedule.stages_of(rank)`), then wait for the sends.

    `inputs[j]` is micro-batch j's input (read on the rank of stage 0 only), `targets[j]`
    its targets (read on the rank of the last stage only), `shares[j]` its fraction of the
    step's examples (default: each micro-batch's length over the targets' total, as one
    process on the whole batch weighs it; only the last stage reads them). Gradients are
    added into the parameters' .grad (zero them before, step the optimizer after). Returns
    the last stage's weighted losses per micro-batch on its rank (their sum is the step's
    loss), [] on the other ranks, as a RunResult: a list that also carries the rank's peak
    activations over the run."""
    m = schedule.micro_batches
    rank = check_stages(schedule, stages)
    if shares is None and targets is not None:  # the last stage's: B_j / B, uneven too
        shares = [len(t) / sum(len(u) for u in targets) for t in targets]
    shares = [1.0 / m] * m if shares is None else list(shares)
    if len(shares) != m:
        raise ValueError(f"shares has {len(shares)} entries, the schedule {m} micro-batches")
    last = schedule.num_stages - 1
    for name, given, needed in (
        ("inputs", inputs, 0 in stages),
        ("targets", targets, last in stages),
    ):
        if needed and (given is None or len(given) != m):
            got = "None" if given is None else f"{len(given)} micro-batches"
            raise ValueError(f"{name}: the schedule has {m} micro-batches, got {got}")
    if schedule.num_stages > 1:  # the largest tag, checked once, alike on every rank
        group = next(iter(stages.values())).group
        msg.message_tag(group, m - 1, schedule.num_stages - 2, schedule.num_stages, msg.BACKWARD)
    result = RunResult()
    _note_peaks(result, stages)
    for action in schedule.actions()[rank]:
        stage, j = stages[action.stage], action.micro_batch
        if action.kind in (RECV_F, RECV_B):
            _wait_for(action, stage, schedule.pp)
        if not action.is_compute:
            continue  # SEND_*: sent inside the compute action before it
        name = f"{action.kind} {action.stage}.{j}"
        with timeline.span(name) if timeline is not None else contextlib.nullcontext():
            if action.kind == F:
                stage.forward(
                    j,
                    inputs=inputs[j] if action.stage == 0 else None,
                    targets=targets[j] if action.stage == last else None,
                    share=shares[j],
                )
            elif action.kind == B and schedule.split_backward:
                stage.backward_input(j)
            elif action.kind == B:
                stage.backward(j)
            elif action.kind == W:
                stage.backward_weight(j)
        _note_peaks(result, stages)
    for stage in stages.values():
        stage.wait_sends()
    if last in stages:
        result.extend(stages[last].losses[j] for j in range(m))
    return result


def _note_peaks(result: RunResult, stages: dict[int, PipelineStage]) -> None:
    """Raise the rank's peaks to what its stages hold together now."""
    in_flight = sum(stage.in_flight for stage in stages.values())
    held = sum(stage.held_bytes for stage in stages.values())
    result.peak_in_flight = max(result.peak_in_flight, in_flight)
    result.peak_bytes = max(result.peak_bytes, held)


def _wait_for(action: Action, stage: PipelineStage, pp: int) -> None:
    """Wait until the message `action` (RECV_F or RECV_B) names has arrived; not received."""
    if action.kind == RECV_F:  # across boundary s - 1 -> s, forward
        boundary, direction = action.stage - 1, msg.FORWARD
    else:  # across boundary s -> s + 1, backward
        boundary, direction = action.stage, msg.BACKWARD
    group = stage.group
    tag = msg.message_tag(group, action.micro_batch, boundary, stage.num_stages, direction)
    if not msg.await_message(group, peer_rank(action, pp), tag):
        raise comm.CollectiveTimeout(
            f"pipeline: {action} heard nothing from rank {peer_rank(action, pp)} within "
            f"{group.timeout:g} s"
        )


def check_stages(schedule, stages: dict[int, PipelineStage]) -> int:
    """This rank's index in the pipeline group, after checking `stages` fits `schedule`."""
    if not stages:
        raise ValueError("stages is empty: give this rank's PipelineStages by stage index")
    group = next(iter(stages.values())).group
    if group.size != schedule.pp:
        raise ValueError(f"the stages' group has {group.size} ranks, the schedule pp={schedule.pp}")
    want = schedule.stages_of(group.rank)
    if sorted(stages) != want:
        raise ValueError(
            f"rank {group.rank} holds stages {want} of {schedule!r}, not {sorted(stages)}"
        )
    for index, stage in stages.items():
        if stage.stage_index != index or stage.num_stages != schedule.num_stages:
            raise ValueError(
                f"stages[{index}] is stage {stage.stage_index} of {stage.num_stages}, "
                f"the schedule has {schedule.num_stages} stages"
            )
    return group.rank


def measured_bubble(timeline, group, first_event: int = 0) -> float:
    """Collective over the pipeline `group`: the bubble fraction of the compute spans
    `timeline.events[first_event:]` (one step's), as the module doc defines it."""
    spans = [e for e in timeline.events[first_event:] if _is_compute_span(e["name"])]
    t0 = timeline.t0 * 1e6  # perf_counter is one clock for every process of a machine
    start = min((t0 + e["ts"] for e in spans), default=np.inf)
    end = max((t0 + e["ts"] + e["dur"] for e in spans), default=-np.inf)
    busy = sum(e["dur"] for e in spans)
    start = comm.allreduce(np.array([start]), op="min", group=group)[0]
    end = comm.allreduce(np.array([end]), op="max", group=group)[0]
    busy = comm.allreduce(np.array([busy], np.float64), group=group)[0]
    window = end - start
    return float(1.0 - busy / (group.size * window)) if window > 0 else 0.0


def _is_compute_span(name: str) -> bool:
    words = name.split()
    return len(words) == 2 and words[0] in (F, B, W)
