"""Structured pruning, measured: the dense model against each fraction of heads and MLP
channels removed, in one run (`python -m minidp bench prune --structured`: prune.py hands
over here).

    mpiexec -n 4 python -m minidp bench prune --structured              # the main job's model
    mpiexec -n 2 python -m minidp bench prune --structured --fractions 0.5 --steps 60

Two parts, for each contender: the default GPT (`python -m minidp train`'s defaults: 2 layers,
4 heads, width 64, 300 steps, float32, --strategy dp), dense or with `--prune-structured F`
for each fraction F (pruned at step steps/3, then fine-tuned for the steps left), the same
with magnitude pruning to 90% (`--prune 0.9`, masks: unstructured) for comparison, and for
each rank R of --low-rank, every block's qkv, proj, fc and fc_proj factorized to rank R at
step steps/3 (models/prune/low_rank.py; no flag sets it: low_rank_train.py's `low_rank_run`,
the loop's steps with parallel/low_rank.py's LowRankFactorization in the dp recipe).

1. Quality: each contender one whole training run (training/loop.py's loop): the validation
   loss at the end, the parameters left.
2. Speed: the contenders built side by side, each pruned at its first step, then stepped in
   rotated rounds (A B C D, B C D A, ...) on the same examples: the step time as the slowest
   rank's, median over the rounds; the gradient bytes each rank sends per step (DDP's)
   and its memory (parameters, gradients, optimizer, activations' peak, buffers).

The last line: `structured 0.5: speedup N.NNx, val loss +P.P%` (the dense run's step time
over the pruned one's; the pruned run's validation loss against the dense run's). The PNG
(--out) plots validation loss against step time, one point per contender.
"""

import contextlib
import io
import os
from dataclasses import replace

import numpy as np
from threadpoolctl import threadpool_limits

from minidp import comm
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import blas_threads_per_rank, train
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.parallel.across_ranks import bytes_sent
from minidp.parallel.low_rank import LowRankFactorization
from minidp.tools.log import print0
from minidp.tools.plots import pyplot, save
from minidp_bench._common import median, print_table, rotated_rounds, write_json
from minidp_bench.low_rank_train import low_rank_run

FRACTIONS = (0.25, 0.5, 0.75)
UNSTRUCTURED = 0.9  # the magnitude-pruning contender, --prune 0.9


def contenders(base: TrainConfig, fractions) -> dict[str, TrainConfig]:
    """{name: config}: dense, each structured fraction, and unstructured 90%."""
    configs = {"dense": base}
    configs |= {f"structured {f:g}": replace(base, prune_structured=f) for f in fractions}
    configs[f"unstructured {UNSTRUCTURED:g}"] = replace(base, prune=UNSTRUCTURED)
    for config in configs.values():
        config.validate()
    return configs


def low_rank_name(rank: int) -> str:
    return f"low-rank {rank}"


def quality(configs: dict, group: comm.Group, ranks=()) -> dict[str, dict]:
    """Each contender trained once, whole: its final record."""
    finals = {}
    for name, config in configs.items():
        with contextlib.redirect_stdout(io.StringIO()):  # the table is the output
            finals[name] = train(config, group)
        print0(f"  {name}: val loss {finals[name]['val_loss']:.4f}", rank=group.rank)
    for rank in ranks:
        with threadpool_limits(limits=blas_threads_per_rank(0), user_api="blas"):
            finals[low_rank_name(rank)] = low_rank_run(configs["dense"], rank, group)
        val = finals[low_rank_name(rank)]["val_loss"]
        print0(f"  {low_rank_name(rank)}: val loss {val:.4f}", rank=group.rank)
    return finals


