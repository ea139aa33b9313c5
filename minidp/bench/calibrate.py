"""Fit α, β, γ on this machine, then check minidp.cost's times against the real collectives.

    mpiexec -n 2 python -m minidp bench calibrate [--out runs/calibration.json] [--json FILE]
    mpiexec -n 4 python -m minidp bench calibrate --calibration runs/calibration.json

The α-β-γ model (Thakur, Rabenseifner & Gropp 2005) prices a message of n bytes at α + nβ
and a reduction at γ per byte. Three measurements give the three numbers:

    α, β   ping-pong between ranks 0 and 1 (MPI Send and Recv of raw bytes, as p2p.py
           ships them), n = 0 B to 16 MiB: one-way time t(n) = round trip / 2, the median
           of --iters; α is the 0 B time, β the least squares slope (in seconds, so
           the large sizes lead) of t(n) = α + nβ
    γ      the reduction every algorithm runs after a receive, comm.reduce_ops.combine:
           np.add(received, chunk, out=target) on float32, 64 KiB to 16 MiB on rank 0;
           the least squares slope (free intercept) is γ, seconds per byte of an operand

Fit quality: the largest |fit / measured - 1| over the sizes, and R² of the line in seconds.

Then the check: every algorithm of allreduce, reduce_scatter and allgather in PLAN, at each
--sizes and at the world size it is launched with, timed as `bench collectives` times it
(checks off, buffers allocated once, Barrier then the slowest rank's time, the algorithms of
one collective alternated in rotated rounds, medians), beside cost.time(...) with the fitted
α, β, γ; ratio = predicted / measured, `ok` when within 25%; ratio_exchange: the same with
α and β fitted to the exchange (Sendrecv both ways at once, a ring's or a butterfly's step)
instead of the ping-pong. With --calibration FILE the fit is read from FILE instead of
measured (fit at P = 2, check at P = 3, 4: ranks beyond two would share the cores with the
ping-pong).
"""

import datetime
import json
import os
import platform
import time

import numpy as np
from mpi4py import MPI

from minidp import comm, cost
from minidp.bench._common import environment, median, print_table, rotated_rounds, write_json
from minidp.bench.collectives import contenders, human, parse_size
from minidp.comm.reduce_ops import combine
from minidp.log import die, print0
from minidp.parser import Parser

PLAN = {
    "allreduce": ("ring", "recursive_doubling", "rabenseifner", "tree", "naive"),
    "reduce_scatter": ("ring", "recursive_halving"),
    "allgather": ("ring", "recursive_doubling"),
}
"""collective -> the algorithms the check times (each has a formula in cost/formulas.py)."""
PING_SIZES = "0,64,1K,4K,16K,64K,256K,1M,4M,16M"
REDUCE_SIZES = "64K,256K,1M,4M,16M"
CHECK_SIZES = "64K,256K,1M,4M,16M"
WITHIN = 0.25  # the goal: predicted within 25% of measured


def fit_line(sizes: list[int], times: list[float]) -> dict:
    """t(n) = a + n·b by least squares in seconds, a, b >= 0. Given a 0 B point, a is its
    time (the latency, which the free fit, led by the largest sizes, would miss) and b the
    least squares slope through it; else both are free (a negative one fixed at 0, the other
    refitted). With the fit's quality: R² and the largest |fit/measured - 1|."""
    n, t = np.asarray(sizes, float), np.asarray(times, float)
    if 0 in sizes:
        a = float(t[n == 0].min())
        b = max(float(n @ (t - a) / (n @ n)), 0.0) if n.any() else 0.0
    else:
        a, b = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), t, rcond=None)[0]
        if b < 0:
            a, b = float(t.mean()), 0.0
        elif a < 0:
            a, b = 0.0, float(n @ t / (n @ n))
    fitted = a + b * n
    residual, spread = np.sum((fitted - t) ** 2), np.sum((t - np.mean(t)) ** 2)
    return {
        "intercept": float(a),
        "slope": float(b),
        "r2": float(1 - residual / spread) if spread > 0 else 1.0,
        "max_rel_error": float(np.max(np.abs(fitted / t - 1))),
        "points": [{"bytes": int(s), "time_s": float(x)} for s, x in zip(sizes, times)],
    }


