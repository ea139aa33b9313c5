"""simulate: the schedule's timeline in unit time, its bubble, and its activation memory.

Each rank runs its compute actions in order; an action starts when its rank is free and
what it needs has ended (F of s needs F of s - 1; B of s needs B of s + 1; W needs B);
messages take no time. F = B = 1 unit; a split backward is B = W = 1/2 (time is counted
in ticks of 1/2). From the timeline:

    length           the last action's end, in units
    idle(rank)       length - the rank's busy time
    bubble fraction  sum of idle / (pp · length)
    peak activations the most micro-batches a stage holds at once: +1 at its F, -1 at its
                     B (or at its W when split: W still needs the stage's inputs)
    per rank         the most its stages hold together at once: at most, and with V > 1
                     less than, the sum of their peaks (they peak at different times)

GPipe's peak is m on every stage; 1F1B's min(m, pp - s) on stage s (Narayanan et al. 2021);
ZB-H1's min(m, pp) on every stage (the deferred W's hold theirs longer).

Memory's unit: one stage's activations of one micro-batch (a "stage-micro-batch"). A stage
is 1/S of the model, S = pp · V: with V > 1 a stage is 1/V of what one rank holds, so a
rank's count divided by V is in stage-micro-batches of a full-size stage (1/pp of the
model, 1F1B's). Interleaved 1F1B's first rank holds p (1 + (p-1)/(pV)) full-size ones:
1F1B's p, times 1 + (p-1)/(pV) (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", for Megatron-LM's interleaved schedule). In
this unit that is V p + p - 1: the warm-up's (V-1) p + 2(p-1) forwards and the steady
state's one more (schedules.py), exact when pp divides m (rounds of g = pp micro-batches).

The formulas each schedule is compared against are `formula_bubble` (see schedules.py) and
`formula_peak_first_rank`.
"""

from dataclasses import dataclass, field

from minidp.parallel.pipeline.actions import TICKS_PER_UNIT, Action, B, F, W, ticks
from minidp.parallel.pipeline.lowering import needs
from minidp.parallel.pipeline.schedules import SCHEDULES, build_schedule


@dataclass
class Timeline:
    """The simulated run: (start, end) in ticks of each rank's compute actions, in order."""

    pp: int
    num_stages: int
    split_backward: bool
    rows: list[list[tuple[int, int, Action]]]
    peak_activations: dict[int, int] = field(default_factory=dict)  # stage -> peak

    @property
    def length_ticks(self) -> int:
        return max((row[-1][1] for row in self.rows if row), default=0)

    @property
    def length(self) -> float:
        """In units (F = 1)."""
        return self.length_ticks / TICKS_PER_UNIT

    def idle(self, rank: int) -> float:
        busy = sum(end - start for start, end, _ in self.rows[rank])
        return (self.length_ticks - busy) / TICKS_PER_UNIT

    @property
    def bubble_fraction(self) -> float:
        total_idle = sum(self.idle(r) for r in range(self.pp))
        return total_idle / (self.pp * self.length) if self.length else 0.0


def simulate(
    compute: list[list[Action]],
    pp: int,
    num_stages: int,
    split_backward: bool,
    duration=None,
    delay=None,
) -> Timeline:
    """Time per-rank compute lists (messages, if any, are skipped: they take no time).

    Given `duration(action)` and `delay(need, action)` (numbers in any one unit: the step
    model's seconds, cost/pp_step.py), each action lasts its duration and
    starts `delay` after what it needs has ended when that ran on another rank (the
    message); the Timeline's ticks are then that unit (read `length_ticks`)."""
    if duration is None:
        duration = lambda action: ticks(action.kind, split_backward)  # noqa: E731
    rank_of = lambda action: action.stage % pp  # noqa: E731
    orders = [[a for a in order if a.is_compute] for order in compute]
    rows: list[list[tuple[int, int, Action]]] = [[] for _ in orders]
    end: dict[Action, int] = {}
    free = [0] * len(orders)
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            while len(rows[rank]) < len(order):
                action = order[len(rows[rank])]
                need = needs(action, num_stages)
                if need is not None and need not in end:
                    break
                ready = 0 if need is None else end[need]
                if need is not None and delay is not None and rank_of(need) != rank:
                    ready += delay(need, action)
                start = max(free[rank], ready)
                free[rank] = end[action] = start + duration(action)
                rows[rank].append((start, free[rank], action))
                moved = True
    stuck = [r for r in range(len(orders)) if len(rows[r]) < len(orders[r])]
    if stuck:
        r = stuck[0]
        raise ValueError(f"rank {r} step {len(rows[r])}: {orders[r][len(rows[r])]} never starts")
    return Timeline(pp, num_stages, split_backward, rows, peak_activations(orders, split_backward))


def peak_activations(compute: list[list[Action]], split_backward: bool) -> dict[int, int]:
    """stage -> the most micro-batches whose activations it holds at once."""
    release = W if split_backward else B
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for order in compute:
        for action in order:
            if action.kind == F:
                held[action.stage] = held.get(action.stage, 0) + 1
                peak[action.stage] = max(peak.get(action.stage, 0), held[action.stage])
            elif action.kind == release:
                held[action.stage] -= 1
    return dict(sorted(peak.items()))


