"""Tensor parallelism, measured: step time, TP bytes against the formula, memory per rank.

    mpiexec -n 4 python -m minidp bench tp [--n-embd 256] [--iters 5] [--json FILE] [--out DIR]

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

import numpy as np
from mpi4py import MPI

from minidp import comm
from minidp.bench._common import (
    environment,
    median,
    print_table,
    rotated_rounds,
    summary,
    write_json,
)
from minidp.data import DistributedSampler
from minidp.log import print0
from minidp.parser import Parser
from minidp.plots import pyplot, save
from minidp.strategies import STRATEGIES
from minidp.training.config import TrainConfig
from minidp.training.loop import blas_threads_per_rank
from minidp.training.tasks import Task


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench tp", description=summary(__doc__))
    parser.add_argument("--n-embd", type=int, default=256, help="GPT channels (default 256)")
    parser.add_argument("--n-layer", type=int, default=2, help="blocks (default 2)")
    parser.add_argument("--n-head", type=int, default=8, help="heads (default 8)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens (default 64)")
    parser.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch (default 16)")
    parser.add_argument("--iters", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    parser.add_argument("--out", default="runs/bench_tp", help="directory for the PNG")
    return parser.parse_args(argv)


def contenders(P: int) -> list[tuple[int, int, bool]]:
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
    from threadpoolctl import threadpool_limits

    args = parse_args(argv)
    with threadpool_limits(limits=blas_threads_per_rank(0), user_api="blas"):
        return measure(args)


def measure(args) -> int:
    world = comm.world()
    world.checks = False  # as MPI runs: no fingerprints in the measured collectives
    base = dict(
        n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
        block_size=args.block_size, batch_size=args.batch_size, dtype="float32",
        overlap="off", eval_batches=1, sample_tokens=0,
    )  # fmt: skip
    print0(
        f"bench tp | world {world.size} | GPT n_embd {args.n_embd} x {args.n_layer} layers x "
        f"{args.n_head} heads, block {args.block_size}, global batch {args.batch_size}, "
        f"float32 | {environment()['blas']}"
    )
    strategies, steps, losses, rows = {}, {}, {}, []
    for dp, tp, sp in contenders(world.size):
        name = f"dp{dp} tp{tp}" + (" sp" if sp else "")
        strategy = "dp" if tp == 1 else "hybrid"
        flags = {} if tp == 1 else {"dp": dp, "tp": tp, "sequence_parallel": sp}
        config = TrainConfig(**base, strategy=strategy, **flags)
        s = STRATEGIES[strategy](Task(config, np.float32), config, world)
        sampler = DistributedSampler(
            s.task.num_examples, config.batch_size, *s.data_shard, seed=config.seed
        )
        losses[name] = []

        def step(s=s, sampler=sampler, kept=losses[name]):
            kept.append(s.step(sampler.local_indices(len(kept)), 1e-3).loss)

        steps[name] = step
        strategies[name] = (s, config, dp, tp, sp)
    before = {}
    times = rotated_rounds(
        steps,
        args.warmup,
        args.iters,
        world.comm,
        on_timing=lambda: before.update(
            {n: v[0].bytes_sent_by_axis() for n, v in strategies.items()}
        ),
    )
    first = {name: kept[0] for name, kept in losses.items()}  # step 0: the same batch, model
    if not np.allclose(list(first.values()), next(iter(first.values())), rtol=1e-4):
        print0(f"bench tp: the contenders' first losses differ: {first}")
        return 1
    for name, (s, config, dp, tp, sp) in strategies.items():
        after = s.bytes_sent_by_axis()
        tp_bytes = (after.get("tp", 0) - before[name].get("tp", 0)) / args.iters
        dp_bytes = (after["dp"] - before[name]["dp"]) / args.iters
        memory = {k: world.comm.allreduce(v, op=MPI.MAX) for k, v in s.memory_bytes().items()}
        want = formula_bytes(config, dp, tp, 4)
        rows.append({
            "contender": name, "dp": dp, "tp": tp, "sequence_parallel": sp,
            "step_ms": 1e3 * median(times[name]),
            "tp_MB_per_step": world.comm.allreduce(tp_bytes, op=MPI.MAX) / 1e6,
            "formula_MB": want / 1e6,
            "other_MB": (world.comm.allreduce(tp_bytes, op=MPI.MAX) - want) / 1e6,
            "dp_MB_per_step": world.comm.allreduce(dp_bytes, op=MPI.MAX) / 1e6,
            "params_MB": memory["parameters"] / 1e6,
            "activations_MB": memory["activations_peak"] / 1e6,
            "act_KB_per_seq": memory["activations_peak"] / 1e3 / (config.batch_size // dp),
            "optimizer_MB": memory["optimizer"] / 1e6,
            "memory_bytes": memory,
        })  # fmt: skip
        s.close()
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
