"""Gradient compression, measured: bytes, loss and step time of every compressor, side by side.

    mpiexec -n 2 python -m minidp bench compress [--steps 300] [--json FILE] [--plot PNG]
    mpiexec -n 4 python -m minidp bench compress
    mpiexec -n 2 python -m minidp bench compress --compress-on update --compress-warmup 3
    mpiexec -n 2 python -m minidp bench compress --optimizer momentum
    mpiexec -n 2 python -m minidp bench compress --optimizer momentum --compress-on velocity \
        --compressors none,topk:0.001

The task is `python -m minidp`'s default: the tiny GPT (2 layers, 64 channels, ~0.1 M
parameters), global batch 16 x 64 tokens, AdamW (or --optimizer momentum, sgd: with the
config's weight decay, as torch applies it) with warmup and cosine decay, float32,
--steps steps, data parallel over the launched ranks. Contenders (--compressors): none,
fp16, bf16, topk:0.001, randomk:0.01, sign, sign-noef, qsgd:4, powersgd:1, 2 and 4. Each
trains its own model from the same seed on the same batches; one step of every contender
per round, their order rotated by one each round (A B C, B C A, ...), each step timed as
the slowest rank's. So time drift hits every contender alike.

Per contender: gradient bytes per rank per step (counted on the wire) and the ratio to
none's; the final loss (mean of the last 10 steps' training losses) and the validation
loss, each with its difference from none's in percent; the median step time and the median
per-round ratio to none's (above 1: slower). The loss curves go to a PNG (--plot), every
contender on the left, sign against sign-noef on the right.

The issue's goals, for the lead to read off the table: top-k 0.1% within 2% of none's loss
at >= 100x fewer bytes; PowerSGD rank 2 within 2% at >= 10x; sign clearly better than
sign-noef. --compress-on and --compress-warmup apply to every contender but none (the
baseline stays the plain path); --compress-on velocity (DGC) takes --optimizer momentum and
only topk and randomk contenders (one line otherwise). --optimizer momentum's lr, 0.15, won
a sweep of none at 2 ranks (0.03 to 3; docs/compression.md has it). Checks (cross-rank
fingerprints) are off, as in `bench dp`.
"""

from dataclasses import replace

import numpy as np
from mpi4py import MPI

from minidp import comm
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.cli.training.loop import blas_threads_per_rank
from minidp.engine import optim
from minidp.engine.optim import MOMENTUM, OPTIMIZERS
from minidp.models import data
from minidp.models.tasks import Task
from minidp.parallel.compression.table import make_compressor
from minidp.tools.log import die, print0
from minidp.tools.parser import Parser
from minidp.tools.plots import pyplot, save
from minidp_bench._common import (
    environment,
    median,
    median_ratio,
    print_table,
    summary,
    timed,
    write_json,
)

CONTENDERS = (
    "none,fp16,bf16,topk:0.001,randomk:0.01,sign,sign-noef,qsgd:4,powersgd:1,powersgd:2,powersgd:4"
)
TAIL = 10  # the final loss: the mean of this many last steps' losses
MOMENTUM_LR = 0.15  # the best of a sweep of none under momentum SGD (docs/compression.md)
LR = {"adamw": TrainConfig.lr, "momentum": MOMENTUM_LR, "sgd": MOMENTUM_LR / (1 - MOMENTUM)}
"""--lr by --optimizer: plain SGD's is momentum's lr/(1 - 0.9), the same long-run step."""


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench compress", description=summary(__doc__))
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--compressors", default=CONTENDERS, help="comma-separated; none first")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    parser.add_argument("--plot", metavar="PNG", default=None, help="loss curves (default: runs/)")
    parser.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default="adamw",
        help="adamw (the default task's), momentum (SGD, 0.9: the papers' setting) or sgd",
    )
    parser.add_argument(
        "--compress-on",
        choices=("gradient", "update", "velocity"),
        default="gradient",
        help="what every contender but none compresses (see --compress-on of train)",
    )
    parser.add_argument(
        "--compress-warmup",
        type=int,
        default=0,
        metavar="STEPS",
        help="every contender but none allreduces its first STEPS steps uncompressed",
    )
    parser.add_argument(
        "--lr", type=float, default=None, help=f"peak lr (default by --optimizer: {LR})"
    )
    for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size"):  # the task's size
        default = getattr(TrainConfig, name)
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=default, help=f"default {default}")
    args = parser.parse_args(argv)
    args.compressors = args.compressors.split(",")
    if args.compressors[0] != "none":
        raise die("bench compress: the first of --compressors must be none (the baseline)")
    for spec in args.compressors:
        try:
            make_compressor(spec)  # the class checks its value
        except ValueError as error:
            raise die(f"bench compress: --compressors {error}") from None
    if args.lr is None:
        args.lr = LR[args.optimizer]
    if args.steps <= TAIL:
        raise die(f"bench compress: --steps must be more than {TAIL}")
    return args


