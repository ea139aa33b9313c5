"""Loss curves of finished runs side by side, from their `--json` records.

    python -m minidp --strategy dp --json dp.jsonl
    mpiexec -n 4 python -m minidp --strategy zero --json zero.jsonl
    python -m minidp plot dp.jsonl zero.jsonl --png loss_curves.png

A run's file holds one record per logged step (`step`, `loss`, ...) and, when the run
finished, a final record (`final_loss`, `val_loss`, `strategy`, `world_size`, ...; see
tools/records.py). Each run is one line, x = step and y = loss, labelled by its file
name, strategy, ranks and precision; its validation loss, measured once at the end, is a
marker at the last step, and the steps a loss scaler skipped (--precision fp16's
`overflow_at`) are crosses on its curve. The numbers are printed too (the picture needs
matplotlib, the table does not):

    run          strategy  ranks  steps  first loss  final loss  val loss  skipped
    dp.jsonl     dp            1    200      4.5920      2.5763    2.6012        0
"""

import json
import os

from minidp.tools.log import die, print0
from minidp.tools.parser import Parser
from minidp.tools.plots import pyplot, save


class Run:
    """One run's file: its step records (step, loss) and its final record, if any."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise die(f"plot: {path}: no such file")
        self.path, self.name = path, os.path.basename(path)
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.final: dict = {}
        with open(path) as file:
            for line in file:
                try:
                    record = json.loads(line)
                except ValueError:  # not a record (a line cut by a crash, or another file)
                    continue
                if not isinstance(record, dict):
                    continue
                if "final_loss" in record:
                    self.final = record
                elif isinstance(record.get("step"), int) and "loss" in record:
                    self.steps.append(record["step"])
                    self.losses.append(float(record["loss"]))
        if not self.steps:
            raise die(
                f"plot: {path} holds no step records (give the --json FILE of a training run)"
            )

    @property
    def strategy(self) -> str:
        return str(self.final.get("strategy", "?"))

    @property
    def label(self) -> str:
        if not self.final:
            return f"{self.name} (unfinished)"
        ranks, precision = self.final.get("world_size", "?"), self.final.get("precision", "fp32")
        half = f", {precision}" if precision != "fp32" else ""
        return f"{self.name} ({self.strategy}, {ranks} rank{'' if ranks == 1 else 's'}{half})"

    @property
    def skipped(self) -> list[int]:
        """The steps that did not update: a loss scaler's overflows, and non-finite ones."""
        return sorted({*self.final.get("overflow_at", []), *self.final.get("skipped_steps", [])})

    @property
    def final_loss(self) -> float:
        return float(self.final.get("final_loss", self.losses[-1]))


def table(runs: list[Run]) -> str:
    """The printed numbers: one row per run."""
    width = max(len("run"), *(len(run.name) for run in runs))
    lines = [
        f"{'run':<{width}}  strategy  ranks  steps  first loss  final loss  val loss  skipped",
    ]
    for run in runs:
        val = run.final.get("val_loss")
        lines.append(
            f"{run.name:<{width}}  {run.strategy:<8}  {str(run.final.get('world_size', '?')):>5}"
            f"  {run.steps[-1] + 1:>5}  {run.losses[0]:>10.4f}  {run.final_loss:>10.4f}"
            f"  {'-' if val is None else f'{val:.4f}':>8}  {len(run.skipped):>7}"
        )
    return "\n".join(lines)


def draw(runs: list[Run], png: str) -> str | None:
    """The curves, one line per run, saved as `png` (None without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        (line,) = ax.plot(run.steps, run.losses, label=run.label)
        if run.final.get("val_loss") is not None:
            ax.plot([run.steps[-1]], [run.final["val_loss"]], "o", color=line.get_color())
        at = dict(zip(run.steps, run.losses))  # the skipped steps that were logged
        if logged := [s for s in run.skipped if s in at]:
            ax.plot(logged, [at[s] for s in logged], "x", color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (dots: validation at the end; x: skipped)")
    ax.set_title("loss curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, png)


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="minidp plot", description="Loss curves of runs side by side (their --json files)."
    )
    parser.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="--json files of runs")
    parser.add_argument(
        "--png", default="loss_curves.png", help="the picture (default: loss_curves.png)"
    )
    args = parser.parse_args(argv)
    runs = [Run(path) for path in args.runs]
    print0(table(runs))
    draw(runs, args.png)
    return 0
