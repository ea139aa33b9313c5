"""The compute-only order of each rank: GPipe, 1F1B, interleaved 1F1B, zero-bubble H1.

1F1B, pp = 3 ranks, m = 4 micro-batches, in unit time (sFj: forward of stage s on micro-batch
j; sBj its backward; '.' idle; `python -m minidp schedule --pp 3 --micro-batches 4`):

    rank 0: 0F0 0F1 0F2 .   .   0B0 0F3 0B1 .   0B2 .   0B3      warm-up: pp - 1 - r forwards,
    rank 1: .   1F0 1F1 .   1B0 1F2 1B1 1F3 1B2 .   1B3 .        then one F, one B, then the
    rank 2: .   .   2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 .   .        backwards left; the dots are
                                                                 the bubble: (p-1)/(m+p-1)

A schedule object holds the numbers (pp ranks, m micro-batches, V stages per rank) and says
what each rank computes, in order; lowering.py adds the messages, validate.py and
dry_run.py check the result, simulate.py times it. The classes are named as PyTorch's
torch.distributed.pipelining names them, and built from this rank's PipelineStage(s) as
PyTorch builds them, they run a step (runtime.py):

    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=cross_entropy)
    schedule.step(x)                            # the first stage's rank: the batch
    schedule.step(target=y, losses=losses)      # the last's: the targets, gets the losses
    schedule.step()                             # the others

The step table, rank r of pp, m micro-batches (Megatron-LM's order for the interleaved one):

    schedule       warm-up forwards               steady               cool-down
    GPipe          all m forwards                 -                    all m backwards
    1F1B           min(m, pp - 1 - r)             F(next) B(oldest)     the backwards left
    interleaved    min(V m, (V-1) g + 2(pp-1-r))  F(next) B(oldest)     the backwards left
                   forward k runs chunk (k // g) % V on micro-batch (k // (g V)) g + k % g,
                   backward k chunk V - 1 - (k // g) % V; g = micro-batches per round
                   (g = pp when pp divides m; PyTorch's rounds: g = m // max(1, m // pp))
    zero-bubble    min(m, pp - 1 - r)             F(next) B(oldest)     B, then W as in
    H1                                            and W(oldest) when    steady; the last r
                                                  more than r wait      W's at the end

Bubble fraction (idle / (pp · length)) in unit time (F = B = 1; split: B = W = 1/2):

    GPipe, 1F1B    (p - 1) / (m + p - 1)       Huang et al. 2019; Narayanan et al. 2021
    interleaved    (p - 1) / (V m + p - 1)     Narayanan et al. 2021; exact when pp divides m
    ZB-H1          (p - 1) / (2m + p - 1)      Qi et al., "Zero Bubble Pipeline Parallelism"
                                               (ICLR 2024), Table 2: idle (p - 1)(T_F + T_B - T_W)
                                               against 1F1B's (p - 1)(T_F + T_B + T_W), here with
                                               T_F = 1, T_B = T_W = 1/2; exact when m >= pp
"""

from minidp.parallel.pipeline.actions import Action, B, F, W, stage_rank
from minidp.parallel.pipeline.dry_run import dry_run
from minidp.parallel.pipeline.lowering import add_send_recv
from minidp.parallel.pipeline.runtime import bind, run_step
from minidp.parallel.pipeline.validate import validate
from minidp.tools.names import PIPELINE_SCHEDULES