def ping_pong(mpi, sizes: list[int], warmup: int, iters: int, exchange=False) -> list[float]:
    """One-way seconds per size between ranks 0 and 1 (round trip / 2, the median of iters),
    measured on rank 0; every other rank waits. Returns the list on every rank. exchange:
    instead, both send at once (one Sendrecv each, as a ring's step), the time of one."""
    r, times = mpi.Get_rank(), []
    for nbytes in sizes:  # written buffers, as a collective's: np.zeros' untouched pages
        buf, back = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
        rounds = []
        mpi.Barrier()
        for i in range(warmup + iters):
            start = time.perf_counter()
            if exchange and r < 2:
                mpi.Sendrecv([buf, MPI.BYTE], 1 - r, 0, [back, MPI.BYTE], 1 - r, 0)
            elif r == 0:
                mpi.Send([buf, MPI.BYTE], 1, 0)
                mpi.Recv([buf, MPI.BYTE], 1, 0)
            elif r == 1:
                mpi.Recv([buf, MPI.BYTE], 0, 0)
                mpi.Send([buf, MPI.BYTE], 0, 0)
            if i >= warmup:
                rounds.append((time.perf_counter() - start) / (1 if exchange else 2))
        times.append(median(rounds) if r == 0 else 0.0)
    return mpi.bcast(times, root=0)


