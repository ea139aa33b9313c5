"""What every benchmark shares: medians, environment facts, a plain table, JSON lines."""

import json
import platform
import resource
import statistics
import time

import numpy as np

from minidp.tools.info import blas_info
from minidp.tools.meter import AXES


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
    steps: dict,
    warmup: int,
    iters: int,
    mpi,
    on_timing=None,
    faults: dict | None = None,
    after: dict | None = None,
) -> dict:
    """Call every step once per round, warmup + iters rounds, the order rotated by one each
    round (A B C, B C A, C A B, ...) so that no contender always runs after the same one.
    Each call is timed as the slowest rank's (`timed`); `on_timing()` runs once before the
    first timed round; `after[name]()`, if given, runs untimed after each call of `name`
    (to clean up). Returns {name: [seconds, one per timed round]}; given a dict `faults`,
    fills it alike with this rank's minor page faults per timed call."""
    names = list(steps)
    times: dict = {name: [] for name in names}
    for i in range(warmup + iters):
        if i == warmup and on_timing is not None:
            on_timing()
        k = i % len(names)
        for name in names[k:] + names[:k]:
            elapsed, faulted = timed(steps[name], mpi)
            if after and name in after:
                after[name]()
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


class Contender:
    """One strategy built on `world` from `config`, stepping the same global batches as every
    other contender (the sampler's seed), its losses kept: a row of the tp and mesh benches.
    A context manager: `close()` (collective) frees its communicators."""

    def __init__(self, config, world, lr: float = 1e-3):
        from minidp.cli.strategies import STRATEGIES
        from minidp.models.data import DistributedSampler
        from minidp.models.tasks import Task

        self.config, self.lr, self.losses = config, lr, []
        self.timed_from, self.bytes_before = 0, {}
        dtype = np.dtype(config.dtype).type
        self.strategy = s = STRATEGIES[config.strategy](Task(config, dtype), config, world)
        self.sampler = DistributedSampler(
            s.task.num_examples, config.batch_size, *s.data_shard, seed=config.seed
        )

    def step(self) -> None:
        indices = self.sampler.local_indices(len(self.losses))
        self.losses.append(self.strategy.step(indices, self.lr).loss)

    def start_timing(self) -> None:
        """Before the first timed round: from here on count the steps and the bytes."""
        self.timed_from, self.bytes_before = len(self.losses), self.strategy.bytes_sent_by_axis()

    def bytes_per_step(self, mpi) -> dict[str, float]:
        """Bytes sent per timed step on each axis (meter.AXES; 0 for an axis the strategy
        lacks), the difference of two `bytes_sent_by_axis()` readings, the largest over ranks."""
        after, steps = self.strategy.bytes_sent_by_axis(), len(self.losses) - self.timed_from
        return {
            axis: max_over_ranks((after.get(axis, 0) - self.bytes_before.get(axis, 0)) / steps, mpi)
            for axis in AXES
        }

    def memory_max(self, mpi) -> dict[str, int]:
        """The strategy's `memory_bytes()`, each category the largest over ranks."""
        return {k: int(max_over_ranks(v, mpi)) for k, v in self.strategy.memory_bytes().items()}

    def close(self) -> None:
        self.strategy.close()

    def __enter__(self) -> "Contender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def first_losses_agree(contenders: dict, bench: str, rtol: float = 1e-4) -> bool:
    """Step 0 is the same batch on the same model for every contender: their losses agree
    (or rank 0 says which differ, and the benchmark returns 1 without a table)."""
    from minidp.tools.log import print0

    first = {name: c.losses[0] for name, c in contenders.items()}
    if np.allclose(list(first.values()), next(iter(first.values())), rtol=rtol):
        return True
    print0(f"bench {bench}: the contenders' first losses differ: {first}")
    return False


def time_contenders(contenders: dict, warmup: int, iters: int, mpi) -> dict:
    """`rotated_rounds` over the contenders' steps, each contender told when timing starts.
    Returns {name: [seconds, one per timed round]}."""
    steps = {name: c.step for name, c in contenders.items()}
    start = lambda: [c.start_timing() for c in contenders.values()]  # noqa: E731
    return rotated_rounds(steps, warmup, iters, mpi, on_timing=start)


def add_gpt_arguments(parser, bench: str, *, n_embd: int, n_layer: int, n_head: int,
                      iters: int, warmup: int) -> None:  # fmt: skip
    """The flags of a bench that trains the GPT under several strategies (tp, mesh): its
    size, the global batch, the rounds, --json, and --out (default runs/bench_NAME)."""
    for flag, default, what in (
        ("--n-embd", n_embd, "GPT channels"),
        ("--n-layer", n_layer, "blocks"),
        ("--n-head", n_head, "heads"),
        ("--block-size", 64, "tokens"),
        ("--batch-size", 16, "GLOBAL batch"),
        ("--iters", iters, "timed rounds"),
        ("--warmup", warmup, "untimed rounds"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    parser.add_argument("--out", default=f"runs/bench_{bench}", help="directory for the PNG")


def gpt_base(args) -> dict:
    """TrainConfig's fields for `add_gpt_arguments`' GPT: float32, overlap off (the same
    schedule of messages on every core count), no evaluation or sampling to speak of."""
    return dict(
        n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
        block_size=args.block_size, batch_size=args.batch_size, dtype="float32",
        overlap="off", eval_batches=1, sample_tokens=0,
    )  # fmt: skip


def describe_gpt(args) -> str:
    """The header's words for `add_gpt_arguments`' GPT."""
    return (
        f"GPT n_embd {args.n_embd} x {args.n_layer} layers x {args.n_head} heads, block "
        f"{args.block_size}, global batch {args.batch_size}, float32"
    )


def measure_per_rank_threads(measure, args) -> int:
    """`measure(args)` with BLAS at cores / ranks threads a rank (threadpoolctl), a flag that
    cannot work (BadConfig, found alike on every rank) said in one line, every rank exiting."""
    from threadpoolctl import threadpool_limits

    from minidp.cli.training.config import BadConfig
    from minidp.cli.training.loop import blas_threads_per_rank
    from minidp.tools.log import die

    with threadpool_limits(limits=blas_threads_per_rank(0), user_api="blas"):
        try:
            return measure(args)
        except BadConfig as error:
            raise die(str(error)) from None
