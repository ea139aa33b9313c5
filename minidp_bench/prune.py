"""Pruning, measured: validation loss and gradient bytes against sparsity, and pruning a
model against simply training a smaller one.

    mpiexec -n 2 python -m minidp bench prune [--steps 300] [--repeats 1] [--out DIR]
    mpiexec -n 2 python -m minidp bench prune --sparsities 0,0.9 --widths 64 --json FILE
    mpiexec -n 4 python -m minidp bench prune --structured   # heads, channels: _prune_structured.py
    mpiexec -n 4 python -m minidp bench prune --structured --profile  # where: _prune_profile.py

Contenders: the default GPT (`python -m minidp train`'s defaults: 2 layers, 4 heads, width
64, 300 steps, float32) trained with `--prune S` for each sparsity S (0, 50, 80, 90, 95%
by default), and the same for a GPT of half the width (32: about a quarter of the weights).
Each run prunes on Zhu & Gupta's cubic ramp from step steps/6 to 2 steps/3, every
steps/30 steps (minidp/models/prune/magnitude.py), and then trains on at the target sparsity.

Columns: the weight-matrix values left nonzero, the validation loss (and its ratio to the
dense default GPT's), the gradient bytes each rank sends per step once the target is
reached (the last step's; the ratio to the dense default's), and the step time. A model
that is both smaller and better at the same nonzero count shows that shrinking beats
pruning here; the bytes column shows what pruning saves on the wire.

Each contender is one whole training run (training/loop.py's loop), timed as the slowest rank's;
with --repeats R the runs go R rounds in rotated order and the times are medians (the
losses are the same every round: one seed). The PNG (--out) plots loss against nonzero
weights, and bytes against sparsity, one line per width.
"""

import contextlib
import io
import os
from dataclasses import replace

import numpy as np

from minidp import comm
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.cli.training.loop import train
from minidp.models.prune.magnitude import prunable
from minidp.models.tasks import Task
from minidp.tools.log import die, print0
from minidp.tools.parser import Parser
from minidp.tools.plots import pyplot, save
from minidp_bench import _prune_profile as prune_profile
from minidp_bench import _prune_structured as prune_structured
from minidp_bench._common import median, print_table, rotated_rounds, summary, write_json

SPARSITIES = (0.0, 0.5, 0.8, 0.9, 0.95)


def contender_config(base: TrainConfig, width: int, sparsity: float) -> TrainConfig:
    """The run for one (width, sparsity): the schedule's defaults scale with --steps."""
    return replace(base, n_embd=width, prune=sparsity, sample_tokens=0)


def weight_counts(config: TrainConfig) -> tuple[int, int]:
    """(all parameters, those in weight matrices) of the model `config` builds."""
    model = Task(config, np.float32).model
    return model.num_parameters(), sum(p.size for _, p in prunable(model))


def measure(args, group: comm.Group) -> list[dict]:
    base = TrainConfig(steps=args.steps, n_layer=args.n_layer, block_size=args.block_size,
                       batch_size=args.batch_size, log_every=args.steps)  # fmt: skip
    configs = {(w, s): contender_config(base, w, s) for w in args.widths for s in args.sparsities}
    for config in configs.values():
        config.validate()
    finals: dict = {}
    loop_seconds: dict = {key: [] for key in configs}  # the training loop's, not the build's

    def run(key):
        def train_once():
            with contextlib.redirect_stdout(io.StringIO()):  # the table is the output
                finals[key] = train(configs[key], group)
            loop_seconds[key].append(finals[key]["time_s"])
            print0(f"  width {key[0]} sparsity {key[1]:g}: val loss {finals[key]['val_loss']:.4f}")

        return train_once

    rotated_rounds({key: run(key) for key in configs}, 0, args.repeats, group.comm)
    rows = []
    for (width, sparsity), final in finals.items():
        steps = final["steps"]
        total, matrices = weight_counts(configs[(width, sparsity)])
        if sparsity:
            sent = final["prune_bytes_per_step"]  # the last step's, at the target
            nonzero = final["prune_grad_elements_per_step"] - (total - matrices)
        else:
            sent, nonzero = final["bytes_sent_by_axis"]["dp"] / steps, matrices
        rows.append({"bench": "prune", "width": width, "sparsity": sparsity,
                     "parameters": total, "nonzero_weights": nonzero,
                     "val_loss": final["val_loss"], "final_loss": final["final_loss"],
                     "bytes_per_step": sent,
                     "step_ms": 1e3 * median(loop_seconds[(width, sparsity)]) / steps,
                     "nprocs": group.size})  # fmt: skip
    dense = next((r for r in rows if r["width"] == args.widths[0] and r["sparsity"] == 0), None)
    for r in rows:
        if dense is not None:
            r["val_vs_dense"] = r["val_loss"] / dense["val_loss"]
            if dense["bytes_per_step"]:  # one rank sends nothing
                r["bytes_vs_dense"] = r["bytes_per_step"] / dense["bytes_per_step"]
    return rows


