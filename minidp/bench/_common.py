"""What every benchmark shares: medians, environment facts, a plain table, JSON lines."""

import json
import platform
import resource
import statistics
import time

import numpy as np

from minidp.info import blas_info


def summary(doc: str) -> str:
    """A module docstring's first paragraph as one line: a benchmark's --help description."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def add_round_options(parser, iters: int, warmup: int) -> None:
    """--iters, --warmup and --json, as most benchmarks take them."""
    parser.add_argument("--iters", type=int, default=iters, help=f"timed rounds (default {iters})")
    parser.add_argument(
        "--warmup", type=int, default=warmup, help=f"untimed rounds (default {warmup})"
    )
    parser.add_argument("--json", metavar="FILE", help="write JSON lines")


def median(values) -> float:
    return float(statistics.median(values))


def median_ratio(times_a: list[float], times_b: list[float]) -> float:
    """The median over rounds of time_a / time_b (the per-round ratio: drift that slows one
    round slows both of its contenders alike)."""
    return median(a / b for a, b in zip(times_a, times_b, strict=True))


def timed(call, mpi) -> tuple[float, int]:
    """One timed call: Barrier (all start together), time it, then the max over ranks (a
    collective takes as long as its slowest rank). Returns (the slowest rank's seconds, this
    rank's minor page faults during the call)."""
    from mpi4py import MPI  # here: the serial benchmarks never start MPI

    mpi.Barrier()
    faults = minor_faults()
    start = time.perf_counter()
    call()
    elapsed = time.perf_counter() - start
    faults = minor_faults() - faults
    return mpi.allreduce(elapsed, op=MPI.MAX), faults


def rotated_rounds(
    steps: dict, warmup: int, iters: int, mpi, on_timing=None, faults: dict | None = None
) -> dict:
    """Call every step once per round, warmup + iters rounds, the order rotated by one each
    round (A B C, B C A, C A B, ...) so that no contender always runs after the same one.
    Each call is timed as the slowest rank's (`timed`); `on_timing()` runs once before the
    first timed round. Returns {name: [seconds, one per timed round]}; given a dict
    `faults`, fills it alike with this rank's minor page faults per timed call."""
    names = list(steps)
    times: dict = {name: [] for name in names}
    for i in range(warmup + iters):
        if i == warmup and on_timing is not None:
            on_timing()
        k = i % len(names)
        for name in names[k:] + names[:k]:
            elapsed, faulted = timed(steps[name], mpi)
            if i >= warmup:
                times[name].append(elapsed)
                if faults is not None:
                    faults.setdefault(name, []).append(faulted)
    return times


def minor_faults() -> int:
    """This process's minor page faults so far: a first touch of a fresh 4 KiB page each."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def max_over_ranks(value: float, mpi) -> float:
    from mpi4py import MPI

    return mpi.allreduce(value, op=MPI.MAX)


def per_timed_step_ms(seconds: float, iters: int, mpi) -> float:
    """A DDP's comm_seconds or exposed_seconds over `iters` steps: the slowest rank's, in
    milliseconds per step."""
    return 1e3 * max_over_ranks(seconds, mpi) / iters


def zero_comm_seconds(ddps) -> None:
    """Forget the warm-up rounds: count communication and exposed time from here on."""
    for ddp in ddps:
        ddp.reset_timers()


def environment() -> dict:
    import os

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": blas_info(),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
    }


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Print rows as an aligned table; columns are (key, format spec) pairs."""
    cells = [
        [format(r[k], spec) if r.get(k) is not None else "-" for k, spec in columns] for r in rows
    ]
    heads = [k for k, _ in columns]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)
    ]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths)), flush=True)
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)), flush=True)


def write_json(path: str | None, records: list[dict]) -> None:
    """Write the records to path (replacing it), one JSON object per line."""
    if not path:
        return
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
