"""Predicted against measured step time, for dp, zero 1-3, tp, hybrid (each of these two also
with sequence parallelism), pp, ps (also with a sleeping worker) and compressed dp at P = 2
and 4.

    python -m minidp bench predict [--rounds 3] [--steps 31] [--procs 2,4] [--json FILE]

No MPI here: it launches the runs (`mpiexec -n P python -m minidp ... --json`). Each round,
for every layout in turn (so that the machine's other load falls on all of them alike):

    predicted   `mpiexec -n P python -m minidp predict FLAGS`, just before the run: each of the
                P ranks measures its compute at once (the core sharing is in the
                measurement) and the per-call cost is timed on them
    alone       cost/predict.py's `run_prediction` as `python -m minidp predict --world P`
                makes it on one process: compute measured here, stretched by P / cores when
                the P ranks outnumber the cores, the calibration's per-call cost (its
                Python layer, checks off, on a quiet machine: no waits for a peer)
    measured    the run's step time: the median over its log windows (--log-every 5) after
                the first (step 0 warms up), from the records' tokens per second
    in_run      the prediction the run's own --json record carries (made as `predicted`, on
                the run's ranks after its last step)

ratio = predicted / measured per round; the table shows the medians over rounds, `ok` when
within 25%. α, β, γ, δ: runs/calibration.json (`mpiexec -n 2 python -m minidp bench calibrate`).
For ps under ASP/SSP, a line each: the staleness histograms of its rounds' runs summed,
their mean beside the model's (cost/ps_step.py's mean_staleness).
"""

import json
import os
import subprocess
import sys
import tempfile

from minidp.tools.log import die
from minidp.tools.parser import Parser
from minidp_bench._common import median, print_table, write_json

SLOW = ["--ps-slow-worker-ms", "10"]  # a straggler: the last worker sleeps 10 ms a step
LAYOUTS = {  # name -> (train flags, the P it runs at)
    "dp": (["--strategy", "dp"], (2, 4)),
    "zero1": (["--strategy", "zero", "--zero-stage", "1"], (2, 4)),
    "zero2": (["--strategy", "zero", "--zero-stage", "2"], (2, 4)),
    "zero3": (["--strategy", "zero", "--zero-stage", "3"], (2, 4)),
    "tp": (["--strategy", "tp"], (2, 4)),
    "hybrid": (["--strategy", "hybrid", "--dp", "2", "--tp", "2"], (4,)),
    "tp-sp": (["--strategy", "tp", "--sequence-parallel"], (2, 4)),
    "hybrid-sp": (["--strategy", "hybrid", "--dp", "2", "--tp", "2", "--sequence-parallel"], (4,)),
    "pp-gpipe": (["--strategy", "pp", "--n-layer", "4", "--schedule", "gpipe"], (2, 4)),
    "pp-1f1b": (["--strategy", "pp", "--n-layer", "4", "--schedule", "1f1b"], (2, 4)),
    "ps": (["--strategy", "ps", "--servers", "1"], (2, 4)),  # BSP: 1 or 3 workers
    "ps-asp": (["--strategy", "ps", "--servers", "1", "--consistency", "asp"], (2, 4)),
    "ps-ssp": (["--strategy", "ps", "--servers", "1", "--consistency", "ssp:2"], (2, 4)),
    "ps-slow": (["--strategy", "ps", "--servers", "1", *SLOW], (4,)),  # the last of 3 sleeps
    "ps-asp-slow": (["--strategy", "ps", "--servers", "1", "--consistency", "asp", *SLOW], (4,)),
    "ps-ssp-slow": (["--strategy", "ps", "--servers", "1", "--consistency", "ssp:2", *SLOW], (4,)),
    "dp-topk": (["--strategy", "dp", "--compress", "topk:0.01"], (2, 4)),
    "dp-fp16": (["--strategy", "dp", "--compress", "fp16"], (2, 4)),
    "dp-sign": (["--strategy", "dp", "--compress", "sign"], (2, 4)),
    "dp-powersgd": (["--strategy", "dp", "--compress", "powersgd:2"], (2, 4)),
}  # pp: 4 blocks (a stage each at P = 4), --micro-batches 4 (the default)
COLUMNS = [
    ("layout", ""),
    ("P", "d"),
    ("predicted_ms", ".1f"),
    ("compute_ms", ".1f"),
    ("comm_ms", ".2f"),
    ("per_call_us", ".0f"),
    ("measured_ms", ".1f"),
    ("ratio", ".2f"),
    ("ok", ""),
    ("in_run_ratio", ".2f"),
    ("alone_ratio", ".2f"),
]
WITHIN = 0.25


def measured_step_s(path: str) -> tuple[float, dict]:
    """(median step seconds over the log windows after the first, the final record)."""
    with open(path) as f:
        records = [json.loads(line) for line in f]
    final = records[-1]
    steps = [r for r in records[:-1] if "tokens_per_s" in r]
    batch = final["config"]["batch_size"] * final["config"]["block_size"]
    return median([batch / r["tokens_per_s"] for r in steps[1:]]), final


