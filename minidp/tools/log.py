"""Printing in a many-process job: rank 0 talks to the terminal, every rank may keep a log.

Public: `print0`, `die`, `JobError`, `RunStopped`, `RankLog` and `world_rank` (tutorials
and benchmarks use them).

Who prints how, so lines never interleave across ranks:
- the library, the command line and the multi-rank tutorials (03-05) print progress with
  `print0` only;
- bad input is one line on stderr from rank 0, through `die`; per-rank detail goes to a
  `RankLog` file, never to the terminal;
- the single-process tutorials (01, 02) use plain `print`: there is only one rank;
- the benchmarks print their tables with plain `print`, from rank 0 only (bench autograd
  is serial: from its one process).
One exception: `minidp info` warns on stderr from every rank when MPI sees a world of one
under a launcher of many, since then every process is its own rank 0.
"""

import os
import sys


def world_rank() -> int:
    """This process's world rank, read from the launcher's environment (0 without one), so
    printing never initializes MPI itself."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def print0(*args, rank: int | None = None, **kwargs) -> None:
    """print() on rank 0 only, flushed at once."""
    if (world_rank() if rank is None else rank) == 0:
        print(*args, **kwargs, flush=True)


def die(message: str, code: int = 2, label: str = "error") -> "SystemExit":
    """One clear line on stderr (from rank 0 only: every rank finds the same bad input) and
    an exit code, for bad input. No traceback. Raise what it returns."""
    if world_rank() == 0:
        print(f"minidp: {label}: {message}", file=sys.stderr, flush=True)
    return SystemExit(code)


class RunStopped(RuntimeError):
    """The run stopped for a reason every rank found alike, at the same step (a loss that
    diverged, a save that failed, a signal they agreed on): the command line prints the
    one line from rank 0 and every rank exits with `code`, no abort needed."""

    code, label = 1, "error"


class JobError(RuntimeError):
    """An error found while the job runs whose message says all there is to say (a silent
    parameter-server worker, say): the command line prints it as one line, no traceback, and
    ends the job on every rank (exit code 1).

    `reported_elsewhere=True` marks a rank that learned of it from the rank that found it:
    that one prints, this one stays silent, so the cause is printed once."""

    turn = "now"  # found by one rank: it speaks at once (comm/abort.py's turns)

    def __init__(self, message: str, *, reported_elsewhere: bool = False):
        super().__init__(message)
        self.reported_elsewhere = reported_elsewhere


class RankLog:
    """One log file per rank (`--log-dir DIR` -> DIR/rank0.log, DIR/rank1.log, ...), line
    buffered: each line reaches the file as it is written, so a killed rank keeps its log."""

    def __init__(self, directory: str | None, rank: int):
        self.file = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self.file = open(os.path.join(directory, f"rank{rank}.log"), "w", buffering=1)

    def write(self, line: str) -> None:
        if self.file:
            self.file.write(line + "\n")

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
