"""Pipeline parallelism, measured against theory: the bubble, and activations per stage.

    mpiexec -n 4 python -m minidp bench pp [--delay-ms 20] [--steps 3] [--json FILE] [--out DIR]

Bubble. On a 2-core machine four stages fight for the cores, so each layer is given a fixed
compute time instead: every Linear of a small MLP (one layer per stage, widths 16) is
followed by a delay op (the public op API) that sleeps d = --delay-ms in forward and d in
backward, so a stage's time is its own and the schedule's units are real:

    F = d    the forward's sleep
    B = d/2  the delay op's backward sleeps d/2 and hands g on (the activation path)
    W = d/2  the other d/2 sleeps inside a weight gradient: the delay op's second parent
             is a 1x1 "clock" Parameter whose gradient is a Product (weight_grads.py)
             that sleeps when multiplied out, i.e. in W for ZB-H1 (backward_split.py
             keeps it uncomputed through B), inside the full backward otherwise

so a full backward is B + W = d and ZB-H1's split is simulate.py's F = 1, B = W = 1/2:
the measured bubble, the simulated one and the formula are in the same units. The
measured bubble is `measured_bubble` (idle over the step's window, every rank), the
median over --steps steps. p = 4 runs on the 4 ranks; p = 2 on the sub-group of ranks
0 and 1 (ranks 2 and 3 wait). Interleaved has V = 2 (one layer per virtual stage: each
rank does twice the work, as the formula assumes). What the measurement adds to the
model: each message's cost (the receives' probe yields the core between polls), Python's
per-action overhead, and sleep's oversleeping (tens of microseconds a call).

Memory (_pp_memory.py). A tiny GPT (float32, one block per stage) runs one step of each
schedule at p = 4, m = 8, with and without recomputation; each stage's `peak_in_flight`
(micro-batches held at once) against the simulator's and the formula's, and `peak_bytes`
(the arrays: memory.activation_bytes). Then interleaved (V = 2) at each p of --pps: each
rank's stages together against the simulator's and rank 0's formula, p (1 + (p-1)/(pV))
full-size stages (V p + p - 1 stages of 1/V of a rank).

Time diagrams: the measured spans of each schedule's last step at p = 4 (--diagram-m),
drawn with diagram.time_diagram in units of d, next to the simulated one.
"""

import time

import numpy as np

from minidp import comm
from minidp.comm.trace import Timeline as Trace
from minidp.engine import functional, nn
from minidp.engine.tensor import op
from minidp.fast.weight_grads import Product
from minidp.parallel.pipeline.actions import TICKS_PER_UNIT, Action
from minidp.parallel.pipeline.diagram import time_diagram
from minidp.parallel.pipeline.executor import measured_bubble, run_schedule, split_batch
from minidp.parallel.pipeline.schedules import build_schedule
from minidp.parallel.pipeline.simulate import Timeline, simulate
from minidp.parallel.pipeline.simulate import summary as simulated
from minidp.parallel.pipeline.split import split_model
from minidp.parallel.pipeline.stage import PipelineStage
from minidp.tools.log import print0
from minidp.tools.parser import Parser
from minidp_bench._common import environment, median, print_table, summary, write_json
from minidp_bench._pp_memory import SCHEDULES, memory_rows, rank_memory_rows, virtual_of


def parse_args(argv: list[str]):
    parser = Parser(prog="minidp bench pp", description=summary(__doc__))
    parser.add_argument("--delay-ms", type=float, default=20.0, help="F per layer (default 20)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--pps", default="2,4", help="pipeline sizes (default 2,4)")
    parser.add_argument("--micro-batches", default="1,2,4,8", help="m values (default 1,2,4,8)")
    parser.add_argument("--memory-m", type=int, default=8, help="m of the memory table (8)")
    parser.add_argument("--diagram-m", type=int, default=4, help="m of the diagrams (4)")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    parser.add_argument("--out", default="runs/bench_pp", help="directory for the PNGs")
    return parser.parse_args(argv)


# ---- the delay: a layer whose time is its own -----------------------------------------------
class SleepingProduct(Product):
    """A weight gradient that sleeps `seconds` when multiplied out: W's time."""

    def __init__(self, x, g, seconds: float):
        super().__init__(x, g)
        self.seconds = seconds

    def value(self):
        time.sleep(self.seconds)
        return super().value()


