"""The 3-D mesh, measured: every dp x tp x pp layout of one world, what each axis sends, the
memory per rank, and the pipeline bubble against its formula.

    mpiexec -n 8 python -m minidp bench mesh [--iters 15] [--json FILE] [--out DIR]

Contenders, on one world of W ranks and one global batch: every (dp, tp, pp) with
dp x tp x pp = W, tp in {1, 2, 4}, pp in {1, 2, 4} dividing --n-layer. dp = W is plain
`--strategy dp`; pp = 1 with tp > 1 the 2-D `--strategy hybrid --dp D --tp T`; pp > 1 the
3-D `--strategy hybrid --dp D --tp T --pp P` (strategies/pp.py: TP inside each pipeline
stage, DDP over the copies of the pipeline). The model is the default GPT with 4 blocks,
float32, AdamW, clipping on; m = 4 micro-batches under 1F1B. At W = 8:

    layout        dp sends             tp sends                 pp sends
    dp8 tp1 pp1   every gradient       -                        -
    dp4 tp1 pp2   its stage's grads    -                        activations, m per cut
    dp2 tp2 pp2   its TP slice's       f and g, per block       activations (whole, per TP rank)

Per layout: the step time (the slowest rank's, median over rounds, layouts rotated); the
bytes one rank sends per step on each axis (the largest over ranks, the difference of
`bytes_sent_by_axis()` over the timed rounds); memory per rank (the largest over ranks):
the model state (parameters + gradients + optimizer) and the activations' peak; for
pp > 1 the measured bubble (idle / (pp x window) of each step's compute spans, the mean
over the timed steps and the ranks) beside (p-1)/(m+p-1).

On the 2-core development machine 8 ranks are oversubscribed 4x: the step times compare the
layouts' total work (compute plus the copies of every message), not their speed on a real
cluster, and the measured bubble there is inflated by ranks waiting for a core. The bytes and
the memory are what the layouts really cost. Before the table the layouts' first losses (the
same batch, the same model) must agree (float32, 1e-4), or the benchmark stops with exit 1.
"""

import contextlib
import os

import numpy as np
from mpi4py import MPI

from minidp import comm
from minidp.cli.training.config import TrainConfig
from minidp.tools.log import print0
from minidp.tools.names import PIPELINE_SCHEDULES
from minidp.tools.parser import Parser
from minidp.tools.plots import pyplot, save
from minidp_bench._common import (
    Contender,
    add_gpt_arguments,
    describe_gpt,
    environment,
    first_losses_agree,
    gpt_base,
    measure_per_rank_threads,
    median,
    print_table,
    summary,
    time_contenders,
    write_json,
)

AXES = ("dp", "tp", "pp")


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench mesh", description=summary(__doc__))
    add_gpt_arguments(parser, "mesh", n_embd=64, n_layer=4, n_head=4, iters=15, warmup=2)
    parser.add_argument("--micro-batches", type=int, default=4, help="m, pp > 1 (default 4)")
    schedules = [s for s in PIPELINE_SCHEDULES if s != "interleaved"]  # V = 1 here
    parser.add_argument("--schedule", choices=schedules, default="1f1b", help="(default 1f1b)")
    return parser.parse_args(argv)