def speed(configs: dict, group: comm.Group, rounds: int, ranks=()) -> dict[str, dict]:
    """The contenders stepped side by side, each already pruned: step time (median of the
    slowest rank's), gradient bytes sent per step, memory by category."""
    built, local = {}, None
    low = {low_rank_name(r): r for r in ranks}
    for name, config in (configs | {name: configs["dense"] for name in low}).items():
        at_once = replace(config, prune_structured_at=0 if config.prune_structured else None)
        if config.prune:  # the masks at their target from the first step
            at_once = replace(at_once, prune_start=0, prune_end=0)
        strategy = DataParallel(Task(at_once, np.float32), at_once, group)
        if name in low:  # factorized at its first step
            strategy.structured = LowRankFactorization(strategy.model, low[name], 0, group)
        sampler = DistributedSampler(
            strategy.task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
        )
        local = sampler.local_indices(0)  # the same examples every step: only time differs
        strategy.step(local, config.lr)  # pruned here
        built[name] = strategy
    sent = {name: bytes_sent(s.ddp.comm_group) for name, s in built.items()}
    steps = {name: (lambda s=s: s.step(local, 1e-4)) for name, s in built.items()}
    times = rotated_rounds(steps, 2, rounds, group.comm)
    figures = {}
    for name, strategy in built.items():
        per_step = (bytes_sent(strategy.ddp.comm_group) - sent[name]) / (rounds + 2)
        memory = strategy.memory_bytes()
        figures[name] = {"step_ms": 1e3 * median(times[name]), "bytes_per_step": per_step,
                         "memory_bytes": int(sum(memory.values()))}  # fmt: skip
        strategy.close()
    return figures


def measure(args, group: comm.Group) -> list[dict]:
    base = TrainConfig(steps=args.steps, batch_size=args.batch_size, log_every=args.steps,
                       sample_tokens=0)  # fmt: skip
    configs = contenders(base, args.fractions)
    finals = quality(configs, group, args.low_rank)
    with threadpool_limits(limits=blas_threads_per_rank(0), user_api="blas"):
        figures = speed(configs, group, args.rounds, args.low_rank)
    rows, dense = [], finals["dense"]
    total = Task(base, np.float32).model.num_parameters()  # the dense model's
    for name, final in finals.items():
        params = final.get("parameters_after", total)  # (unstructured: all, zeros included)
        rows.append({"bench": "prune_structured", "contender": name, "parameters": params,
                     "params_vs_dense": params / total, "val_loss": final["val_loss"],
                     "val_vs_dense": final["val_loss"] / dense["val_loss"], **figures[name],
                     "speedup": figures["dense"]["step_ms"] / figures[name]["step_ms"],
                     "nprocs": group.size, "steps": args.steps})  # fmt: skip
    return rows


def plot(rows: list[dict], out: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        color = "C1" if "unstr" in r["contender"] else "C2" if "low" in r["contender"] else "C0"
        ax.plot(r["step_ms"], r["val_loss"], "o", color=color)
        label = f"{r['contender']} ({r['parameters'] / 1e3:.0f}k)"
        ax.annotate(label, (r["step_ms"], r["val_loss"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")  # fmt: skip
    ax.set(xlabel="step time (ms, median, slowest rank)", ylabel="validation loss",
           title=f"pruning: quality against speed ({rows[0]['nprocs']} ranks)")  # fmt: skip
    save(fig, os.path.join(out, "prune_structured_loss_vs_step.png"))


def main(args, group: comm.Group) -> int:
    print0(
        f"bench prune --structured: the default GPT, global batch {args.batch_size}, "
        f"{args.steps} steps, float32 | {group.size} ranks | fractions {args.fractions} | "
        f"low ranks {args.low_rank} | "
        f"{args.rounds} timed rounds",
        rank=group.rank,
    )
    rows = measure(args, group)
    if group.rank == 0:
        columns = [("contender", "s"), ("parameters", "d"), ("params_vs_dense", ".3f"),
                   ("val_loss", ".4f"), ("val_vs_dense", ".3f"), ("step_ms", ".2f"),
                   ("speedup", ".2f"), ("bytes_per_step", ".0f"),
                   ("memory_bytes", "d")]  # fmt: skip
        print_table(rows, columns)
        plot(rows, args.out)
        write_json(args.json, rows)
        for r in rows:
            if r["contender"] == "structured 0.5":
                print0(f"structured 0.5: speedup {r['speedup']:.2f}x, val loss "
                       f"{100 * (r['val_vs_dense'] - 1):+.1f}%")  # fmt: skip
    return 0
