"""The command line: `python -m minidp [train|bench|info] ...`.

    python -m minidp                      # train the tiny GPT on one process (train is the default)
    mpiexec -n 4 python -m minidp         # the same job, data parallel over 4 ranks
    python -m minidp bench autograd       # a benchmark (minidp/bench/<name>.py)
    python -m minidp info                 # versions, BLAS, MPI library, world size

Flags of `train` are generated from TrainConfig (training/config.py). A bad flag or value is one
clear line on stderr, never a traceback.
"""

import argparse
import importlib
import pkgutil
import sys
import types

from minidp.log import JobError, die, print0
from minidp.parser import Parser  # below cli.py: the benchmarks take it from there
from minidp.training.config import BadConfig, TrainConfig, config_fields

SUBCOMMANDS = ("train", "bench", "info")


def _field_type(annotation):
    if isinstance(annotation, types.UnionType):  # `str | None` -> str
        return next(a for a in annotation.__args__ if a is not type(None))
    return annotation


def train_parser() -> argparse.ArgumentParser:
    from minidp.strategies import STRATEGIES  # the one table of --strategy names

    parser = Parser(prog="minidp train", description="Train a model (see training/config.py).")
    for name, default, annotation, meta in config_fields():
        if name == "strategy":
            meta = {**meta, "choices": tuple(STRATEGIES)}
        flag = "--" + name.replace("_", "-")
        kind = _field_type(annotation)
        if kind is bool:
            parser.add_argument(flag, dest=name, action="store_true", help=meta["help"])
            continue
        shown = default
        if "of_steps" in meta:  # unset: a fraction of --steps (training/config.py)
            numerator, denominator, least = meta["of_steps"]
            shown = f"{numerator} x " if numerator > 1 else ""
            shown += f"steps / {denominator}" + (f", at least {least}" if least else "")
        parser.add_argument(
            flag,
            dest=name,
            type=kind,
            default=default,
            choices=meta.get("choices"),
            metavar=name.upper(),
            help=f"{meta['help']} (default: {shown})",
        )
    return parser


def parse_train_args(argv: list[str]) -> TrainConfig:
    args = train_parser().parse_args(argv)
    config = TrainConfig(**vars(args))
    try:
        config.validate()
    except BadConfig as error:
        raise die(str(error)) from None
    return config


def benchmarks() -> list[str]:
    import minidp.bench

    return sorted(
        m.name for m in pkgutil.iter_modules(minidp.bench.__path__) if not m.name.startswith("_")
    )


def run_bench(argv: list[str]) -> int:
    names = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print0("usage: python -m minidp bench NAME [options]\n\nbenchmarks: " + ", ".join(names))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        raise die(f"unknown benchmark {name!r}; choose from: {', '.join(names)}")
    module = importlib.import_module(f"minidp.bench.{name}")
    return module.main(rest) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print0(__doc__.strip())
        return 0
    command = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "train"
    check_environment()
    if command == "info":
        from minidp.info import main as info_main

        return info_main(argv)
    if command == "bench":
        try:
            return run_bench(argv)
        except SystemExit:  # die(): bad input, found alike on every rank
            raise
        except BaseException as error:
            end_job(error)
            raise
    config = parse_train_args(argv)
    from minidp.training.loop import TrainingDiverged, train

    try:
        train(config)
    except BadConfig as error:  # found on every rank alike: one line, every rank exits
        raise die(str(error)) from None
    except TrainingDiverged as error:  # judged on the global loss: every rank alike
        raise die(str(error), code=1) from None
    except BaseException as error:
        end_job(error)
        raise
    return 0


def check_environment() -> None:
    """The variables minidp reads (MINIDP_TIMEOUT), checked before any rank uses them: one
    line and exit code 2 for a bad value, on every rank alike."""
    from minidp.comm.checks import timeout_from_env

    try:
        timeout_from_env(checks=True)
    except ValueError as error:
        raise die(str(error)) from None


def end_job(error: BaseException) -> None:
    """An error on one rank ends the whole job at once (MPI_Abort), its cause printed once.

    Without this the other ranks would wait forever in their next collective. The cause is
    the rank's traceback, or for a JobError its one line. A rank whose error another rank
    reports (`reported_elsewhere`) prints nothing and gives that rank time to abort first.
    Alone (no other rank to stop) it returns, and a JobError becomes one line, exit code 1."""
    one_line = isinstance(error, JobError)
    if not _other_ranks_running():
        if one_line:
            raise die(str(error), code=1) from None
        return
    import os
    import time
    import traceback

    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    if getattr(error, "reported_elsewhere", False):
        report, grace = "", 10.0  # the rank that found it prints and aborts: that ends us
    elif one_line:
        report, grace = f"minidp: error: {error}\n", 0.5
    else:
        report = f"minidp: rank {rank} failed; aborting all ranks. Root cause:\n"
        report, grace = report + traceback.format_exc(), 0.5
    sys.stderr.flush()
    os.write(2, report.encode())  # one write, unbuffered
    time.sleep(grace)  # let the launcher forward it before the abort tears the job down
    MPI.COMM_WORLD.Abort(1)
    os._exit(1)  # Abort may return before the launcher kills us: print nothing more


def _other_ranks_running() -> bool:
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI

    return MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1


__all__ = ["main", "parse_train_args", "train_parser", "end_job"]
