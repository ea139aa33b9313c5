"""Collectives on an emulated network (comm/netem.py), against the cost model's prediction.

    MINIDP_NET_LATENCY_US=50 MINIDP_NET_GBITS=1 mpiexec -n 4 python -m minidp bench netem
    mpiexec -n 4 python -m minidp bench netem                       # the machine as it is
    mpiexec -n 4 python -m minidp bench netem --calibration runs/calibration.json

This machine's shared memory moves a message in microseconds at GB/s; the MINIDP_NET_*
variables make every message minidp sends wait α_e + n·β_e first. The model then prices a
message at (α₀ + α_e) + n·(β₀ + β_e): α₀, β₀, γ and δ are the machine's own, fitted here as
`bench calibrate` fits them (a ring step of raw MPI messages, which the emulation does not
touch, NumPy's add and copy), or read from its saved --calibration FILE.

Each algorithm of --ops at each of --sizes is timed as `bench calibrate` times its check
(checks off, buffers allocated once, each algorithm's calls back to back, the slowest
rank's time, medians) beside minidp.cost.time's prediction; ratio = predicted / measured.
Then, per size, the algorithm that was fastest and the one the model says is fastest, and
the tree's time over the ring's (measured and predicted): above 1, the ring wins.
"""

import json

from mpi4py import MPI

from minidp import comm
from minidp.comm.netem import network
from minidp.tools.log import die, print0
from minidp.tools.parser import Parser
from minidp_bench._common import print_table, write_json
from minidp_bench.calibrate import (
    COLUMNS,
    PING_SIZES,
    PLAN,
    REDUCE_SIZES,
    WITHIN,
    calibrate,
    check,
    print_fit,
)
from minidp_bench.collectives import parse_size


def with_network(model: dict, net) -> dict:
    """The machine's α₀, β₀ (and the ping-pong's) plus the emulated network's α_e, β_e."""
    if net is None:
        return model
    ping_pong = model["ping_pong"]
    return {
        **model,
        "alpha": model["alpha"] + net.latency_s,
        "beta": model["beta"] + net.seconds_per_byte,
        "ping_pong": {
            **ping_pong,
            "intercept": ping_pong["intercept"] + net.latency_s,
            "slope": ping_pong["slope"] + net.seconds_per_byte,
        },
    }


def winners(rows: list[dict]) -> list[dict]:
    """Per (collective, size): the fastest algorithm measured and predicted, and the tree's
    time over the ring's where both ran."""
    keyed: dict = {}
    for row in rows:
        keyed.setdefault((row["op"], row["size"]), []).append(row)
    table = []
    for (op, size), group in keyed.items():
        by_algo = {r["algo"]: r for r in group}
        line = {
            "op": op,
            "size": size,
            "fastest": min(group, key=lambda r: r["measured_us"])["algo"],
            "predicted_fastest": min(group, key=lambda r: r["predicted_us"])["algo"],
        }
        if "tree" in by_algo and "ring" in by_algo:
            tree, ring = by_algo["tree"], by_algo["ring"]
            line["tree/ring"] = tree["measured_us"] / ring["measured_us"]
            line["tree/ring_predicted"] = tree["predicted_us"] / ring["predicted_us"]
        table.append(line)
    return table


WINNER_COLUMNS = [
    ("op", ""),
    ("size", ""),
    ("fastest", ""),
    ("predicted_fastest", ""),
    ("tree/ring", ".2f"),
    ("tree/ring_predicted", ".2f"),
]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="minidp bench netem", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="allreduce", help="collectives (default allreduce)")
    parser.add_argument(
        "--algos",
        default="ring,tree,recursive_doubling,rabenseifner",
        help="algorithms, each timed for every op that has it",
    )
    parser.add_argument("--sizes", default="64K,1M,4M,16M", help="bytes (K/M suffixes)")
    parser.add_argument("--iters", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed ones (default 1)")
    parser.add_argument("--calibration", metavar="FILE", help="α₀, β₀, γ, δ from FILE, else fit")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON lines")
    args = parser.parse_args(argv)
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    group = comm.Group(MPI.COMM_WORLD.Dup(), checks=False)
    if group.size < 2:
        raise die("bench netem: launch 2 or more ranks (mpiexec -n 4)")
    plan = {}
    for op in args.ops.split(","):
        if op not in PLAN:
            raise die(f"bench netem: --ops takes {', '.join(PLAN)}, not {op!r}")
        plan[op] = tuple(a for a in args.algos.split(",") if a in PLAN[op])
        if not plan[op]:
            raise die(f"bench netem: --algos names none of {op}'s: {', '.join(PLAN[op])}")
    if args.calibration:
        with open(args.calibration) as f:
            base = json.load(f)
    else:
        args.ping_sizes, args.reduce_sizes = PING_SIZES, REDUCE_SIZES
        base = calibrate(group, args)
    net = network()
    print0(f"# {net.describe() if net else 'no emulated network'} (MINIDP_NET_*)")
    print0("# the machine's own (α₀, β₀, γ, δ):")
    print_fit(base)
    model = with_network(base, net)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    rows = check(group, model, sizes, args.warmup, args.iters, plan)
    if group.rank == 0:
        print0(
            f"# {group.size} ranks, float32, checks off, median of {args.iters} after "
            f"{args.warmup} warm-up; predicted with α = α₀ + α_e = {model['alpha'] * 1e6:.1f} "
            f"us, β = β₀ + β_e = {model['beta'] * 1e12:.1f} ps/B; ratio = predicted / measured"
        )
        print_table(rows, COLUMNS)
        ok = sum(r["ok"] == "yes" for r in rows)
        print0(f"# within {WITHIN:.0%}: {ok} of {len(rows)} rows")
        print_table(winners(rows), WINNER_COLUMNS)
        emulated = None if net is None else [net.latency_s, net.seconds_per_byte]
        write_json(args.json, [{**r, "network_alpha_beta": emulated} for r in rows])
    group.free()
    return 0
