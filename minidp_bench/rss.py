"""Peak memory as the OS counts it: each configuration trained as its own job, its ranks'
peak resident set size (getrusage) beside what the arrays account for, against one fp32
process. Then, with --cap-mb, the largest GPT each configuration trains under that cap.

    python -m minidp bench rss [--nprocs 4] [--n-layer 6 --n-embd 384 --block-size 128]
                               [--batch-size 8] [--steps 3] [--cap-mb 200] [--json FILE]

Run it serially (not under mpiexec): it launches `mpiexec -n N python -m minidp train ...
--json` once per row, because a peak RSS is a whole process's high-water mark, and one job
cannot measure several configurations. Rows: one process (fp32, and bf16 + recompute), then
on N ranks DP and ZeRO-1, -2, -3, each in fp32 and bf16, with and without --recompute. The
model states (parameters, gradients, optimizer) are checked against the ZeRO paper's
formulas: 4 + 4 + 8 bytes a parameter in fp32, 2 + 2 + 12 in bf16.

--cap-mb: for one process (fp32; bf16 + recompute) and N ranks (DP; ZeRO-3; ZeRO-3 + bf16
+ recompute), the widest GPT (--n-embd on a ladder, the other sizes as given) whose every
rank stays under the cap, found by running each under --max-memory-mb: a wider one is
refused at start or stopped in one line (counted), never killed. A PNG of peak RSS per
configuration goes to --out.
"""

import json
import os
import subprocess
import sys
import tempfile

from minidp.parallel.zero.stages import model_state_bytes
from minidp.tools.log import die
from minidp.tools.parser import Parser
from minidp.tools.plots import pyplot, save
from minidp_bench._common import environment, print_table, summary, write_json

STAGES = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
BYTES = {"fp32": (4, 8), "bf16": (2, 12)}  # (weight and gradient, optimizer) per parameter
LADDER = (128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def launch(
    args, nprocs: int, name: str, precision: str, recompute: bool, n_embd: int, cap_mb=0.0
) -> dict:
    """One training job; its final --json record. Under `cap_mb` (--max-memory-mb), a run
    refused at start or ended past the cap gives {"ended": its one line} instead."""
    stage = STAGES[name]
    flags = ["--strategy", "zero", "--zero-stage", str(stage)] if stage else ["--strategy", "dp"]
    flags += ["--precision", precision] + ["--recompute"] * recompute
    sizes = ["--n-layer", args.n_layer, "--n-embd", n_embd, "--n-head", args.n_head]
    sizes += ["--block-size", args.block_size, "--batch-size", args.batch_size]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl")
        quiet = ["--steps", args.steps, "--eval-batches", "1", "--sample-tokens", "0"]
        quiet += ["--max-memory-mb", cap_mb] if cap_mb else []
        cmd = [mpiexec(), "-n", nprocs, sys.executable, "-m", "minidp", "train", *flags,
               *sizes, *quiet, "--json", path]  # fmt: skip
        done = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=900)
        line = done.stderr.strip().splitlines()[-1:] or [""]
        capped = "out of memory" in line[0] or "--max-memory-mb" in line[0]
        if done.returncode != 0 and cap_mb and capped:
            return {"ended": line[0]}
        if done.returncode != 0:
            raise die(f"bench rss: {' '.join(map(str, cmd))} failed:\n{done.stderr[-2000:]}")
        with open(path) as f:
            return json.loads(f.read().splitlines()[-1])


def mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else "mpiexec"


def row_of(final: dict, name: str, precision: str, recompute: bool) -> dict:
    memory, n = final["memory_bytes"], final["world_size"]
    stage = STAGES[name]
    psi = final.get("shard_elements", 0) * n if stage == 3 else None
    states = memory["parameters"] + memory["gradients"] + memory["optimizer"]
    itemsize, k = BYTES[precision]
    psi = psi or memory["parameters"] // itemsize * (n if stage == 3 else 1)
    formula = sum(model_state_bytes(stage, psi, n, itemsize, k).values())
    return {
        "N": n, "strategy": name, "precision": precision, "recompute": recompute,
        "model_states": states, "formula": formula, "vs_formula": states / formula,
        "activations_peak": memory["activations_peak"], "peak_rss": max(final["peak_rss"]),
        "val_loss": final["val_loss"],
    }  # fmt: skip


def configurations(nprocs: int, names=tuple(STAGES)) -> list[tuple]:
    one = [(1, "dp", "fp32", False), (1, "dp", "bf16", True)]
    many = [
        (nprocs, name, precision, recompute)
        for name in names
        for precision in ("fp32", "bf16")
        for recompute in (False, True)
    ]
    return one + many