def plot(rows: list[dict], out: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for width in sorted({r["width"] for r in rows}, reverse=True):
        mine = sorted((r for r in rows if r["width"] == width), key=lambda r: r["sparsity"])
        label = f"width {width}"
        left.plot([r["nonzero_weights"] for r in mine], [r["val_loss"] for r in mine], "o-",
                  label=label)  # fmt: skip
        for r in mine:
            left.annotate(f"{r['sparsity']:.0%}", (r["nonzero_weights"], r["val_loss"]), fontsize=7)
        right.plot([100 * r["sparsity"] for r in mine],
                   [r["bytes_per_step"] / 1e3 for r in mine], "o-", label=label)  # fmt: skip
    left.set(xscale="log", xlabel="nonzero weight-matrix values", ylabel="validation loss",
             title="pruning against shrinking")  # fmt: skip
    right.set(xlabel="sparsity (%)", ylabel="gradient kB sent per rank per step",
              title="bytes on the wire")  # fmt: skip
    left.legend()
    right.legend()
    save(fig, os.path.join(out, "prune_loss_vs_sparsity.png"))


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench prune", description=summary(__doc__))
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--sparsities", default=",".join(f"{s:g}" for s in SPARSITIES))
    parser.add_argument("--widths", default="64,32", help="n_embd of each model (default 64,32)")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument("--repeats", type=int, default=1, help="rounds (times: medians)")
    parser.add_argument("--out", default="runs/bench_prune", help="directory for the PNG")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    parser.add_argument("--structured", action="store_true",
                        help="dense against --fractions of heads and channels removed "
                        "(_prune_structured.py)")  # fmt: skip
    parser.add_argument("--fractions", default="0.25,0.5,0.75", help="with --structured")
    parser.add_argument("--rounds", type=int, default=20, help="with --structured: timed rounds")
    parser.add_argument("--low-rank", default="16,32", help="with --structured: ranks of the "
                        "low-rank contenders (models/prune/low_rank.py; '' for none)")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="with --structured: where the "
                        "step's time goes, dense against 0.5 (_prune_profile.py)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.fractions = [float(f) for f in args.fractions.split(",")]
        args.low_rank = [int(r) for r in args.low_rank.split(",") if r]
        args.sparsities = [float(s) for s in args.sparsities.split(",")]
        args.widths = [int(w) for w in args.widths.split(",")]
    except ValueError as error:
        raise die(f"bench prune: bad --sparsities, --widths or --low-rank: {error}") from None
    if args.steps < 6 or args.repeats < 1 or args.rounds < 1:
        raise die("bench prune: --steps must be >= 6, --repeats and --rounds >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    group = comm.world()
    if args.structured:  # heads and channels removed, the weights sliced
        try:
            return (prune_profile if args.profile else prune_structured).main(args, group)
        except BadConfig as error:
            raise die(f"bench prune --structured: {error}") from None
    print0(
        f"bench prune: GPT {args.n_layer} layers, widths {args.widths}, block "
        f"{args.block_size}, global batch {args.batch_size}, {args.steps} steps, float32 | "
        f"{group.size} ranks | sparsities {args.sparsities}"
    )
    try:
        rows = measure(args, group)
    except BadConfig as error:
        raise die(f"bench prune: {error}") from None
    if group.rank == 0:
        columns = [("width", "d"), ("sparsity", ".2f"), ("nonzero_weights", "d"),
                   ("val_loss", ".4f"), ("val_vs_dense", ".3f"), ("bytes_per_step", ".0f"),
                   ("bytes_vs_dense", ".3f"), ("step_ms", ".1f")]  # fmt: skip
        print_table(rows, columns)
        plot(rows, args.out)
        write_json(args.json, rows)
    return 0
