"""Fit α, β, γ, δ on this machine, then check minidp.cost's times against the collectives.

    mpiexec -n 2 python -m minidp bench calibrate [--out runs/calibration.json] [--json FILE]
    mpiexec -n 4 python -m minidp bench calibrate --out runs/calibration4.json

The α-β-γ model (Thakur, Rabenseifner & Gropp 2005) prices a message of n bytes at α + nβ
and a reduction at γ per byte; δ a byte copied in memory (cost.copied: an allgather's own).
Each is measured as a collective's step runs it, on every rank of the launch at once:

    α, β   a ring step: every rank sends n bytes to its right neighbour while receiving n
           from its left, with MPI's Sendrecv (the call comm/p2p.py's sendrecv makes at
           every algorithm's step; an emulated network, netem.py, does not touch it),
           n = 0 B to 16 MiB, the slowest rank's time, median of --iters; α is the 0 B
           time, β the least squares slope (in seconds, so the large sizes lead) of
           t(n) = α + nβ
    γ      the reduction every algorithm runs after a receive, comm.reduce_ops.combine:
           np.add(received, chunk, out=target) on float32, 64 KiB to 16 MiB, on every rank
           at once; the least squares slope (free intercept), per byte of an operand
    δ      np.copyto of a float32 chunk, the same sizes, likewise
    per call   what a call of minidp's collectives costs beyond its messages (its Python
           layer, checks off): a one-element ring allreduce less its 2(p - 1)α

Every rank at once, because that is how a ring's or a butterfly's steps run: they share the
memory bus, and where ranks outnumber cores (P = 3, 4 here) they share the cores, which a
ping-pong between two ranks while the others wait would not see: the check fits at its own
P (`predict` reads one file, fitted at P = 2, and times the cores' sharing on the ranks, in
its per-call cost). The textbook ping-pong (ranks 0 and 1, one way = round trip / 2) is
fitted too and printed beside it, `ratio_ping_pong`: the check's ratio with its α and β.

Fit quality: the largest |fit / measured - 1| over the sizes, and R² of the line in seconds.

Then the check: every algorithm of allreduce, reduce_scatter and allgather in PLAN, at each
--sizes and at the world size it is launched with, timed as nccl-tests times a collective:
each algorithm's calls back to back on its own buffers allocated once (--warmup untimed,
then --iters timed; checks off; Barrier then the slowest rank's time; the median), so each
call finds its buffers warm, as a training step's buckets are, just written by backward.
Beside it, cost.time(...) with the fitted α, β, γ, δ, plus the per-call cost; ratio =
predicted / measured, `ok` when within 25%. With --calibration FILE the fit is read from
FILE instead of measured.
"""

import datetime
import json
import os
import platform
import time
from functools import partial

import numpy as np
from mpi4py import MPI

from minidp import comm, cost
from minidp.comm.reduce_ops import combine
from minidp.cost.step import Network
from minidp.tools.log import die, print0
from minidp.tools.parser import Parser
from minidp_bench._common import environment, median, print_table, timed, write_json
from minidp_bench.collectives import contenders, human, parse_size

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
MODEL_KEYS = ("alpha", "beta", "gamma", "delta", "per_call")  # the numbers the check uses


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


def ring_step(mpi, sizes: list[int], warmup: int, iters: int) -> list[float]:
    """Seconds of one ring step per size: every rank sends n bytes right and receives n from
    the left at once (MPI's Sendrecv of raw bytes, the call p2p.sendrecv makes, on the
    machine's own wire: an emulated network, netem.py, does not touch it), the slowest
    rank's time, the median of iters. The bytes sent are written just before (untimed), as
    a collective's step sends what it has just reduced: here a message costs more when its
    sender has just written it (docs/collectives.md has the figures)."""
    r, p, times = mpi.Get_rank(), mpi.Get_size(), []
    for nbytes in sizes:
        out, back, fresh = (np.ones(nbytes, np.uint8) for _ in range(3))
        step = partial(mpi.Sendrecv, [out, MPI.BYTE], (r + 1) % p, 0, [back, MPI.BYTE], (r - 1) % p)
        rounds = []
        for _ in range(warmup + iters):
            np.copyto(out, fresh)
            rounds.append(timed(step, mpi)[0])
        times.append(median(rounds[warmup:]))
    return times


