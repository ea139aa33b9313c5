"""Parser: the argument parser every minidp command line uses (train, bench NAME, info).

It lives here, below commands.py, so that a benchmark builds its flags without importing the
whole command line (and, through it, the trainer). It needs only log.py:

    log.py  <-  parser.py  <-  commands.py (train flags from TrainConfig, add_fields)
                           <-  bench/*.py (each benchmark's flags)
"""

import argparse
import types

from minidp.tools.log import die, world_rank


class Parser(argparse.ArgumentParser):
    """argparse that exits with one line (`minidp: error: ...`) instead of usage + message,
    printed once (rank 0); `prog` is "minidp train", "minidp bench dp", ..."""

    def error(self, message):
        raise die(f"{message} (see `python -m {self.prog} --help`)")

    def print_help(self, file=None):  # --help under mpiexec: once, not once per rank
        if world_rank() == 0:
            super().print_help(file)


def add_fields(parser: argparse.ArgumentParser, fields) -> argparse.ArgumentParser:
    """One flag per (name, default, annotation, meta) of a dataclass's fields: `--name-with-
    dashes`, its type from the annotation (`str | None` is str; a bool is a switch), its
    help and choices from the field's metadata. `meta["shown"]`: the default as --help
    says it, where the value itself would mislead (None meaning "a fraction of --steps")."""
    for name, default, annotation, meta in fields:
        flag = "--" + name.replace("_", "-")
        kind = annotation
        if isinstance(annotation, types.UnionType):  # `str | None` -> str
            kind = next(a for a in annotation.__args__ if a is not type(None))
        if kind is bool:
            parser.add_argument(flag, dest=name, action="store_true", help=meta["help"])
            continue
        parser.add_argument(
            flag, dest=name, type=kind, default=default, choices=meta.get("choices"),
            metavar=name.upper(), help=f"{meta['help']} (default: {meta.get('shown', default)})",
        )  # fmt: skip
    return parser


__all__ = ["Parser", "add_fields"]