def peak_activations_per_rank(compute: list[list[Action]], split_backward: bool) -> list[int]:
    """rank -> the most micro-batches whose activations its stages hold together at once."""
    release = W if split_backward else B
    peaks = []
    for order in compute:
        held = peak = 0
        for action in order:
            held += (action.kind == F) - (action.kind == release)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def formula_holds(name: str, pp: int, micro_batches: int) -> bool:
    """Whether the simulated bubble equals `formula_bubble` exactly: always for GPipe and
    1F1B; interleaved when pp divides m; ZB-H1 when m >= pp (a shorter pipeline never fills)."""
    if name == "interleaved":
        return micro_batches % pp == 0
    if name == "zb-h1":
        return micro_batches >= pp
    return True


FORMULAS = {  # schedule -> its bubble fraction in unit time: as text, and as a function
    "gpipe": ("(p-1)/(m+p-1)", lambda p, m, V: (p - 1) / (m + p - 1)),
    "1f1b": ("(p-1)/(m+p-1)", lambda p, m, V: (p - 1) / (m + p - 1)),
    "interleaved": ("(p-1)/(V*m+p-1)", lambda p, m, V: (p - 1) / (V * m + p - 1)),
    # (p-1)(T_F + T_B - T_W) idle against m (T_F + T_B + T_W) of work, T_F = 1, T_B = T_W = 1/2
    "zb-h1": ("(p-1)/(2*m+p-1)", lambda p, m, V: (p - 1) / (2 * m + p - 1)),
}


def formula_bubble(name: str, pp: int, micro_batches: int, virtual: int = 1) -> float:
    """The textbook bubble fraction (FORMULAS), in this module's unit time."""
    if name not in FORMULAS:
        raise ValueError(f"no formula for schedule {name!r}")
    return FORMULAS[name][1](pp, micro_batches, virtual)


PEAK_FORMULAS = {  # schedule -> rank 0's peak activations, in stage-micro-batches (above)
    "gpipe": ("m", lambda p, m, V: m),
    "1f1b": ("min(m, p)", lambda p, m, V: min(m, p)),
    # V p (1 + (p-1)/(pV)) = V p + p - 1, and no more than its V m forwards
    "interleaved": ("min(V*m, V*p*(1+(p-1)/(p*V)))", lambda p, m, V: min(V * m, V * p + p - 1)),
    "zb-h1": ("min(m, p)", lambda p, m, V: min(m, p)),
}


def formula_peak_first_rank(name: str, pp: int, micro_batches: int, virtual: int = 1) -> int:
    """Rank 0's peak activations by the formula (PEAK_FORMULAS), in stage-micro-batches, the
    unit of `peak_activations_per_rank` (divide by V for full-size stages). Rank 0 holds the
    most; the simulator equals it for GPipe, 1F1B and ZB-H1, and for interleaved when pp
    divides m (otherwise rounds of g > pp micro-batches lengthen the warm-up)."""
    if name not in PEAK_FORMULAS:
        raise ValueError(f"no formula for schedule {name!r}")
    return PEAK_FORMULAS[name][1](pp, micro_batches, virtual)


def summary(schedule) -> dict:
    """A schedule's simulated figures beside its formula's (the CLI prints and saves this)."""
    timeline = simulate(
        schedule.compute_actions(), schedule.pp, schedule.num_stages, schedule.split_backward
    )
    name, pp, m = schedule.name, schedule.pp, schedule.micro_batches
    return {
        "schedule": name,
        "pp": pp,
        "micro_batches": m,
        "virtual": schedule.virtual,
        "num_stages": schedule.num_stages,
        "split_backward": schedule.split_backward,
        "length": timeline.length,
        "idle_per_rank": [timeline.idle(r) for r in range(pp)],
        "bubble_fraction": timeline.bubble_fraction,
        "formula": FORMULAS[name][0],
        "formula_bubble": formula_bubble(name, pp, m, schedule.virtual),
        "formula_holds": formula_holds(name, pp, m),
        "peak_activations_per_stage": timeline.peak_activations,
        "peak_activations_per_rank": peak_activations_per_rank(
            schedule.compute_actions(), schedule.split_backward
        ),
        "formula_peak_first_rank": formula_peak_first_rank(name, pp, m, schedule.virtual),
    }


def bubble_table(pps=(2, 4), micro_batches=(1, 2, 4, 8), virtual: int = 2) -> str:
    """Every schedule's simulated bubble beside its formula, for each pp and m (interleaved
    with `virtual` stages per rank), as a markdown table; "(not exact)" where the formula's
    assumption (formula_holds) fails."""
    lines = [
        "| schedule | pp | m | V | length | bubble (simulated) | formula | formula's value |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, cls in SCHEDULES.items():
        for pp in pps:
            for m in micro_batches:
                row = summary(build_schedule(name, pp, m, virtual if cls.needs_virtual else 1))
                value = f"{row['formula_bubble']:.4f}"
                value += "" if row["formula_holds"] else " (not exact)"
                lines.append(
                    f"| {name} | {pp} | {m} | {row['virtual']} | {row['length']:g} "
                    f"| {row['bubble_fraction']:.4f} | {row['formula']} | {value} |"
                )
    return "\n".join(lines)


__all__ = [
    "FORMULAS",
    "PEAK_FORMULAS",
    "Timeline",
    "bubble_table",
    "formula_bubble",
    "formula_holds",
    "formula_peak_first_rank",
    "peak_activations",
    "peak_activations_per_rank",
    "simulate",
    "summary",
]