def reduction(mpi, sizes: list[int], warmup: int, iters: int) -> list[float]:
    """Seconds of one combine("sum", received, chunk, out=target) per size (bytes of one
    float32 operand), three distinct buffers as the ring's step has them; rank 0 measures."""
    times = []
    for nbytes in sizes if mpi.Get_rank() == 0 else []:
        n = max(nbytes // 4, 1)
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
        out = np.empty_like(a)
        rounds = []
        for i in range(warmup + iters):
            start = time.perf_counter()
            combine("sum", a, b, out=out)
            if i >= warmup:
                rounds.append(time.perf_counter() - start)
        times.append(median(rounds))
    return mpi.bcast(times, root=0)


def calibrate(mpi, args) -> dict:
    """{alpha, beta, gamma, their fits, where and when}: measured as the docstring says."""
    ping = [parse_size(s) for s in args.ping_sizes.split(",")]
    reduce = [parse_size(s) for s in args.reduce_sizes.split(",")]
    if mpi.Get_size() < 2:
        raise die("bench calibrate: the ping-pong needs 2 ranks (mpiexec -n 2)")
    link = fit_line(ping, ping_pong(mpi, ping, args.warmup, args.iters))
    both = fit_line(ping, ping_pong(mpi, ping, args.warmup, args.iters, exchange=True))
    add = fit_line(
        [max(s // 4, 1) * 4 for s in reduce], reduction(mpi, reduce, args.warmup, args.iters)
    )
    return {
        "alpha": link["intercept"],
        "beta": link["slope"],
        "gamma": add["slope"],
        "ping_pong": link,
        "reduction": add,
        "exchange": both,  # not used by the check: printed beside α, β for comparison
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "nprocs": mpi.Get_size(),
        "env": environment(),
    }


def check(
    group, model: dict, sizes: list[int], warmup: int, iters: int, plan: dict = PLAN
) -> list[dict]:
    """One row per (collective, algorithm, size) of `plan`: the median measured time of the
    real collective (the slowest rank's) beside cost.time's prediction with model's α, β, γ."""
    rows, dtype, p = [], np.dtype(np.float32), group.size
    for op, algos in plan.items():
        for nbytes in sizes:
            steps = {algo: contenders(op, algo, nbytes, dtype, group)[0] for algo in algos}
            times = rotated_rounds(steps, warmup, iters, group.comm)
            n = max(nbytes // dtype.itemsize, 1)
            for algo in algos:
                measured = median(times[algo])
                predicted = cost.time(
                    op, algo, p, n, dtype.itemsize,
                    alpha=model["alpha"], beta=model["beta"], gamma=model["gamma"],
                )  # fmt: skip
                ratio = predicted / measured
                x = model["exchange"]  # the same, α and β from the exchange instead
                both_ways = cost.time(
                    op, algo, p, n, dtype.itemsize,
                    alpha=x["intercept"], beta=x["slope"], gamma=model["gamma"],
                )  # fmt: skip
                rows.append(
                    {
                        "op": op, "algo": algo, "bytes": n * dtype.itemsize,
                        "size": human(n * dtype.itemsize), "nprocs": p,
                        "measured_us": measured * 1e6, "predicted_us": predicted * 1e6,
                        "ratio": ratio, "ok": "yes" if abs(ratio - 1) <= WITHIN else "no",
                        "ratio_exchange": both_ways / measured,
                    }
                )  # fmt: skip
    return rows


COLUMNS = [
    ("op", ""),
    ("algo", ""),
    ("size", ""),
    ("nprocs", "d"),
    ("measured_us", ".1f"),
    ("predicted_us", ".1f"),
    ("ratio", ".2f"),
    ("ok", ""),
    ("ratio_exchange", ".2f"),
]


def print_fit(model: dict) -> None:
    for name, fit in (("ping-pong", "ping_pong"), ("reduction", "reduction")):
        f = model[fit]
        print0(
            f"# {name}: {len(f['points'])} sizes, R² {f['r2']:.4f}, "
            f"largest |fit/measured - 1| {f['max_rel_error']:.2f}"
        )
    x = model["exchange"]
    print0(
        f"# exchange (Sendrecv both ways at once): {x['intercept'] * 1e6:.2f} us + "
        f"{x['slope'] * 1e12:.1f} ps/B, R² {x['r2']:.4f}, largest |fit/measured - 1| "
        f"{x['max_rel_error']:.2f}"
    )
    a, b, g = model["alpha"], model["beta"], model["gamma"]
    print0(
        f"alpha = {a * 1e6:.2f} us   beta = {b * 1e12:.1f} ps/B ({1 / b / 1e9 if b else 0:.2f} "
        f"GB/s)   gamma = {g * 1e12:.1f} ps/B ({1 / g / 1e9 if g else 0:.2f} GB/s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="minidp bench calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ping-sizes", default=PING_SIZES, help="ping-pong bytes (K/M suffixes)")
    parser.add_argument("--reduce-sizes", default=REDUCE_SIZES, help="reduction bytes")
    parser.add_argument("--sizes", default=CHECK_SIZES, help="the check's bytes; empty: no check")
    parser.add_argument("--iters", type=int, default=15, help="timed repetitions (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed ones (default 2)")
    parser.add_argument("--calibration", metavar="FILE", help="read α, β, γ here, fit nothing")
    parser.add_argument("--out", default="runs/calibration.json", help="where the fit is saved")
    parser.add_argument("--json", metavar="FILE", help="write the check's rows as JSON lines")
    args = parser.parse_args(argv)
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    group = comm.Group(MPI.COMM_WORLD.Dup(), checks=False)  # no fingerprints, as MPI runs
    if args.calibration:
        with open(args.calibration) as f:
            model = json.load(f)
        print0(f"# α, β, γ from {args.calibration} ({model['date']}, P = {model['nprocs']})")
    else:
        model = calibrate(group.comm, args)
        if group.rank == 0:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(model, f, indent=1)
        print0(f"# fitted on ranks 0 and 1 of {group.size}, saved to {args.out}")
    print_fit(model)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if sizes:
        rows = check(group, model, sizes, args.warmup, args.iters)
        if group.rank == 0:
            print0(
                f"# {group.size} ranks on {os.cpu_count()} cores, float32, checks off, median "
                f"of {args.iters} after {args.warmup} warm-up; ratio = predicted / measured"
            )
            print_table(rows, COLUMNS)
            ok = sum(r["ok"] == "yes" for r in rows)
            print0(f"# within {WITHIN:.0%}: {ok} of {len(rows)} rows")
            write_json(
                args.json,
                [{**r, "model": {k: model[k] for k in "alpha beta gamma".split()}} for r in rows],
            )
    group.free()
    return 0