def staleness(runs) -> str:
    """'0: 50 | 1: 40 | mean 0.45, model 0.67': the runs' histograms summed, beside the model."""
    counts: dict[int, int] = {}
    for _, _, final, _ in runs:
        for clocks, n in final["staleness_histogram"].items():
            counts[int(clocks)] = counts.get(int(clocks), 0) + n
    mean = sum(s * n for s, n in counts.items()) / max(1, sum(counts.values()))
    line = " | ".join(f"{s}: {n}" for s, n in sorted(counts.items()))
    return f"{line} | mean {mean:.2f}, model {runs[0][2]['predicted_staleness_mean']:.2f}"


def run_once(P: int, flags: list[str], path: str, steps: int = 0) -> None:
    """`mpiexec -n P python -m minidp FLAGS --json path`: a run of `steps`, or (0) predict."""
    command = ["mpiexec", "-n", str(P), sys.executable, "-m", "minidp"]
    if steps:
        command += [*flags, "--steps", str(steps), "--log-every", "5", "--eval-batches", "1"]
        command += ["--sample-tokens", "0", "--json", path]
    else:
        command += ["predict", *flags, "--json", path]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise die(f"bench predict: {' '.join(command)} failed:\n{done.stderr[-2000:]}", code=1)


def main(argv: list[str] | None = None) -> int:
    from minidp.cli.commands import parse_train_args
    from minidp.cost.predict import load_network, run_prediction

    parser = Parser(prog="minidp bench predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--steps", type=int, default=31, help="steps per run (default 31)")
    parser.add_argument("--procs", default="2,4", help="world sizes (default 2,4)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="which layouts")
    parser.add_argument("--calibration", metavar="FILE", help="α β γ (default: runs/...)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON lines")
    args = parser.parse_args(argv)
    procs = [int(p) for p in args.procs.split(",")]
    names = args.layouts.split(",")
    if unknown := [n for n in names if n not in LAYOUTS]:
        raise die(f"--layouts: unknown {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if args.rounds < 1 or args.steps < 11:
        raise die("--rounds must be >= 1 and --steps >= 11 (two log windows after step 0)")
    cores = os.cpu_count() or 1
    network, source = load_network(args.calibration, cores)
    cases = [(n, P) for n in names for P in procs if P in LAYOUTS[n][1]]
    seen = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, P in cases[r % len(cases) :] + cases[: r % len(cases)]:  # rotated
                flags = LAYOUTS[name][0]
                config = parse_train_args(flags)
                threads = max(1, cores // P)
                prediction, _ = run_prediction(
                    config, P, cores=cores, network=network, threads=threads
                )
                before = os.path.join(tmp, f"{name}_{P}_predict.jsonl")
                run_once(P, flags, before)
                with open(before) as f:
                    predicted = json.loads(f.readline())
                path = os.path.join(tmp, f"{name}_{P}.jsonl")
                run_once(P, flags, path, args.steps)
                measured, final = measured_step_s(path)
                seen[(name, P)].append((predicted, measured, final, prediction.step_s))
    rows = []
    for (name, P), runs in seen.items():
        ratio = median([p["predicted_step_s"] / m for p, m, _, _ in runs])
        rows.append(
            {
                "layout": name,
                "P": P,
                "predicted_ms": 1e3 * median([p["predicted_step_s"] for p, _, _, _ in runs]),
                "compute_ms": 1e3 * median([p["predicted_compute_s"] for p, _, _, _ in runs]),
                "comm_ms": 1e3 * median([p["predicted_exposed_comm_s"] for p, _, _, _ in runs]),
                "per_call_us": 1e6 * median([p["predicted_per_call_s"] for p, _, _, _ in runs]),
                "measured_ms": 1e3 * median([m for _, m, _, _ in runs]),
                "ratio": ratio,
                "ok": "yes" if abs(ratio - 1) <= WITHIN else "no",
                "in_run_ratio": median([f["predicted_step_s"] / m for _, m, f, _ in runs]),
                "alone_ratio": median([a / m for _, m, _, a in runs]),
            }
        )
    print(
        f"# {args.rounds} rounds, {args.steps} steps per run, {cores} cores; α β γ: {source}; "
        "ratio = predicted / measured (median of rounds)"
    )
    print_table(rows, COLUMNS)
    for (name, P), runs in seen.items():
        if "predicted_staleness_mean" in runs[0][2] and runs[0][2]["consistency"] != "bsp":
            print(f"# {name} P={P} staleness (clocks: updates) " + staleness(runs))
    ok = sum(r["ok"] == "yes" for r in rows)
    print(f"# within {WITHIN:.0%}: {ok} of {len(rows)} rows")
    write_json(args.json, rows)
    return 0