class PipelineSchedule:
    """pp ranks, `micro_batches` per step, `virtual` stages per rank (num_stages = pp · V).

    `compute_actions()` is each rank's compute-only order; `actions()` the lowered lists
    (sends and receives added), validated and dry-run once, then kept. An executor runs
    `actions()[rank]` in order and nothing else: nothing is scheduled twice."""

    name = "base"
    split_backward = False  # True: backward is B (input gradient) then, later, W
    needs_virtual = False  # True: the schedule takes V > 1 (interleaved)

    def __init__(self, pp, micro_batches=None, virtual=1, loss_fn=None, *, n_microbatches=None):
        """`pp` ranks, or this rank's PipelineStage (a list of them: interleaved), as
        PyTorch's `ScheduleGPipe(stage, n_microbatches, loss_fn)`: pp is then the stages'
        group size and V the number of stages given, and `step` runs it (runtime.py)."""
        pp, virtual, self.bound = bind(pp, virtual, loss_fn)
        micro_batches = n_microbatches if micro_batches is None else micro_batches
        for arg, value in (("pp", pp), ("micro_batches", micro_batches), ("virtual", virtual)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{arg} must be a positive integer, not {value!r}")
        if virtual > 1 and not self.needs_virtual:
            raise ValueError(
                f"{self.name} puts one stage on each rank: virtual must be 1, not {virtual}"
            )
        self.pp, self.micro_batches, self.virtual = pp, micro_batches, virtual
        self.num_stages = pp * virtual
        self._lowered = None

    def stage_rank(self, stage: int) -> int:
        return stage_rank(stage, self.pp)

    def step(self, *inputs, target=None, losses: list | None = None):
        """One step of the stages this schedule was built from (runtime.step): the first
        stage's rank passes the batch, the last passes `target` and gets each micro-batch's
        loss appended to `losses`; returns the batch's mean loss there, None elsewhere."""
        return run_step(self, inputs, target, losses)

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank `rank` holds, first to last."""
        return list(range(rank, self.num_stages, self.pp))

    def rank_order(self, rank: int) -> list[Action]:
        raise NotImplementedError

    def compute_actions(self) -> list[list[Action]]:
        """Per rank, the compute-only order (F, B and, when split, W)."""
        return [self.rank_order(rank) for rank in range(self.pp)]

    def actions(self) -> list[list[Action]]:
        """Per rank, the lowered order: computes with their sends and receives, checked."""
        if self._lowered is None:
            compute = self.compute_actions()
            sizes = self.pp, self.num_stages, self.micro_batches, self.split_backward
            validate(compute, *sizes)
            lowered = add_send_recv(compute, self.pp, self.num_stages)
            validate(lowered, *sizes)
            dry_run(lowered, self.pp)
            self._lowered = lowered
        return self._lowered

    def __repr__(self) -> str:
        v = f", virtual={self.virtual}" if self.virtual > 1 else ""
        return f"{type(self).__name__}(pp={self.pp}, micro_batches={self.micro_batches}{v})"


class ScheduleGPipe(PipelineSchedule):
    """GPipe (Huang et al., 2019): every forward, then every backward. Holds all m."""

    name = "gpipe"

    def rank_order(self, rank: int) -> list[Action]:
        m = range(self.micro_batches)
        return [Action(rank, F, j) for j in m] + [Action(rank, B, j) for j in m]


class Schedule1F1B(PipelineSchedule):
    """1F1B (PipeDream-Flush, Narayanan et al., 2021): pp - 1 - r warm-up forwards, then one
    forward, one backward; stage r holds at most pp - r micro-batches. Any m >= 1."""

    name = "1f1b"

    def rank_order(self, rank: int) -> list[Action]:
        m = self.micro_batches
        warmup = min(m, self.pp - 1 - rank)
        order = [Action(rank, F, j) for j in range(warmup)]
        for i in range(m - warmup):
            order += [Action(rank, F, warmup + i), Action(rank, B, i)]
        return order + [Action(rank, B, j) for j in range(m - warmup, m)]


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B (Narayanan et al., 2021): V chunks per rank, stage s on rank s % pp,
    the bubble cut by V. Micro-batches go in rounds of g >= pp (g = pp when pp divides m);
    m must split into equal rounds: m % max(1, m // pp) == 0."""

    name = "interleaved"
    needs_virtual = True

    def __init__(self, pp, micro_batches=None, virtual=2, loss_fn=None, *, n_microbatches=None):
        super().__init__(pp, micro_batches, virtual, loss_fn, n_microbatches=n_microbatches)
        pp, micro_batches = self.pp, self.micro_batches
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            raise ValueError(
                f"interleaved runs micro-batches in equal rounds of at least pp={pp}: "
                f"micro_batches={micro_batches} does not split into {rounds} rounds "
                f"(use a multiple of {rounds}, e.g. {rounds * (micro_batches // rounds)})"
            )
        self.per_round = micro_batches // rounds  # g

    def _chunk_and_micro_batch(self, k: int, backward: bool) -> tuple[int, int]:
        g, V = self.per_round, self.virtual
        chunk = (k // g) % V
        micro_batch = (k // (g * V)) * g + k % g
        return (V - 1 - chunk if backward else chunk), micro_batch

    def rank_order(self, rank: int) -> list[Action]:
        total = self.micro_batches * self.virtual
        warmup = min(total, (self.virtual - 1) * self.per_round + 2 * (self.pp - 1 - rank))

        def action(k: int, kind: str) -> Action:
            chunk, j = self._chunk_and_micro_batch(k, backward=kind == B)
            return Action(chunk * self.pp + rank, kind, j)

        order = [action(k, F) for k in range(warmup)]
        for i in range(total - warmup):
            order += [action(warmup + i, F), action(i, B)]
        return order + [action(k, B) for k in range(total - warmup, total)]


class ScheduleZeroBubbleH1(PipelineSchedule):
    """Zero bubble H1 (Qi et al., ICLR 2024): backward split into B (the input gradient,
    sent upstream at once) and W (the weight gradient, deferred into the bubble).

    1F1B's warm-up, then F B as 1F1B does, but rank r keeps its r oldest W's waiting and
    runs one only when more than r wait; the last r run at the very end, where the rank
    would otherwise idle. Every stage then holds at most pp micro-batches (F done, W not):
    1F1B's peak memory (stage 0's), with the bubble cut to (p - 1)(T_F + T_B - T_W)."""

    name = "zb-h1"
    split_backward = True

    def rank_order(self, rank: int) -> list[Action]:
        m = self.micro_batches
        warmup = min(m, self.pp - 1 - rank)
        order = [Action(rank, F, j) for j in range(warmup)]
        waiting: list[int] = []  # micro-batches whose W is deferred, oldest first

        def backward(j: int) -> None:
            order.append(Action(rank, B, j))
            waiting.append(j)
            if len(waiting) > rank:
                order.append(Action(rank, W, waiting.pop(0)))

        for i in range(m - warmup):
            order.append(Action(rank, F, warmup + i))
            backward(i)
        for j in range(m - warmup, m):
            backward(j)
        return order + [Action(rank, W, j) for j in waiting]


ScheduleZBH1 = ScheduleZeroBubbleH1  # the and the paper's short name

SCHEDULES = {
    cls.name: cls
    for cls in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZeroBubbleH1)
}
if tuple(SCHEDULES) != PIPELINE_SCHEDULES:  # the one list (--schedule's choices)
    raise ValueError(f"SCHEDULES names {tuple(SCHEDULES)}, names.py {PIPELINE_SCHEDULES}")


def build_schedule(name: str, pp: int, micro_batches: int, virtual: int = 1) -> PipelineSchedule:
    """The schedule called `name` (a key of SCHEDULES)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {name!r}")
    return SCHEDULES[name](pp, micro_batches, virtual)


__all__ = [
    "SCHEDULES",
    "PipelineSchedule",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleZBH1",
    "ScheduleZeroBubbleH1",
    "build_schedule",
]