def largest_under(args, cap: float, config: tuple, ended: list) -> int | None:
    """The widest --n-embd of LADDER whose run keeps every rank under `cap` bytes, each run
    under --max-memory-mb: one past it is refused at start or ended after the step that
    passed it, in one line (kept in `ended`: "refused" or "stopped")."""
    nprocs, name, precision, recompute = config
    best, lo, hi = None, 0, len(LADDER) - 1
    while lo <= hi:  # peak RSS grows with the width: a binary search
        mid = (lo + hi) // 2
        final = launch(args, nprocs, name, precision, recompute, LADDER[mid], cap / 1e6)
        if "ended" in final:
            ended.append("stopped" if "peak RSS reached" in final["ended"] else "refused")
            hi = mid - 1
        else:
            best, lo = LADDER[mid], mid + 1
    return best


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(11, 4))
    labels = [
        f"{r['strategy']} N={r['N']}\n{r['precision']}{' +rc' * r['recompute']}" for r in rows
    ]
    ax.bar(labels, [r["peak_rss"] / 1e6 for r in rows], color="tab:gray", label="peak RSS")
    ax.bar(labels, [r["model_states"] / 1e6 for r in rows], label="model states")
    ax.axhline(rows[0]["peak_rss"] / 1e6, color="k", lw=0.8, ls="--", label="one fp32 process")
    ax.set_ylabel("MB per rank (the largest rank)")
    ax.set_title("peak RSS per rank, by configuration")
    ax.tick_params(axis="x", labelsize=6)
    ax.legend(fontsize=7)
    save(fig, path)


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench rss", description=summary(__doc__))
    for flag, default, what in (
        ("--nprocs", 4, "ranks of the parallel rows"),
        ("--n-layer", 6, "GPT blocks"),
        ("--n-embd", 384, "GPT channels (6 x 384: 10.7 M parameters)"),
        ("--n-head", 4, "GPT heads"),
        ("--block-size", 128, "tokens per sequence"),
        ("--batch-size", 8, "global batch, sequences"),
        ("--steps", 3, "training steps per run"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    parser.add_argument(
        "--strategies", default=",".join(STAGES), help="of dp,zero1,zero2,zero3 (default all)"
    )
    parser.add_argument("--cap-mb", type=float, help="find the widest GPT under this cap")
    parser.add_argument("--out", default="runs/bench_rss", help="where the PNG goes")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines")
    args = parser.parse_args(argv)
    if min(args.nprocs, args.n_layer, args.n_embd, args.n_head, args.steps) < 1:
        raise die("bench rss: --nprocs, sizes and --steps must be positive")
    if args.n_embd % args.n_head or (args.cap_mb and any(w % args.n_head for w in LADDER)):
        raise die("bench rss: --n-head must divide --n-embd (and with --cap-mb the ladder's)")
    args.strategies = args.strategies.split(",")
    if not set(args.strategies) <= set(STAGES):
        raise die(f"bench rss: --strategies: choose from {', '.join(STAGES)}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    env = environment()
    print(
        f"bench rss: GPT {args.n_layer} x {args.n_embd}, block {args.block_size}, batch "
        f"{args.batch_size}, {args.steps} steps, AdamW | {env['blas']}",
        flush=True,
    )
    rows = []
    for config in configurations(args.nprocs, args.strategies):
        rows.append(row_of(launch(args, *config, args.n_embd), *config[1:]))
        rows[-1]["vs_one_fp32"] = rows[-1]["peak_rss"] / rows[0]["peak_rss"]
        print(f"  {config}: peak RSS {rows[-1]['peak_rss'] / 1e6:.0f} MB", flush=True)
    print_table(rows, COLUMNS)
    plot(rows, os.path.join(args.out, "peak_rss.png"))
    if args.cap_mb:
        cap = args.cap_mb * 1e6
        n = args.nprocs
        capped = [(1, "dp", "fp32", False), (1, "dp", "bf16", True), (n, "dp", "fp32", False),
                  (n, "zero3", "fp32", False), (n, "zero3", "bf16", True)]  # fmt: skip
        fits = []
        for c in capped:
            ended: list[str] = []
            widest = largest_under(args, cap, c, ended)
            name = f"{c[1]} N={c[0]} {c[2]}{' +recompute' * c[3]}"
            counts = {"refused": ended.count("refused"), "stopped": ended.count("stopped")}
            fits.append({"config": name, "cap_mb": args.cap_mb, "widest_n_embd": widest, **counts})
        print(f"the widest GPT ({args.n_layer} layers) under --max-memory-mb {args.cap_mb:g}")
        print("(wider runs: refused at start, or stopped in one line past the cap)")
        print_table(fits, [("config", "s"), ("widest_n_embd", ""), ("refused", "d"),
                           ("stopped", "d")])  # fmt: skip
        rows += fits
    write_json(args.json, [{"bench": "rss", **env, **r} for r in rows])
    return 0


COLUMNS = [
    ("N", "d"), ("strategy", "s"), ("precision", "s"), ("recompute", ""),
    ("model_states", ",d"), ("formula", ",.0f"), ("vs_formula", ".4f"),
    ("activations_peak", ",d"), ("peak_rss", ",d"), ("vs_one_fp32", ".3f"), ("val_loss", ".4f"),
]  # fmt: skip
