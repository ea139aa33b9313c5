"""The command line: `python -m minidp [train|bench|info|schedule|plot|predict|simulate] ...`.

    python -m minidp                      # train the tiny GPT on one process (train is the default)
    mpiexec -n 4 python -m minidp         # the same job, data parallel over 4 ranks
    python -m minidp distill --teacher DIR --n-layer 1 --n-embd 32   # a student of a saved run
    python -m minidp bench autograd       # a benchmark (minidp_bench/<name>.py)
    python -m minidp info                 # versions, BLAS, MPI library, world size
    python -m minidp schedule --pp 4 --micro-batches 8 --schedule 1f1b   # a pipeline schedule
    python -m minidp plot dp.jsonl zero.jsonl --png loss.png   # loss curves of --json files
    python -m minidp predict --strategy zero --zero-stage 2 --world 4     # a step's cost
    python -m minidp simulate --nprocs 1024 --model-params 1.3e9   # 1,024 ranks, modelled

Flags of `train` are generated from TrainConfig (training/config.py). A bad flag or value is one
clear line on stderr, never a traceback.
"""

import argparse
import importlib
import sys

from minidp.cli.training.config import BadConfig, TrainConfig, config_fields
from minidp.comm.abort import end_job
from minidp.fast.allocator import keep_freed_memory
from minidp.parallel.param_server.membership import end_without
from minidp.tools.log import RunStopped, die, print0
from minidp.tools.parser import Parser, add_fields  # below: the benchmarks take it there

SUBCOMMANDS = ("train", "distill", "bench", "info", "schedule", "plot", "predict", "simulate")


def train_parser() -> argparse.ArgumentParser:
    from minidp.cli.strategies import STRATEGIES  # the one table of --strategy names

    fields = []
    for name, default, annotation, meta in config_fields():
        if name == "strategy":
            meta = {**meta, "choices": tuple(STRATEGIES)}
        if "of_steps" in meta:  # unset: a fraction of --steps (training/config.py)
            numerator, denominator, least = meta["of_steps"]
            shown = (f"{numerator} x " if numerator > 1 else "") + f"steps / {denominator}"
            meta = {**meta, "shown": shown + (f", at least {least}" if least else "")}
        fields.append((name, default, annotation, meta))
    description = "Train a model (see training/config.py)."
    return add_fields(Parser(prog="minidp train", description=description), fields)


def parse_train_args(argv: list[str]) -> TrainConfig:
    args = train_parser().parse_args(argv)
    config = TrainConfig(**vars(args))
    try:
        config.validate()
    except BadConfig as error:
        raise die(str(error)) from None
    return config


# The tools beside the face, above it in the layers (minidp/__init__.py): the face never
# imports them; a command names its module here, imported when the command runs.
TOOLS = {
    "predict": "minidp.cost.predict",  # a run's step cost, before running it
    "simulate": "minidp.cost.simulate",  # 1,024 ranks from the cost model
    "schedule": "minidp.cost.schedule",  # a pipeline schedule in unit time: its bubble
    "bench": "minidp_bench",  # the benchmarks, beside the package: minidp_bench/NAME.py
}
PREDICTION = "minidp.cost.predicted"  # a --json run's predicted_* fields (in_record)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print0(__doc__.strip())
        return 0
    command = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "train"
    check_environment()
    keep_freed_memory()  # freed arrays stay mapped: no page faults each step (allocator.py)
    if command == "info":
        from minidp.tools.info import main as info_main

        return info_main(argv)
    if command == "plot":
        from minidp.tools.loss_curves import main as plot_main

        return plot_main(argv)
    if command in TOOLS:
        try:
            return importlib.import_module(TOOLS[command]).main(argv) or 0
        except SystemExit:  # die(): bad input, found alike on every rank
            raise
        except BaseException as error:  # a benchmark's rank that fails ends the job
            end_job(error)
            raise
    config = parse_train_args(argv)
    if command == "distill" and config.teacher is None:  # train's flags, a teacher required
        raise die("minidp distill: give --teacher DIR (a run's --save-dir)")
    from minidp.cli.training.loop import train

    try:
        # SIGTERM & co. stop it (parallel/checkpoint/preemption.py); the record gains the prediction
        final = train(config, signals=True, adds=[importlib.import_module(PREDICTION).in_record])
    except BadConfig as error:  # found on every rank alike: one line, every rank exits
        raise die(str(error)) from None
    except RunStopped as error:  # a divergence, a failed save, a signal: every rank alike
        raise die(str(error), code=error.code, label=error.label) from None
    except BaseException as error:
        end_job(error)
        raise
    if final.get("workers_not_ended"):
        end_without(final["workers_not_ended"])  # parallel/param_server/membership.py
    return 0


def check_environment() -> None:
    """The variables minidp reads (MINIDP_TIMEOUT, MINIDP_NET_*), checked before any rank
    uses them: one line and exit code 2 for a bad value, on every rank alike."""
    from minidp.comm.checks import timeout_from_env
    from minidp.comm.netem import from_env

    try:
        timeout_from_env(checks=True)
        from_env()
    except ValueError as error:
        raise die(str(error)) from None


__all__ = ["main", "parse_train_args", "train_parser", "end_job"]