def delay(x, clock, seconds: float):
    """x itself, taking `seconds` in forward, seconds/2 in B (x's gradient) and seconds/2
    in W (`clock`'s gradient, computed when the weight gradients are)."""
    time.sleep(seconds)
    ones = np.ones((1, 1), clock.dtype)

    def backward(g):
        time.sleep(seconds / 2)  # B
        return g, SleepingProduct(ones, np.zeros((1, 1), clock.dtype), seconds / 2)  # W

    return op(x.data, (x, clock), backward)


class Delayed(nn.Module):
    """A Linear followed by the delay op (its own 1x1 clock Parameter)."""

    def __init__(self, linear: nn.Linear, seconds: float):
        self.linear, self.seconds = linear, seconds
        self.clock = nn.Parameter(np.zeros((1, 1)), dtype=np.float32)

    def forward(self, x):
        return delay(self.linear(x), self.clock, self.seconds)


def delayed_mlp(layers: int, seconds: float) -> nn.MLP:
    mlp = nn.MLP([16] * (layers + 1), rng=np.random.default_rng(0), fuse_relu=False)
    mlp.layers = [Delayed(layer, seconds) for layer in mlp.layers]
    return mlp


# ---- one schedule, timed ----------------------------------------------------------------------
def run_steps(name, pp, m, group, steps, seconds, inputs, targets):
    """`steps` steps (after one to warm up) of schedule (name, pp, m) on `group`: each
    step's measured bubble, and this rank's spans of the last (start us, duration us, name)."""
    schedule = build_schedule(name, pp, m, virtual_of(name))
    stages = delayed_stages(schedule, group, seconds)
    xs, ys, shares = split_batch(inputs, targets, m)
    trace, bubbles = Trace(enabled=True), []
    for _ in range(steps + 1):  # the first step warms up
        first = len(trace.events)
        comm.barrier(group=group)
        run_schedule(schedule, stages, xs, ys, shares, trace)
        bubbles.append(measured_bubble(trace, group, first))
        for stage in stages.values():
            for p in stage.parameters():
                p.grad = None
    spans = [(trace.t0 * 1e6 + e["ts"], e["dur"], e["name"]) for e in trace.events[first:]]
    return bubbles[1:], spans


def delayed_stages(schedule, group, seconds: float) -> dict:
    """This rank's PipelineStages of a delayed MLP with one layer per stage (MSE loss)."""
    S = schedule.num_stages
    parts = split_model(delayed_mlp(S, seconds), S)
    mine = schedule.stages_of(group.rank)
    return {s: PipelineStage(parts[s], s, S, group, loss_fn=functional.mse) for s in mine}


def measured_timeline(spans_by_rank, pp, num_stages, split, seconds) -> Timeline:
    """The gathered spans as simulate.py's Timeline, in ticks of d / TICKS_PER_UNIT."""
    t0 = min(t for spans in spans_by_rank for t, _, _ in spans)
    tick = seconds * 1e6 / TICKS_PER_UNIT
    rows = []
    for spans in spans_by_rank:
        row = []
        for t, dur, label in sorted(spans):
            kind, where = label.split()
            s, j = where.split(".")
            row.append(((t - t0) / tick, (t - t0 + dur) / tick, Action(int(s), kind, int(j))))
        rows.append(row)
    return Timeline(pp, num_stages, split, rows)


def gathered_spans(spans, group) -> list | None:
    """Every rank's spans, in rank order, on the group's rank 0 (None elsewhere)."""
    return group.comm.gather(spans, root=0)


