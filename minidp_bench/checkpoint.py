"""Checkpoints, measured: a save against np.save of the same bytes, and the main job's cost.

    mpiexec -n 4 python -m minidp bench checkpoint [--iters 15] [--json FILE] [--dir DIR]
    python -m minidp bench checkpoint --main-job [--runs 5] [--ranks 4] [--json FILE]

Save speed (under mpiexec). Two states, each rank's as the training loop saves it (after one
step, so the optimizer's moments exist):
    gpt default   --strategy dp: the whole model and AdamW moments (~1.3 MB), written
                  once, by rank 0 (the others' shards: their skeletons)
    gpt 100 MB    a GPT of ~25 M float32 parameters (n_embd 512, 8 layers: ~100 MB of
                  weights), --strategy zero --zero-stage 3: each rank's 1/P of the weights
                  and moments (~300 MB / P)
Contenders, rotated each round, each timed as the slowest rank's (Barrier, time, MAX):
    save            minidp.parallel.checkpoint.save into a new step directory (as the loop
                    saves): the shard hashed as written, fsync, rename, the gathers, the
                    manifest (fsync, rename, fsync of the directory and of the one above)
    np.save+fsync   each rank writes one uint8 array of its shard's size with np.save into
                    a new file, then fsync: the same bytes, as durable; the rate a save
                    should reach (>= 0.8x)
    np.save         the same without fsync: what the page cache alone costs
After each write, untimed: its files removed, then os.sync(). A filesystem mounted with
`discard` (this VM's ext4) trims freed blocks at the next journal commit, which the next
fsync forces: without the sync, whichever contender ran after a removal paid for it (a save
measured 0.3x np.save+fsync's rate that is 0.9x with it), and one that rewrote its own
file paid for its old blocks.
    save, plain write   the same save with early_writeback.py's trick off (its row says
                    what the trick buys: early_writeback_speedup)
    sha256          hashing the shard's bytes alone, one SHA-256 in one thread
    sha256 pieces   hashing them as the save does: a SHA-256 per 16 MiB piece, by the
                    save's threads (one per core of this rank)
The ratio column is the median over rounds of t(np.save+fsync) / t(save): 1 = as fast.

The main job (--main-job, no MPI here: it launches them): `mpiexec -n R python -m minidp`
with and without `--save-dir DIR --save-every 50`, alternating, `--runs` each: the wall
time of each launch and the loop's own time (the final record's time_s, saves included,
start-up not), medians, and the cost in percent, the median of the paired ratios (goal <= 5);
and the time the saves themselves took (the loop's "saved DIR in Xs" lines), in percent of
the rest of the loop: on a shared machine the one is noise the other is not.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from minidp.tools.parser import Parser
from minidp_bench._common import (
    environment,
    median,
    median_ratio,
    print_table,
    summary,
    write_json,
)

SIZES = {
    "gpt default": dict(strategy="dp"),
    "gpt 100 MB": dict(strategy="zero", zero_stage=3, n_embd=512, n_layer=8, n_head=8),
}


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench checkpoint", description=summary(__doc__))
    parser.add_argument("--iters", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary one)")
    parser.add_argument("--main-job", action="store_true", help="time the main job instead")
    parser.add_argument("--runs", type=int, default=5, help="--main-job: runs of each")
    parser.add_argument("--ranks", type=int, default=4, help="--main-job: mpiexec -n")
    parser.add_argument("--steps", type=int, default=300, help="--main-job: --steps")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.main_job:
        return main_job(args)
    from threadpoolctl import threadpool_limits

    from minidp.cli.training.loop import blas_threads_per_rank

    with threadpool_limits(limits=blas_threads_per_rank(0), user_api="blas"):
        return save_speed(args)


def state_after_one_step(flags: dict, world):
    """(the loop's state of one rank after one step, the strategy's layout) for `flags`."""
    from minidp.cli.strategies import STRATEGIES
    from minidp.cli.training.config import TrainConfig
    from minidp.cli.training.resume import layout_of, loop_state
    from minidp.models.tasks import Task

    config = TrainConfig(batch_size=world.size, eval_batches=1, sample_tokens=0, **flags)
    with STRATEGIES[config.strategy](Task(config, np.float32), config, world) as strategy:
        strategy.step(np.arange(world.rank, world.rank + 1), 1e-3)
        return loop_state(strategy, 1), layout_of(strategy)


def save_speed(args) -> int:
    from minidp import comm
    from minidp.tools.log import print0

    world = comm.world()
    world.checks = False  # as MPI runs: no fingerprints in the measured collectives
    root = args.dir or (tempfile.mkdtemp(prefix="minidp-bench-ckpt-") if world.rank == 0 else "")
    root = comm.broadcast_text(root, root=0, group=world)
    print0(f"bench checkpoint | world {world.size} | {root} | {environment()['blas']}")
    rows = [one_size(size, args, world, root) for size in args.sizes]
    if world.rank == 0:
        print_table(rows, [("state", ""), ("ranks", "d"), ("MB_per_rank", ".2f"),
                           ("save_ms", ".1f"), ("save_plain_write_ms", ".1f"),
                           ("np.save+fsync_ms", ".1f"), ("np.save_ms", ".1f"),
                           ("sha256_ms", ".1f"), ("sha256_pieces_ms", ".1f"),
                           ("save_GB_per_s", ".2f"), ("ratio", ".2f"),
                           ("ratio_no_fsync", ".2f"),
                           ("early_writeback_speedup", ".2f")])  # fmt: skip
        write_json(args.json, [{**r, **environment()} for r in rows])
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def one_size(size: str, args, world, root: str) -> dict:
    """The contenders on the state `size` names, rotated; one table row."""
    from minidp.parallel import checkpoint
    from minidp.parallel.checkpoint import shards
    from minidp.parallel.checkpoint.shards import shard_name
    from minidp_bench._common import rotated_rounds

    state, layout = state_after_one_step(SIZES[size], world)
    base = os.path.join(root, size.replace(" ", "_"))
    saved = iter(range(10**9))
    path = checkpoint.step_directory(base, next(saved))
    checkpoint.save(state, path, world, step=1, layout=layout)  # its size, once
    shard = os.path.join(path, shard_name(world.rank))
    nbytes = os.path.getsize(shard)  # in NumPy's own memory (os.urandom's hashed 1.5x slower)
    raw = np.random.default_rng(world.rank).integers(0, 256, nbytes, dtype=np.uint8)
    plain = os.path.join(root, f"plain_{world.rank:05d}.npy")

    def save() -> None:  # into a new step directory, as the loop does
        nonlocal path
        path = checkpoint.step_directory(base, next(saved))
        checkpoint.save(state, path, world, step=1, layout=layout)

    def remove_saved() -> None:  # untimed: the directory just written
        if world.rank == 0:
            shutil.rmtree(path)
        os.sync()

    def np_save(sync: bool) -> None:  # a new file each time, as a save's shard is
        with open(plain, "wb") as f:
            np.save(f, raw)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def remove_plain() -> None:
        os.remove(plain)
        os.sync()

    def save_plain_write() -> None:  # the same, early_writeback.py's trick off
        shards.EARLY_WRITEBACK, early = False, shards.EARLY_WRITEBACK
        try:
            save()
        finally:
            shards.EARLY_WRITEBACK = early

    steps = {
        "save": save,
        "save_plain_write": save_plain_write,
        "np.save+fsync": lambda: np_save(True),
        "np.save": lambda: np_save(False),
        "sha256": lambda: hashlib.sha256(raw).hexdigest(),
        "sha256_pieces": lambda: hash_pieces(raw),
    }
    world.comm.Barrier()  # every rank has its shard's size: the first save goes too
    remove_saved()
    after = {
        "save": remove_saved,
        "save_plain_write": remove_saved,
        "np.save+fsync": remove_plain,
        "np.save": remove_plain,
    }
    times = rotated_rounds(steps, args.warmup, args.iters, world.comm, after=after)
    total = world.comm.allreduce(raw.nbytes)
    return {
        "state": size, "ranks": world.size, "MB_per_rank": raw.nbytes / 1e6,
        "MB_total": total / 1e6,
        **{f"{name}_ms": 1e3 * median(t) for name, t in times.items()},
        "save_GB_per_s": total / median(times["save"]) / 1e9,
        "ratio": median_ratio(times["np.save+fsync"], times["save"]),
        "ratio_no_fsync": median_ratio(times["np.save"], times["save"]),
        "early_writeback_speedup": median_ratio(times["save_plain_write"], times["save"]),
        "iters": args.iters,
    }  # fmt: skip


def hash_pieces(raw: np.ndarray) -> list[str]:
    """The bytes hashed as a save hashes them: in pieces, by the save's threads."""
    from minidp.parallel.checkpoint.pieces import PIECE_BYTES, Hasher, cut, hashing_threads

    with Hasher(hashing_threads(raw.nbytes, PIECE_BYTES)) as hasher:
        for piece in cut([memoryview(raw)], PIECE_BYTES):
            hasher.add(piece)
        return hasher.digests()


