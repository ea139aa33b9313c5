"""Tensor parallelism, measured: step time, TP bytes against the formula, memory per rank.

    mpiexec -n 4 python -m minidp bench tp [--n-embd 256] [--iters 5] [--json FILE] [--out DIR]
    mpiexec -n 4 python -m minidp bench tp --paths     # + each tp mesh on the plain comm path

Contenders, on one world of P ranks and one global batch: every mesh dp x tp with tp in
{1, 2, 4} dividing P (tp = 1 is plain data parallelism over P ranks), and for tp > 1 also
with sequence parallelism. The model is the tiny GPT made wide enough that splitting it
matters (n_embd 256 by default), float32, AdamW, clipping on: the training loop's step.

The TP bytes formula, per rank per step, with n = (B / dp) T C activations of a micro-batch
and a ring allreduce sending 2 (p-1)/p n elements:

    blocks   2 allreduces forward (g after attention and MLP) + 2 backward (f) per block
    ends     1 forward (g after the embedding) + 1 backward (f before the head)
    total    (4 L + 2) x 2 (p-1)/p x n x itemsize

With sequence parallelism each allreduce is a reduce-scatter plus an allgather, (p-1)/p n
each: the same bytes. What the formula leaves out: the loss's allreduces of N = (B/dp) T
numbers and the clipping norm's one number (measured minus formula, "other" below).

Before the table, the contenders' first losses (the same batch, the same model) must agree
(float32, 1e-4), or the benchmark stops with exit code 1. Memory is `memory_bytes()` of
the strategy (counted from the arrays), the largest over ranks. A TP rank reads tp times
more sequences than a rank of plain data parallelism on the same world, so activations are
also shown per sequence a rank computes on (act_KB_per_seq): what TP and SP divide. Step
times are the slowest rank's, medians over rounds, contenders rotated.
"""

import contextlib
import functools

import numpy as np

from minidp import comm
from minidp.cli.training.config import TrainConfig
from minidp.comm import fast_path
from minidp.tools.log import print0
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


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench tp", description=summary(__doc__))
    add_gpt_arguments(parser, "tp", n_embd=256, n_layer=2, n_head=8, iters=5, warmup=1)
    parser.add_argument(
        "--paths", action="store_true", help="each tp > 1 mesh also on the plain comm path"
    )
    return parser.parse_args(argv)


def contenders_of(P: int) -> list[tuple[int, int, bool]]:
    """(dp, tp, sequence parallel) for tp in 1, 2, 4 dividing P."""
    out = []
    for tp in (1, 2, 4):
        if P % tp == 0:
            out += [(P // tp, tp, False)] + ([(P // tp, tp, True)] if tp > 1 else [])
    return out


def formula_bytes(config: TrainConfig, dp: int, tp: int, itemsize: int) -> float:
    """(4 L + 2) x 2 (p-1)/p x (B/dp) T C x itemsize: the module docstring's count."""
    n = config.batch_size // dp * config.block_size * config.n_embd
    return (4 * config.n_layer + 2) * 2 * (tp - 1) / tp * n * itemsize


def main(argv: list[str]) -> int:
    return measure_per_rank_threads(measure, parse_args(argv))


def measure(args) -> int:
    world = comm.world()
    world.checks = False  # as MPI runs: no fingerprints in the measured collectives
    base = gpt_base(args)
    print0(f"bench tp | world {world.size} | {describe_gpt(args)} | {environment()['blas']}")
    rows = []
    with contextlib.ExitStack() as closing:  # every strategy closed at the end, collectively
        contenders = {}
        for dp, tp, sp in contenders_of(world.size):
            name = f"dp{dp} tp{tp}" + (" sp" if sp else "")
            strategy = "dp" if tp == 1 else "hybrid"
            flags = {} if tp == 1 else {"dp": dp, "tp": tp, "sequence_parallel": sp}
            config = TrainConfig(**base, strategy=strategy, **flags)
            contenders[name] = closing.enter_context(Contender(config, world))
            if args.paths and tp > 1:  # a twin whose collectives take the plain path
                twin = closing.enter_context(Contender(config, world))
                twin.step = functools.partial(_on_the_plain_path, twin.step)
                contenders[name + " plain"] = twin
        times = time_contenders(contenders, args.warmup, args.iters, world.comm)
        if not first_losses_agree(contenders, "tp"):
            return 1
        for name, c in contenders.items():
            config = c.config
            dp, tp = config.dp or world.size, config.tp or 1
            sent, memory = c.bytes_per_step(world.comm), c.memory_max(world.comm)
            want = formula_bytes(config, dp, tp, 4)
            rows.append({
                "contender": name, "dp": dp, "tp": tp,
                "sequence_parallel": config.sequence_parallel,
                "step_ms": 1e3 * median(times[name]),
                "tp_MB_per_step": sent["tp"] / 1e6,
                "formula_MB": want / 1e6,
                "other_MB": (sent["tp"] - want) / 1e6,
                "dp_MB_per_step": sent["dp"] / 1e6,
                "params_MB": memory["parameters"] / 1e6,
                "activations_MB": memory["activations_peak"] / 1e6,
                "act_KB_per_seq": memory["activations_peak"] / 1e3 / (config.batch_size // dp),
                "optimizer_MB": memory["optimizer"] / 1e6,
                "memory_bytes": memory,
            })  # fmt: skip
    if world.rank == 0:
        print_table(
            rows,
            [("contender", ""), ("step_ms", ".1f"), ("tp_MB_per_step", ".3f"),
             ("formula_MB", ".3f"), ("other_MB", ".4f"), ("dp_MB_per_step", ".3f"),
             ("params_MB", ".3f"), ("activations_MB", ".3f"), ("act_KB_per_seq", ".1f"),
             ("optimizer_MB", ".3f")],
        )  # fmt: skip
        write_json(args.json, [{**r, "world_size": world.size} for r in rows])
        plot(rows, args.out)
    return 0


def _on_the_plain_path(step) -> None:
    with fast_path.plain():
        step()


def plot(rows: list[dict], out: str) -> None:
    """Memory per rank by category, one bar per contender, and TP bytes against the formula."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["contender"] for r in rows]
    bottom = np.zeros(len(rows))
    for key in ("params_MB", "optimizer_MB", "activations_MB"):
        values = np.array([r[key] for r in rows])
        left.bar(names, values, bottom=bottom, label=key.removesuffix("_MB"))
        bottom += values
    left.set_ylabel("MB per rank (largest rank)")
    left.set_title("memory per rank")
    left.legend()
    x = np.arange(len(rows))
    right.bar(x - 0.2, [r["tp_MB_per_step"] for r in rows], 0.4, label="measured")
    right.bar(x + 0.2, [r["formula_MB"] for r in rows], 0.4, label="(4L+2)·2(p-1)/p·n")
    right.set_xticks(x, names)
    right.set_ylabel("TP MB sent per rank per step")
    right.set_title("tensor-parallel traffic")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    save(fig, f"{out}/bench_tp.png")
