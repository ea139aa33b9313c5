"""The executor: one rank runs its list of a schedule's actions on its PipelineStages.

The schedule is data (schedules.py): `schedule.actions()[rank]` is the rank's lowered list,
validated and dry-run once. The executor walks that list in order and nothing else decides
what runs when (nothing is scheduled twice), as torch.distributed.pipelining's
`schedule.step(x, target=...)` does. 1F1B, pp = 2, m = 3, rank 1's list and what runs:

    action       what the executor calls              where it waits
    1RECV_F0     nothing (the receive is in F)        -
    1F0          stage1.forward(0, targets=t[0], ...)  receiving stage 0's activation of mb 0
    1B0          stage1.backward(0)                    -  (isends dL/dx of mb 0 upstream)
    1SEND_B0     nothing (B already isent it)          -
    1RECV_F1     nothing                               -
    1F1          stage1.forward(1, ...)                receiving mb 1's activation
    ...
    end          stage.wait_sends() on every stage     until every send has been received

    action     the stage's call                        with schedule.split_backward
    sFj        stages[s].forward(j, inputs, targets, share)
    sBj        stages[s].backward(j)                   stages[s].backward_input(j)
    sWj        -                                       stages[s].backward_weight(j)
    SEND_*     no-op: the stage isends inside the compute action just before it
    RECV_*     no-op: the stage receives inside the compute action just after it

Why it cannot deadlock: lowering places every RECV right before its compute action and
every SEND right after its compute action, so running the list with the receives inside F
and B and the sends inside them (non-blocking `isend`) is exactly the dry run's model of
execution: a rank blocks only at a receive, never at a send. `schedule.actions()` has been
dry-run to completion under that model (dry_run.py), and messages are matched by tag
(micro-batch, boundary, direction: communications.py), so the order in which they arrive
does not matter. Hence the real run completes as the dry run did.

The executor splits nothing: it takes the step's micro-batches as lists (inputs for the
first stage, targets for the last) and each micro-batch's `share` of the step's examples
(B_j / B): the last stage's weighted losses then sum to the mean loss over the batch, and
the gradients to its gradient. `split_batch` cuts a batch for it.

Each compute action is one span on a `minidp.trace.Timeline` (named "F 0.3": forward of
stage 0 on micro-batch 3); `measured_bubble` turns a step's spans into the bubble fraction,
idle over the step's window on every rank, as simulate.py defines it in unit time:

    bubble = sum over ranks of (window - busy(rank)) / (pp · window)
    window = the latest end - the earliest start of any compute span of the step, any rank
"""

import contextlib

import numpy as np

from minidp import comm
from minidp.parallel.pipeline.actions import B, F, W
from minidp.parallel.pipeline.stage import PipelineStage

__all__ = ["measured_bubble", "run_schedule", "split_batch"]


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
) -> list[float]:
    """Run this rank's `schedule.actions()[rank]` on `stages` (stage index -> this rank's
    PipelineStage, every stage of `schedule.stages_of(rank)`), then wait for the sends.

    `inputs[j]` is micro-batch j's input (read on the rank of stage 0 only), `targets[j]`
    its targets (read on the rank of the last stage only), `shares[j]` its fraction of the
    step's examples (default 1/m each). Gradients are added into the parameters' .grad
    (zero them before, step the optimizer after). Returns the last stage's weighted losses
    per micro-batch on its rank (their sum is the step's loss), [] on the other ranks."""
    m = schedule.micro_batches
    rank = _check(schedule, stages)
    shares = [1.0 / m] * m if shares is None else list(shares)
    if len(shares) != m:
        raise ValueError(f"shares has {len(shares)} entries, the schedule {m} micro-batches")
    last = schedule.num_stages - 1
    for action in schedule.actions()[rank]:
        if not action.is_compute:
            continue  # SEND_* and RECV_*: done inside the compute action beside it
        stage, j = stages[action.stage], action.micro_batch
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
    for stage in stages.values():
        stage.wait_sends()
    if last in stages:
        return [stages[last].losses[j] for j in range(m)]
    return []


def _check(schedule, stages: dict[int, PipelineStage]) -> int:
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
    t0 = timeline._t0 * 1e6  # perf_counter is one clock for every process of a machine
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
