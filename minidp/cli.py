"""The command line: `python -m minidp [train|bench|info] ...`.

    python -m minidp                      # train the tiny GPT on one process (train is the default)
    mpiexec -n 4 python -m minidp         # the same job, data parallel over 4 ranks
    python -m minidp bench autograd       # a benchmark (minidp/bench/<name>.py)
    python -m minidp info                 # versions, BLAS, MPI library, world size

Flags of `train` are generated from TrainConfig (config.py). A bad flag or value is one clear
line on stderr, never a traceback.
"""

import argparse
import importlib
import pkgutil
import sys
import types

from minidp.config import TrainConfig, config_fields
from minidp.log import die

SUBCOMMANDS = ("train", "bench", "info")


class _Parser(argparse.ArgumentParser):
    """argparse that exits with one line (`minidp: error: ...`) instead of usage + message."""

    def error(self, message):
        raise die(f"{message} (see `python -m minidp {self.prog.split()[-1]} --help`)")


def _field_type(annotation):
    if isinstance(annotation, types.UnionType):  # `str | None` -> str
        return next(a for a in annotation.__args__ if a is not type(None))
    return annotation


def train_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minidp train", description="Train a model (see config.py).")
    for name, default, annotation, meta in config_fields():
        flag = "--" + name.replace("_", "-")
        kind = _field_type(annotation)
        parser.add_argument(
            flag,
            dest=name,
            type=kind,
            default=default,
            choices=meta.get("choices"),
            metavar=name.upper(),
            help=f"{meta['help']} (default: {default})",
        )
    return parser


def parse_train_args(argv: list[str]) -> TrainConfig:
    args = train_parser().parse_args(argv)
    config = TrainConfig(**vars(args))
    try:
        config.validate()
    except ValueError as error:
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
        print("usage: python -m minidp bench NAME [options]\n\nbenchmarks: " + ", ".join(names))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        raise die(f"unknown benchmark {name!r}; choose from: {', '.join(names)}")
    module = importlib.import_module(f"minidp.bench.{name}")
    return module.main(rest) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    command = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "train"
    if command == "info":
        from minidp.info import main as info_main

        return info_main(argv)
    if command == "bench":
        return run_bench(argv)
    config = parse_train_args(argv)
    from minidp.train import TrainingDiverged, train

    try:
        train(config)
    except TrainingDiverged as error:
        raise die(str(error), code=1) from None
    return 0


__all__ = ["main", "parse_train_args", "train_parser"]