def train_side_by_side(args, group: comm.Group) -> dict:
    """Train every contender, one step each per round in rotated order: {spec: run}."""
    base = TrainConfig(
        steps=args.steps,
        **{k: getattr(args, k) for k in ("n_layer", "n_embd", "n_head", "block_size")},
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
    ).resolved()
    runs = {}
    for spec in args.compressors:
        compressed = spec != "none"
        config = replace(
            base,
            compress=spec,
            compress_on=args.compress_on if compressed else "gradient",
            compress_warmup=args.compress_warmup if compressed else 0,
        )
        try:  # --compress-on velocity needs momentum and a sparsifier: one line otherwise
            config.validate()
        except BadConfig as error:
            raise die(f"bench compress: {spec}: {error}") from None
        strategy = DataParallel(Task(config, np.dtype(config.dtype)), config, group)
        sampler = data.DistributedSampler(
            strategy.task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
        )
        runs[spec] = {"strategy": strategy, "sampler": sampler, "losses": [], "times": []}
    names = list(runs)
    for step in range(args.steps):
        lr = optim.warmup_cosine(step, base.lr, base.warmup, base.steps, base.min_lr_ratio)
        k = step % len(names)
        for spec in names[k:] + names[:k]:
            timed_step(runs[spec], step, lr, group)
    return runs


def timed_step(run: dict, step: int, lr: float, group: comm.Group) -> None:
    """One step of one contender, timed as the slowest rank's; its loss and time kept."""
    local, result = run["sampler"].local_indices(step), []
    seconds = timed(lambda: result.append(run["strategy"].step(local, lr)), group.comm)[0]
    run["losses"].append(result[0].loss)
    run["times"].append(seconds)


def summarize(runs: dict, group: comm.Group) -> list[dict]:
    """One table row per contender; every rank computes them (the record is collective-free)."""
    warm = min(5, len(next(iter(runs.values()))["times"]) // 2)  # the first steps: warm-up
    rows = []
    for spec, run in runs.items():
        strategy = run["strategy"]
        record = strategy.record()
        rows.append(
            {
                "compress": spec,
                "ranks": group.size,
                "grad_bytes_step": record["grad_bytes_sent"],
                "final_loss": float(np.mean(run["losses"][-TAIL:])),
                "val_loss": strategy.task.validation_loss(),
                "ms_step": 1e3 * median(run["times"][warm:]),
                "compression_error": record["compression_error"],
                "residual_norm": record["residual_norm"],
                "max_param_diff": strategy.max_param_diff(),
                "losses": run["losses"],
                "times": run["times"][warm:],
            }
        )
        strategy.close()
    none = rows[0]
    for row in rows:
        row["bytes_ratio"] = none["grad_bytes_step"] / row["grad_bytes_step"]
        row["loss_vs_none_pct"] = 100 * (row["final_loss"] / none["final_loss"] - 1)
        row["val_vs_none_pct"] = 100 * (row["val_loss"] / none["val_loss"] - 1)
        row["time_vs_none"] = median_ratio(row["times"], none["times"])
    return rows


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (every, signs) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    tab20 = plt.get_cmap("tab20").colors
    colors = tab20[::2] + tab20[1::2]  # 20 distinct: the dark ones first
    for row, color in zip(rows, colors):
        every.plot(smooth(row["losses"]), label=row["compress"], lw=1, color=color)
        if row["compress"] in ("none", "sign", "sign-noef"):
            signs.plot(smooth(row["losses"]), label=row["compress"], color=color)
    for ax, title in ((every, "every compressor"), (signs, "sign: with and without EF")):
        ax.set(title=title, xlabel="step", ylabel="training loss (10-step mean)")
        ax.legend(fontsize=8)
    fig.suptitle(f"bench compress: default GPT, {rows[0]['ranks']} ranks")
    save(fig, path)


def smooth(losses: list[float]) -> np.ndarray:
    """The running mean over TAIL steps (the first ones over what there is)."""
    c = np.cumsum(np.insert(losses, 0, 0.0))
    n = np.arange(1, len(losses) + 1)
    lo = np.maximum(n - TAIL, 0)
    return (c[n] - c[lo]) / (n - lo)


COLUMNS = [
    ("compress", ""),
    ("grad_bytes_step", ",.0f"),
    ("bytes_ratio", ".1f"),
    ("final_loss", ".4f"),
    ("loss_vs_none_pct", "+.2f"),
    ("val_loss", ".4f"),
    ("val_vs_none_pct", "+.2f"),
    ("ms_step", ".1f"),
    ("time_vs_none", ".2f"),
    ("compression_error", ".3f"),
]


def drop_times(row: dict) -> dict:
    """A row for the JSON record: every field but the per-step times (the losses stay)."""
    return {k: v for k, v in row.items() if k != "times"}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from threadpoolctl import threadpool_limits

    world = MPI.COMM_WORLD
    if world.size < 2:
        print0(
            "bench compress needs at least 2 ranks: mpiexec -n 2 python -m minidp bench compress"
        )
        return 2
    group = comm.Group(world.Dup(), checks=False)
    with threadpool_limits(limits=blas_threads_per_rank(0), user_api="blas"):
        env = environment()
        print0(
            f"bench compress: GPT {args.n_layer} layers x {args.n_embd} channels, batch "
            f"{args.batch_size} x {args.block_size} tokens, {args.steps} steps, float32, "
            f"{args.optimizer} lr {args.lr:g} | compress on the {args.compress_on}, "
            f"warm-up {args.compress_warmup} | "
            f"{world.size} ranks x {blas_threads_per_rank(0)} BLAS threads | checks off | "
            f"{env['blas']}"
        )
        rows = summarize(train_side_by_side(args, group), group)
    group.free()
    if world.rank == 0:
        print_table(rows, COLUMNS)
        plot(rows, args.plot or f"runs/bench_compress_{world.size}ranks.png")
        write_json(args.json, [{"bench": "compress", **env, **drop_times(r)} for r in rows])
    return 0
