"""ZeRO's memory, measured: bytes per rank by category against the paper's formulas, and what
each stage costs in step time and bytes sent, side by side with plain data parallelism.

    mpiexec -n 4 python -m minidp bench memory [--n-layer 4 --n-embd 256] [--iters 5]
                                               [--out runs/bench_memory] [--json FILE]

Part 1, memory. For N = 1, 2, 4 (those the world holds) and each of DP, ZeRO-1, -2, -3: build
the GPT (float32, AdamW) on the first N ranks, take one step, and read rank 0's
`memory_bytes()` (counted from the arrays, memory.py) beside the formula (parallel/zero/stages.py's
table: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N). `traced_peak` is tracemalloc's peak during that step
above the bytes held when it began: what the step allocates on top of the model states
(activations, transient gradients, staging), a measurement independent of the counting.
A PNG stacks each row's categories.

Part 2, time and traffic, on the whole world: the four contenders, one step each per round,
rounds rotated (A B C D, B C D A, ...), each timed as the slowest rank's; the median step,
its ratio to DP's (median of per-round ratios), and the bytes sent per rank per step.
"""

import os
import tracemalloc

import numpy as np
from mpi4py import MPI

from minidp import comm
from minidp.cli.strategies import DataParallel, ZeRO
from minidp.cli.training.config import TrainConfig
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.parallel.zero.stages import model_state_bytes
from minidp.tools.log import die, print0
from minidp.tools.parser import Parser
from minidp.tools.plots import pyplot, save
from minidp_bench._common import (
    environment,
    median,
    median_ratio,
    print_table,
    rotated_rounds,
    summary,
    write_json,
)

CONTENDERS = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}  # name -> ZeRO stage (0: DP)
SHOWN = ("parameters", "gradients", "optimizer", "buffers", "activations_peak")


def build(args, stage: int, group: comm.Group):
    """(strategy, sampler) for one contender on `group`."""
    config = TrainConfig(
        model="gpt", n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
        block_size=args.block_size, batch_size=args.batch_size, dtype="float32",
        allreduce="ring", bucket_mb=args.bucket_mb, overlap="off", grad_clip=1.0,
        strategy="zero" if stage else "dp", zero_stage=stage,
    )  # fmt: skip
    task = Task(config, np.float32)
    strategy = ZeRO(task, config, group) if stage else DataParallel(task, config, group)
    sampler = DistributedSampler(
        task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
    )
    return strategy, sampler


def memory_rows(args, world: comm.Group) -> list[dict]:
    rows = []
    for n in (n for n in (1, 2, 4) if n <= world.size):
        group = world.subgroup(list(range(n)))
        if group is not None:
            for name, stage in CONTENDERS.items():
                strategy, sampler = build(args, stage, group)
                with strategy:
                    tracemalloc.start()
                    before = tracemalloc.get_traced_memory()[0]
                    strategy.step(sampler.local_indices(0), 1e-3)
                    peak = tracemalloc.get_traced_memory()[1] - before
                    tracemalloc.stop()
                    memory = strategy.memory_bytes()
                psi = strategy.task.model.num_parameters() if stage < 3 else strategy.layout.numel
                formula = sum(model_state_bytes(stage, psi, n).values())
                measured = sum(memory[k] for k in ("parameters", "gradients", "optimizer"))
                rows.append(
                    {"N": n, "strategy": name, "psi": psi, **memory,
                     "model_states": measured, "formula": formula,
                     "vs_formula": measured / formula, "traced_peak": peak}
                )  # fmt: skip
            group.free()
        world.comm.Barrier()
    return rows