# ---- the tables -------------------------------------------------------------------------------
def bubble_rows(args, world, pps, ms) -> tuple[list[dict], dict]:
    """One row per (schedule, p, m); and each schedule's measured Timeline at the largest p."""
    seconds = args.delay_ms / 1e3
    rows, diagrams = [], {}
    rng = np.random.default_rng(0)
    for pp in pps:
        group = world if pp == world.size else world.subgroup(list(range(pp)))
        if group is None:
            continue  # not in this pipeline: wait for it at the next collective over world
        for name in SCHEDULES:
            for m in ms:
                inputs = rng.standard_normal((8 * m, 16)).astype(np.float32)
                targets = np.zeros((8 * m, 16), np.float32)
                bubbles, spans = run_steps(name, pp, m, group, args.steps, seconds, inputs, targets)
                sim = simulated(build_schedule(name, pp, m, virtual_of(name)))
                rows.append({
                    "schedule": name, "p": pp, "m": m, "V": virtual_of(name),
                    "measured": median(bubbles), "simulated": sim["bubble_fraction"],
                    "formula": sim["formula_bubble"], "exact": sim["formula_holds"],
                    "formula_text": sim["formula"], "bubbles": bubbles,
                })  # fmt: skip
                everyone = gathered_spans(spans, group)
                if pp == max(pps) and m == args.diagram_m and group.rank == 0:
                    schedule = build_schedule(name, pp, m, virtual_of(name))
                    diagrams[name] = (
                        measured_timeline(
                            everyone, pp, schedule.num_stages, schedule.split_backward, seconds
                        ),
                        schedule,
                    )
        if group is not world:
            group.free()
    comm.barrier(group=world)
    return rows, diagrams


def slashed(values, spec="d") -> str:
    return "/".join(format(v, spec) for v in values)


def main(argv: list[str]) -> int:
    from threadpoolctl import threadpool_limits

    args = parse_args(argv)
    with threadpool_limits(limits=1, user_api="blas"):
        return measure(args)


def measure(args) -> int:
    world = comm.world()
    world.checks = False
    pps = [int(p) for p in args.pps.split(",")]
    ms = [int(m) for m in args.micro_batches.split(",")]
    if max(pps) > world.size:
        print0(f"bench pp: --pps {args.pps} needs {max(pps)} ranks, the world has {world.size}")
        return 2
    print0(
        f"bench pp | world {world.size} | MLP 16 wide, one Linear per stage, F = "
        f"{args.delay_ms:g} ms, B = W = {args.delay_ms / 2:g} ms (sleeps) | {args.steps} "
        f"steps, median | {environment()['blas']}"
    )
    rows, diagrams = bubble_rows(args, world, pps, ms)
    memory = memory_rows(args, world)
    per_rank = rank_memory_rows(args, world, pps)
    if world.rank == 0:
        print0("\nbubble fraction: measured (median) / simulated / formula")
        print_table(
            rows,
            [("schedule", ""), ("p", "d"), ("m", "d"), ("V", "d"), ("measured", ".3f"),
             ("simulated", ".3f"), ("formula", ".3f"), ("exact", "")],
        )  # fmt: skip
        print0(f"\npeak activations per stage, p = {world.size}, m = {args.memory_m}")
        table = [
            {**r, "in_flight": slashed(r["in_flight"]), "simulated": slashed(r["simulated"]),
             "formula": slashed(r["formula"]), "peak_KB": slashed(r["peak_KB"], ".1f")}
            for r in memory
        ]  # fmt: skip
        print_table(
            table,
            [("schedule", ""), ("V", "d"), ("recompute", ""), ("in_flight", ""),
             ("simulated", ""), ("formula", ""), ("peak_KB", "")],
        )  # fmt: skip
        print0(f"\npeak activations per rank (its stages together), m = {args.memory_m}")
        print_table(
            [{**r, "measured": slashed(r["measured"]), "simulated": slashed(r["simulated"])}
             for r in per_rank],
            [("schedule", ""), ("p", "d"), ("V", "d"), ("measured", ""), ("simulated", ""),
             ("formula_rank0", "d"), ("full_rank0", "g"), ("1f1b_rank0", "d")],
        )  # fmt: skip
        write_json(
            args.json,
            [{**r, "table": "bubble"} for r in rows]
            + [{**r, "table": "memory"} for r in memory]
            + [{**r, "table": "memory_per_rank"} for r in per_rank],
        )
        for name, (measured, schedule) in diagrams.items():
            tag = f"{name}_p{schedule.pp}_m{schedule.micro_batches}"
            time_diagram(measured, f"{args.out}/measured_{tag}.png", f"{tag}, measured")
            sim = simulate(
                schedule.compute_actions(), schedule.pp, schedule.num_stages,
                schedule.split_backward,
            )  # fmt: skip
            time_diagram(sim, f"{args.out}/simulated_{tag}.png", f"{tag}, simulated")
    return 0
