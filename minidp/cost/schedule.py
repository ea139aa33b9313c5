"""`python -m minidp schedule`: a pipeline schedule built, lowered, checked and simulated in
unit time, without running it (no MPI): its grid, length, bubble against the formula and
peak activations per stage (minidp/parallel/pipeline/: schedules, simulate, diagram).

    python -m minidp schedule --pp 4 --micro-batches 8 --schedule 1f1b --png 1f1b.png
    python -m minidp schedule --table       # every schedule's bubble against its formula
"""

import argparse
import re

from minidp.tools.log import die, print0
from minidp.tools.parser import Parser


def schedule_parser() -> argparse.ArgumentParser:
    from minidp.parallel.pipeline.schedules import SCHEDULES

    parser = Parser(
        prog="minidp schedule",
        description="Build, lower, check and simulate a pipeline schedule (unit time; no MPI).",
    )
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default: 4)")
    parser.add_argument(
        "--micro-batches", type=int, default=8, help="micro-batches per step (default: 8)"
    )
    parser.add_argument(
        "--schedule", choices=tuple(SCHEDULES), default="1f1b", help="(default: 1f1b)"
    )
    parser.add_argument(
        "--virtual", type=int, default=None, help="stages per rank, interleaved only (default: 2)"
    )
    parser.add_argument("--json", metavar="FILE", help="save the figures and the action lists")
    parser.add_argument("--png", metavar="FILE", help="save the time diagram")
    parser.add_argument(
        "--table",
        action="store_true",
        help="instead: every schedule's bubble against its formula, pp 2, 4 and m 1, 2, 4, 8",
    )
    return parser


SCHEDULE_FLAGS = {"pp": "--pp", "micro_batches": "--micro-batches", "virtual": "--virtual"}
# an argument the library names with its value ("pp=3") or as the subject of its rule
# ("virtual must be 1"), never the same word inside a formula ("stage s on rank s % pp")
_SCHEDULE_ARGUMENT = re.compile(r"(?<![\w-])(pp|micro_batches|virtual)(?==|\s+must\b)")


def schedule_flags(message: str) -> str:
    """A library message about schedule arguments with the arguments named as flags."""
    return _SCHEDULE_ARGUMENT.sub(lambda m: SCHEDULE_FLAGS[m[1]], message)


def main(argv: list[str]) -> int:
    """`python -m minidp schedule ...`: the grid, the length, the bubble against its
    formula, the peak activations per stage; a schedule the library refuses is one line."""
    import json

    from minidp.parallel.pipeline.diagram import grid, time_diagram
    from minidp.parallel.pipeline.schedules import build_schedule
    from minidp.parallel.pipeline.simulate import bubble_table, simulate, summary

    args = schedule_parser().parse_args(argv)
    virtual = args.virtual
    if args.table:
        print0(bubble_table(virtual=virtual or 2))
        return 0
    if virtual is None:
        virtual = 2 if args.schedule == "interleaved" else 1
    try:
        schedule = build_schedule(args.schedule, args.pp, args.micro_batches, virtual)
        lowered = schedule.actions()
    except ValueError as error:  # the library names its arguments; say the flags
        raise die(f"--schedule {args.schedule}: {schedule_flags(str(error))}") from None
    figures = summary(schedule)
    timeline = simulate(lowered, schedule.pp, schedule.num_stages, schedule.split_backward)
    unit = "F = 1, B = W = 1/2" if schedule.split_backward else "F = B = 1"
    holds = "" if figures["formula_holds"] else "; the formula assumes a full pipeline"
    peaks = " ".join(f"{s}:{n}" for s, n in figures["peak_activations_per_stage"].items())
    print0(
        f"{schedule!r}: {schedule.num_stages} stages, stage s on rank s % {schedule.pp}\n"
        f"{grid(timeline)}\n"
        f"length: {figures['length']:g} (unit time, {unit})\n"
        f"idle per rank: {' '.join(f'{r}:{t:g}' for r, t in enumerate(figures['idle_per_rank']))}\n"
        f"bubble fraction: {figures['bubble_fraction']:.4f} "
        f"(formula {figures['formula']} = {figures['formula_bubble']:.4f}{holds})\n"
        f"peak activations per stage (micro-batches held): {peaks}"
    )
    if args.json:
        record = {**figures, "actions": [[str(a) for a in row] for row in lowered]}
        with open(args.json, "w") as file:
            json.dump(record, file, indent=1)
    if args.png:
        time_diagram(timeline, args.png, title=repr(schedule))
    return 0