def timing_rows(args, world: comm.Group) -> list[dict]:
    built = {name: build(args, stage, world) for name, stage in CONTENDERS.items()}
    calls = dict.fromkeys(built, 0)

    def stepper(name):
        strategy, sampler = built[name]

        def step():
            strategy.step(sampler.local_indices(calls[name]), 1e-3)
            calls[name] += 1

        return step

    sent_before = {}

    def mark():
        for name, (strategy, _) in built.items():
            sent_before[name] = strategy.bytes_sent_by_axis()["dp"]

    steps = {name: stepper(name) for name in built}
    times = rotated_rounds(steps, args.warmup, args.iters, world.comm, on_timing=mark)
    rows = []
    for name, (strategy, _) in built.items():
        sent = (strategy.bytes_sent_by_axis()["dp"] - sent_before[name]) / args.iters
        rows.append(
            {"strategy": name, "N": world.size, "step_ms": 1e3 * median(times[name]),
             "vs_dp": median_ratio(times[name], times["dp"]), "MB_sent_per_step": sent / 1e6}
        )  # fmt: skip
        strategy.close()
    dp_sent = rows[0]["MB_sent_per_step"]
    for row in rows:
        row["bytes_vs_dp"] = row["MB_sent_per_step"] / dp_sent if dp_sent else None
    return rows


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['strategy']}\nN={r['N']}" for r in rows]
    bottom = np.zeros(len(rows))
    for category in SHOWN:
        values = np.array([r[category] for r in rows]) / 2**20
        ax.bar(labels, values, bottom=bottom, label=category)
        bottom += values
    ax.scatter(labels, [r["formula"] / 2**20 for r in rows], color="k", marker="_", s=400,
               label="formula (model states)", zorder=3)  # fmt: skip
    ax.set_ylabel("MiB per rank (rank 0)")
    ax.set_title("ZeRO: memory per rank by category")
    ax.legend(fontsize=7)
    save(fig, path)


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench memory", description=summary(__doc__))
    for flag, default, what in (
        ("--n-layer", 4, "GPT blocks"),
        ("--n-embd", 256, "GPT channels (4 x 256: about 3.2 M parameters)"),
        ("--n-head", 8, "GPT heads"),
        ("--block-size", 64, "tokens per sequence"),
        ("--batch-size", 8, "global batch, sequences"),
        ("--iters", 5, "timed rounds"),
        ("--warmup", 1, "untimed rounds"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    parser.add_argument("--bucket-mb", type=float, default=2.0, help="bucket cap (default 2)")
    parser.add_argument("--out", default="runs/bench_memory", help="where the PNG goes")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    args = parser.parse_args(argv)
    if min(args.n_layer, args.n_embd, args.n_head, args.iters, args.batch_size) < 1:
        raise die("bench memory: sizes, --batch-size and --iters must be positive")
    if args.n_embd % args.n_head or args.warmup < 0:
        raise die("bench memory: --n-embd must divide by --n-head, --warmup >= 0")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from threadpoolctl import threadpool_limits

    world = comm.Group(MPI.COMM_WORLD.Dup(), checks=False)
    with threadpool_limits(limits=1, user_api="blas"):
        env = environment()
        print0(
            f"bench memory: GPT {args.n_layer} x {args.n_embd}, block {args.block_size}, "
            f"batch {args.batch_size}, float32, AdamW | {world.size} ranks | {env['blas']}"
        )
        memory = memory_rows(args, world)
        timing = timing_rows(args, world)
    world.free()
    if MPI.COMM_WORLD.rank == 0:
        print(f"memory per rank (rank 0's), bytes; Ψ = {memory[0]['psi']:,}", flush=True)
        columns = [("N", "d"), ("strategy", "s")] + [(k, ",d") for k in SHOWN]
        columns += [("model_states", ",d"), ("formula", ",.0f"), ("vs_formula", ".4f")]
        columns += [("gathered_peak", ",d"), ("traced_peak", ",d")]
        print_table(memory, columns)
        print("step time and traffic, all ranks", flush=True)
        print_table(timing, [("strategy", "s"), ("N", "d"), ("step_ms", ".1f"),
                             ("vs_dp", ".3f"), ("MB_sent_per_step", ".3f"),
                             ("bytes_vs_dp", ".3f")])  # fmt: skip
        plot(memory, os.path.join(args.out, "memory_per_rank.png"))
        write_json(args.json, [{"bench": "memory", **env, **r} for r in memory + timing])
    return 0
