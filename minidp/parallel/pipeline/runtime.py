"""A schedule built from this rank's stages runs a step, as torch.distributed.pipelining's:

    stage = PipelineStage(my_part, stage_index=rank, num_stages=P, group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=cross_entropy)
    for x, y in batches:
        opt.zero_grad()
        if stage.is_first:   schedule.step(x)
        elif stage.is_last:  schedule.step(target=y, losses=losses)
        else:                schedule.step()
        opt.step()

Interleaved: `ScheduleInterleaved1F1B([stage_r, stage_r+P, ...], n_microbatches, loss_fn)`,
the rank's V stages. `step` cuts the batch (on the first stage's rank) and the targets (on
the last's) into m contiguous micro-batches, the first B % m one example longer, and weighs
each micro-batch's loss by its share B_j / B of the batch, so the m weighted losses sum to
the batch's mean loss and the gradients add up in .grad to the batch's gradient: the step
one process takes on the whole batch, uneven batches too. Then executor.run_schedule runs
this rank's actions.

Before anything is sent, the ranks agree (one exchange of a line each over the pipeline's
group): the same micro-batch count everywhere, the batch on the first stage's rank and the
targets on the last's, as long as each other and at least m. A rank given other numbers
fails, and every rank with it, naming what each rank was given; no rank waits for a
message that will not come.
"""

import numpy as np

from minidp import comm
from minidp.parallel.pipeline.executor import check_stages, run_schedule
from minidp.parallel.pipeline.stage import PipelineStage


def bind(pp, virtual, loss_fn) -> tuple[int, int, dict | None]:
    """(pp, V, {stage index: PipelineStage} or None) from a schedule's first arguments:
    numbers, or this rank's stage(s) (V: how many; a callable in V's place is the loss)."""
    given = pp if isinstance(pp, list | tuple) else [pp]
    if not all(isinstance(s, PipelineStage) for s in given):
        if loss_fn is not None:
            raise TypeError("loss_fn goes with stages: Schedule(stage, n_microbatches, loss_fn)")
        return pp, virtual, None
    if callable(virtual):  # PyTorch's order: (stage, n_microbatches, loss_fn)
        virtual, loss_fn = None, virtual
    if loss_fn is not None:
        for stage in given:
            stage.loss_fn = loss_fn
    group = given[0].group
    return group.size, len(given), {stage.stage_index: stage for stage in given}


def run_step(schedule, inputs: tuple, target, losses):
    """schedule.step: see the module docstring."""
    stages = schedule.bound
    if stages is None:
        raise TypeError(
            f"{schedule!r} was built from numbers: build it from this rank's PipelineStage(s) "
            "to step it, or run executor.run_schedule"
        )
    group, m = next(iter(stages.values())).group, schedule.micro_batches
    first, last = 0 in stages, schedule.num_stages - 1 in stages
    x = inputs[0] if inputs else None
    problem = _problem(schedule, stages, inputs, target, first, last)
    sizes = [len(a) if hasattr(a, "__len__") else 0 for a in (x, target) if a is not None]
    agree(group, m, sizes, problem)
    micro_in = np.array_split(np.asarray(x), m) if first else None
    micro_t = np.array_split(np.asarray(target), m) if last else None
    shares = [len(t) / len(target) for t in micro_t] if last else None
    weighted = run_schedule(schedule, stages, micro_in, micro_t, shares)
    if not last:
        return None
    if losses is not None:
        losses.extend(w / share for w, share in zip(weighted, shares))
    return float(sum(weighted))


def _problem(schedule, stages, inputs: tuple, target, first: bool, last: bool) -> str:
    """What is wrong with this rank's own arguments ("" for nothing), said in the agreement
    so that every rank fails together, none alone."""
    try:  # the stages must be this rank's of the schedule
        check_stages(schedule, stages)
    except ValueError as error:
        return str(error)
    if len(inputs) > 1:
        return f"{len(inputs)} inputs: give the batch as one array"
    if first != bool(inputs):
        return "the first stage's rank needs the batch: step(x)" if first else (
            "the batch goes to the first stage's rank only")  # fmt: skip
    if last != (target is not None):
        return "the last stage's rank needs the targets: step(target=y)" if last else (
            "the targets go to the last stage's rank only")  # fmt: skip
    return ""


def agree(group: comm.Group, m: int, sizes: list[int], problem: str) -> None:
    """ValueError on every rank of `group` unless every rank has the same micro-batch count
    `m`, the batch sizes given (`sizes`) are one size of at least m, and no rank found a
    `problem` with its own arguments."""
    mine = f"{m} {' '.join(map(str, sizes))}|{problem}"
    every = comm.gather_text(mine, root=0, group=group)
    verdict = ""
    if group.rank == 0:
        counts = {line.split("|")[0].split()[0] for line in every}
        given = {int(n) for line in every for n in line.split("|")[0].split()[1:]}
        problems = [f"rank {r}: {line.split('|', 1)[1]}" for r, line in enumerate(every)]
        problems = [p for p in problems if not p.endswith(": ")]
        if problems:
            verdict = "; ".join(problems)
        elif len(counts) > 1 or len(given) > 1 or (given and min(given) < m):
            told = ", ".join(f"rank {r}: {line.split('|')[0]}" for r, line in enumerate(every))
            verdict = (
                "the ranks of the pipeline must step the same n_microbatches over one batch "
                f"of at least that many examples (micro-batches, then sizes given: {told})"
            )
    verdict = comm.broadcast_text(verdict, root=0, group=group)
    if verdict:
        raise ValueError(f"schedule.step: {verdict}")