def main_job(args) -> int:
    """The main job with and without --save-every 50, alternating; wall times, medians."""
    root = args.dir or tempfile.mkdtemp(prefix="minidp-bench-main-")
    base = ["mpiexec", "-n", str(args.ranks), sys.executable, "-m", "minidp"]
    base += ["--steps", str(args.steps)]
    contenders = {
        "without": [],
        "save-every 50": ["--save-dir", os.path.join(root, "ckpt"), "--save-every", "50"],
    }
    walls: dict[str, list[float]] = {name: [] for name in contenders}
    loops: dict[str, list[float]] = {name: [] for name in contenders}
    in_saves: list[float] = []  # the seconds the "saved DIR in Xs" lines add up to, per run
    record = os.path.join(root, "run.json")
    for run in range(args.runs):
        order = list(contenders) if run % 2 == 0 else list(contenders)[::-1]
        for name in order:
            start = time.perf_counter()
            done = subprocess.run(
                base + contenders[name] + ["--json", record], capture_output=True, text=True
            )
            walls[name].append(time.perf_counter() - start)
            if done.returncode != 0:
                print(f"bench checkpoint: {name} failed:\n{done.stderr}", file=sys.stderr)
                return 1
            with open(record) as f:
                loops[name].append(json.loads(f.readlines()[-1])["time_s"])
            if name != "without":
                lines = [line for line in done.stdout.splitlines() if line.startswith("saved ")]
                in_saves.append(sum(float(line.split(" in ")[-1].rstrip("s")) for line in lines))
            shutil.rmtree(os.path.join(root, "ckpt"), ignore_errors=True)
            print(f"run {run} {name}: {walls[name][-1]:.2f} s, loop {loops[name][-1]:.2f} s")
    save, plain = "save-every 50", "without"
    row = {
        "ranks": args.ranks, "steps": args.steps, "runs": args.runs,
        "without_s": median(walls[plain]), "save_every_50_s": median(walls[save]),
        "loop_without_s": median(loops[plain]), "loop_save_every_50_s": median(loops[save]),
        "cost_percent_paired": 100 * (median_ratio(walls[save], walls[plain]) - 1),
        "loop_cost_percent_paired": 100 * (median_ratio(loops[save], loops[plain]) - 1),
        "in_saves_s": median(in_saves),
        "in_saves_percent": 100 * median(s / (t - s) for s, t in zip(in_saves, loops[save])),
        "walls": walls, "loops": loops,
    }  # fmt: skip
    print_table([row], [("ranks", "d"), ("runs", "d"), ("without_s", ".2f"),
                        ("save_every_50_s", ".2f"), ("cost_percent_paired", ".1f"),
                        ("loop_without_s", ".2f"), ("loop_save_every_50_s", ".2f"),
                        ("loop_cost_percent_paired", ".1f"), ("in_saves_s", ".3f"),
                        ("in_saves_percent", ".1f")])  # fmt: skip
    write_json(args.json, [{**row, **environment()}])
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0