def slowest_median(call, mpi, warmup: int, iters: int) -> float:
    """The median over iters (after warmup) of call's time on its slowest rank."""
    return median([timed(call, mpi)[0] for _ in range(warmup + iters)][warmup:])


def ping_pong(mpi, sizes: list[int], warmup: int, iters: int) -> list[float]:
    """One-way seconds per size between ranks 0 and 1 (round trip / 2, the median of iters),
    measured on rank 0; every other rank waits. Returns the list on every rank."""
    r, times = mpi.Get_rank(), []
    for nbytes in sizes:
        buf = np.ones(nbytes, np.uint8)
        rounds = []
        mpi.Barrier()
        for i in range(warmup + iters):
            start = time.perf_counter()
            if r == 0:
                mpi.Send([buf, MPI.BYTE], 1, 0)
                mpi.Recv([buf, MPI.BYTE], 1, 0)
            elif r == 1:
                mpi.Recv([buf, MPI.BYTE], 0, 0)
                mpi.Send([buf, MPI.BYTE], 0, 0)
            if i >= warmup:
                rounds.append((time.perf_counter() - start) / 2)
        times.append(median(rounds) if r == 0 else 0.0)
    return mpi.bcast(times, root=0)


def in_memory(group, sizes: list[int], warmup: int, iters: int, copy=False) -> list[float]:
    """Seconds per size (bytes of one float32 operand) of combine("sum", received, chunk,
    out=target) on three distinct buffers, as a ring's step has them (copy: of np.copyto
    into another), on every rank at once: the slowest rank's time, the median of iters."""
    times = []
    for nbytes in sizes:
        n = max(nbytes // 4, 1)
        rng = np.random.default_rng(group.rank)
        a, b = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
        out = np.empty_like(a)
        op = partial(np.copyto, out, a) if copy else partial(combine, "sum", a, b, out=out)
        times.append(slowest_median(op, group.comm, warmup, iters))
    return times


def per_call(group, alpha: float, beta: float, warmup: int, iters: int) -> float:
    """Seconds a call of minidp's collectives costs beyond its messages (the Python layer:
    the arguments' checks, the pick, the group's counters): a one-element ring allreduce on
    `group`, the slowest rank's median, less its cost.time (2(p - 1)α and a few bytes)."""
    machine = comm.Group(group.comm.Dup(), checks=False)
    machine.wire = machine.comm  # the machine's own wire, as α and β: no emulated delay
    one, out = np.ones(1, np.float32), np.empty(1, np.float32)
    call = partial(comm.allreduce, one, algo="ring", group=machine, out=out)
    seconds = slowest_median(call, machine.comm, warmup, iters)
    machine.free()
    messages = cost.time("allreduce", "ring", group.size, 1, 4, alpha=alpha, beta=beta)
    return max(0.0, seconds - messages)


def calibrate(group, args) -> dict:
    """{alpha, beta, gamma, delta, per_call, their fits, where and when}: as the docstring
    says."""
    ping = [parse_size(s) for s in args.ping_sizes.split(",")]
    reduce = [parse_size(s) for s in args.reduce_sizes.split(",")]
    if group.size < 2:
        raise die("bench calibrate: a ring step needs 2 ranks or more (mpiexec -n 2)")
    link = fit_line(ping, ring_step(group.comm, ping, args.warmup, args.iters))
    textbook = fit_line(ping, ping_pong(group.comm, ping, args.warmup, args.iters))
    operands = [max(s // 4, 1) * 4 for s in reduce]
    add = fit_line(operands, in_memory(group, reduce, args.warmup, args.iters))
    copy = fit_line(operands, in_memory(group, reduce, args.warmup, args.iters, copy=True))
    return {
        "alpha": link["intercept"],
        "beta": link["slope"],
        "gamma": add["slope"],
        "delta": copy["slope"],
        "per_call": per_call(group, link["intercept"], link["slope"], args.warmup, 3 * args.iters),
        "ring_step": link,
        "reduction": add,
        "copy": copy,
        "ping_pong": textbook,  # not used by the model: printed beside α, β for comparison
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "nprocs": group.size,
        "env": environment(),
    }


def predicted(model: dict, op: str, algo: str, p: int, n: int, itemsize: int, fit="") -> float:
    """cost.time with model's α, β, γ, δ, plus its per-call cost (fit="ping_pong": α and β
    of that fit instead)."""
    alpha, beta = model["alpha"], model["beta"]
    if fit:
        alpha, beta = model[fit]["intercept"], model[fit]["slope"]
    net = Network(alpha, beta, model["gamma"], delta=model.get("delta", 0.0))
    return cost.time(op, algo, p, n, itemsize, **net.terms()) + model.get("per_call", 0.0)


def check(
    group, model: dict, sizes: list[int], warmup: int, iters: int, plan: dict = PLAN
) -> list[dict]:
    """One row per (collective, algorithm, size) of `plan`: the median measured time of the
    real collective (the slowest rank's, calls back to back) beside cost.time's prediction."""
    rows, dtype, p = [], np.dtype(np.float32), group.size
    for op, algos in plan.items():
        for nbytes in sizes:
            n = max(nbytes // dtype.itemsize, 1)
            for algo in algos:
                call = contenders(op, algo, nbytes, dtype, group)[0]
                measured = slowest_median(call, group.comm, warmup, iters)
                model_s = predicted(model, op, algo, p, n, dtype.itemsize)
                textbook = predicted(model, op, algo, p, n, dtype.itemsize, "ping_pong")
                ratio = model_s / measured
                rows.append(
                    {
                        "op": op, "algo": algo, "bytes": n * dtype.itemsize,
                        "size": human(n * dtype.itemsize), "nprocs": p,
                        "measured_us": measured * 1e6, "predicted_us": model_s * 1e6,
                        "ratio": ratio, "ok": "yes" if abs(ratio - 1) <= WITHIN else "no",
                        "ratio_ping_pong": textbook / measured,
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
    ("ratio_ping_pong", ".2f"),
]


def print_fit(model: dict) -> None:
    fits = (("ring step", "ring_step"), ("reduction", "reduction"), ("copy", "copy"))
    for name, key in fits:
        if key in model:  # calibrations before 2026-12-04 fitted a ping-pong, and no copy
            f = model[key]
            print0(
                f"# {name}: {len(f['points'])} sizes, R² {f['r2']:.4f}, "
                f"largest |fit/measured - 1| {f['max_rel_error']:.2f}"
            )
    x = model["ping_pong"]
    print0(
        f"# ping-pong (ranks 0 and 1, the others waiting): {x['intercept'] * 1e6:.2f} us + "
        f"{x['slope'] * 1e12:.1f} ps/B, R² {x['r2']:.4f}, largest |fit/measured - 1| "
        f"{x['max_rel_error']:.2f}"
    )
    a, b, g, d = model["alpha"], model["beta"], model["gamma"], model.get("delta", 0.0)
    print0(
        f"alpha = {a * 1e6:.2f} us   beta = {b * 1e12:.1f} ps/B ({1 / b / 1e9 if b else 0:.2f} "
        f"GB/s)   gamma = {g * 1e12:.1f} ps/B ({1 / g / 1e9 if g else 0:.2f} GB/s)   "
        f"delta = {d * 1e12:.1f} ps/B ({1 / d / 1e9 if d else 0:.2f} GB/s)   "
        f"per call = {model.get('per_call', 0.0) * 1e6:.2f} us"
    )


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="minidp bench calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ping-sizes", default=PING_SIZES, help="message bytes (K/M suffixes)")
    parser.add_argument("--reduce-sizes", default=REDUCE_SIZES, help="add and copy bytes")
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
        print0(f"# α, β, γ, δ from {args.calibration} ({model['date']}, P = {model['nprocs']})")
    else:
        model = calibrate(group, args)
        if group.rank == 0:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(model, f, indent=1)
        print0(f"# fitted on all {group.size} ranks at once, saved to {args.out}")
    print_fit(model)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if sizes:
        rows = check(group, model, sizes, args.warmup, args.iters)
        if group.rank == 0:
            print0(
                f"# {group.size} ranks on {os.cpu_count()} cores, float32, checks off, calls back "
                f"to back, median of {args.iters} after {args.warmup} warm-up; ratio = "
                "predicted / measured"
            )
            print_table(rows, COLUMNS)
            ok = sum(r["ok"] == "yes" for r in rows)
            print0(f"# within {WITHIN:.0%}: {ok} of {len(rows)} rows")
            numbers = {k: model.get(k, 0.0) for k in MODEL_KEYS}
            write_json(args.json, [{**r, "model": numbers} for r in rows])
    group.free()
    return 0
