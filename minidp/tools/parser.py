"""Parser: the argument parser every minidp command line uses (train, bench NAME, info).

It lives here, below commands.py, so that a benchmark builds its flags without importing the
whole command line (and, through it, the trainer). It needs only log.py:

    log.py  <-  parser.py  <-  commands.py (train flags from TrainConfig)
                           <-  bench/*.py (each benchmark's flags)
"""

import argparse

from minidp.tools.log import die, world_rank


class Parser(argparse.ArgumentParser):
    """argparse that exits with one line (`minidp: error: ...`) instead of usage + message,
    printed once (rank 0); `prog` is "minidp train", "minidp bench dp", ..."""

    def error(self, message):
        raise die(f"{message} (see `python -m {self.prog} --help`)")

    def print_help(self, file=None):  # --help under mpiexec: once, not once per rank
        if world_rank() == 0:
            super().print_help(file)


__all__ = ["Parser"]