def layouts(world_size: int, n_layer: int) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with dp x tp x pp = world_size, tp and pp in 1, 2, 4, pp dividing the
    blocks: pp outer, so the table reads 2-D first, then the pipelines."""
    return [
        (world_size // (tp * pp), tp, pp)
        for pp in (1, 2, 4)
        for tp in (1, 2, 4)
        if world_size % (tp * pp) == 0 and n_layer % pp == 0
    ]


def layout_config(base: dict, args, dp: int, tp: int, pp: int) -> TrainConfig:
    """dp x 1 x 1 is --strategy dp; otherwise hybrid, with the pipeline's flags only when
    pp > 1 (a 2-D hybrid refuses them)."""
    if tp == pp == 1:
        return TrainConfig(**base, strategy="dp")
    pipeline = {"pp": pp, "micro_batches": args.micro_batches, "schedule": args.schedule}
    return TrainConfig(**base, strategy="hybrid", dp=dp, tp=tp, **(pipeline if pp > 1 else {}))


def main(argv: list[str]) -> int:
    return measure_per_rank_threads(measure, parse_args(argv))


def measure(args) -> int:
    world = comm.world()
    world.checks = False  # as MPI runs: no fingerprints in the measured collectives
    base = gpt_base(args)
    cores = os.cpu_count() or 1
    print0(
        f"bench mesh | world {world.size} on {cores} cores ({world.size / cores:g}x "
        f"oversubscribed: step times compare the layouts' total work, not their speed on a "
        f"cluster; bytes and memory are what they cost) | {describe_gpt(args)} | m "
        f"{args.micro_batches} {args.schedule} | {environment()['blas']}"
    )
    rows = []
    with contextlib.ExitStack() as closing:  # every strategy closed at the end, collectively
        contenders, sizes = {}, {}
        for dp, tp, pp in layouts(world.size, args.n_layer):
            name, config = f"dp{dp} tp{tp} pp{pp}", layout_config(base, args, dp, tp, pp)
            config.validate()
            contenders[name] = closing.enter_context(Contender(config, world))
            sizes[name] = {"dp": dp, "tp": tp, "pp": pp}
        times = time_contenders(contenders, args.warmup, args.iters, world.comm)
        if not first_losses_agree(contenders, "mesh"):
            return 1
        for name, c in contenders.items():
            sent, memory = c.bytes_per_step(world.comm), c.memory_max(world.comm)
            state = sum(memory.get(k, 0) for k in ("parameters", "gradients", "optimizer"))
            rows.append({
                "layout": name, **sizes[name], "strategy": c.config.strategy,
                "step_ms": 1e3 * median(times[name]),
                **{f"{axis}_KB": sent[axis] / 1e3 for axis in AXES},
                "state_KB": state / 1e3,
                "act_KB": memory["activations_peak"] / 1e3,
                **bubble(c, world),
                "memory_bytes": memory,
            })  # fmt: skip
    if world.rank == 0:
        print_table(
            rows,
            [("layout", ""), ("step_ms", ".1f"), ("dp_KB", ".1f"), ("tp_KB", ".1f"),
             ("pp_KB", ".1f"), ("state_KB", ".1f"), ("act_KB", ".1f"), ("bubble", ".3f"),
             ("bubble_formula", ".3f")],
        )  # fmt: skip
        print0("KB: per rank per step (sent) or held, the largest over ranks")
        write_json(args.json, [{**r, "world_size": world.size} for r in rows])
        plot(rows, args.out)
    return 0


def bubble(c: Contender, world) -> dict:
    """For a pipeline: the measured bubble, the mean over the timed steps (PipelineStep keeps
    one per step, warm-ups first) and over ranks, and the formula; None for the others."""
    if c.config.strategy != "hybrid" or c.config.pp <= 1:
        return {"bubble": None, "bubble_formula": None}
    timed = c.strategy.run.bubbles[c.timed_from :]
    mean = world.comm.allreduce(float(np.mean(timed)), op=MPI.SUM) / world.size
    return {"bubble": mean, "bubble_formula": c.strategy.record()["bubble_fraction_formula"]}


def plot(rows: list[dict], out: str) -> None:
    """Bytes per rank per step stacked by axis, and memory per rank: state and activations."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["layout"] for r in rows]
    for ax, keys in ((left, [f"{a}_KB" for a in AXES]), (right, ["state_KB", "act_KB"])):
        bottom = np.zeros(len(rows))
        for key in keys:
            values = np.array([r[key] for r in rows])
            ax.bar(names, values, bottom=bottom, label=key.removesuffix("_KB"))
            bottom += values
        ax.legend()
        ax.tick_params(axis="x", rotation=30)
    left.set_ylabel("KB sent per rank per step (largest rank)")
    left.set_title("traffic by mesh axis")
    right.set_ylabel("KB per rank (largest rank)")
    right.set_title("memory per rank: model state and activations' peak")
    save(fig, f"{out}/bench_mesh.png")
