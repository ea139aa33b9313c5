"""The parameter server against ring-allreduce data parallelism, measured in one launch.

    mpiexec -n P python -m minidp bench ps [--steps 12] [--rounds 3] [--slow-ms 50]
        [--model gpt|mlp] [--json FILE] [--out DIR]            (P = 3, 4, 5 here)

The same model (the default tiny GPT), the same global batch (16), float32, one BLAS thread
per rank. Contenders, each run for --steps steps per round, their order rotated by one every
round; reported are medians over rounds, times the slowest rank's:

  dp ring       all P ranks data parallel, gradients summed by the ring allreduce
  ps S=1, S=2   S servers and P - S workers, BSP (S=2 when P >= 3)
  bsp / asp / ssp:2 slow   one server, and the last worker sleeps --slow-ms every step

Traffic, per step, from the groups' counters: bytes into the busiest server (W workers push
Ψb/S bytes each) against what one ring rank sends (2(p-1)/p · Ψb). The server's grows with
the number of workers, the ring's stays flat: that is the bottleneck sharding divides by S.
With a slow worker, `worker_ms` is the median worker's time per step (the last step, which
waits for every push, left out): BSP holds every worker to the slow one's pace, ASP lets the
others run (their gradients then go stale: see the staleness column, its largest value).
"""

import time
from dataclasses import replace

import numpy as np

from minidp import comm
from minidp.cli.strategies import DataParallel, ParameterServer
from minidp.cli.training.config import TrainConfig
from minidp.engine import optim
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.tools.log import print0
from minidp.tools.parser import Parser
from minidp.tools.plots import pyplot, save
from minidp_bench._common import environment, median, print_table, summary, write_json

COLUMNS = [
    ("contender", "s"),
    ("workers", "d"),
    ("servers", "d"),
    ("step_ms", ".1f"),
    ("worker_ms", ".1f"),
    ("server_in_kb", ".1f"),
    ("ring_rank_kb", ".1f"),
    ("max_staleness", "d"),
]


def contenders(base: TrainConfig, P: int, slow_ms: float) -> dict[str, TrainConfig]:
    """name -> config of every contender this world size allows."""
    runs = {"dp ring": replace(base, strategy="dp", allreduce="ring")}
    for S in (1, 2):
        if S < P:
            runs[f"ps S={S} bsp"] = replace(base, strategy="ps", servers=S)
    for consistency in ("bsp", "asp", "ssp:2"):
        runs[f"ps S=1 {consistency} slow"] = replace(
            base, strategy="ps", consistency=consistency, ps_slow_worker_ms=slow_ms
        )
    return runs


def run_once(config: TrainConfig, group: comm.Group) -> dict:
    """Train config.steps steps; this rank's times and traffic (plus the gathered extras)."""
    task = Task(config, np.dtype(config.dtype))
    cls = ParameterServer if config.strategy == "ps" else DataParallel
    with cls(task, config, group) as strategy:
        sampler = None
        if strategy.data_shard is not None:
            sampler = DistributedSampler(
                task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
            )
        sent_before = strategy.bytes_sent_by_axis()  # DDP's first broadcast is not a step's
        comm.barrier(group=group)
        times = []
        for step in range(config.steps):
            lr = optim.warmup_cosine(step, config.lr, config.warmup, config.steps)
            start = time.perf_counter()
            strategy.step(sampler.local_indices(step) if sampler else None, lr)
            times.append(time.perf_counter() - start)
        result = {"total_s": sum(times), "times": times}
        if config.strategy == "ps":
            counts = strategy.ps.counters.get("p2p", {"bytes_recv": 0})
            result["bytes_in"] = counts["bytes_recv"] if strategy.is_server else 0
            strategy.gather_model()
            result["max_staleness"] = max(map(int, strategy.record()["staleness_histogram"]))
            result["worker"] = not strategy.is_server
        else:
            result["bytes_out"] = strategy.bytes_sent_by_axis()["dp"] - sent_before["dp"]
            result["worker"] = True
    return result


def summarize(name: str, config: TrainConfig, per_round: list[list[dict]], P: int) -> dict:
    """One table row from every rank's results of every round (rank 0)."""
    steps = config.steps
    S = config.servers if config.strategy == "ps" else 0
    step_ms = median(max(r["total_s"] for r in ranks) / steps * 1e3 for ranks in per_round)
    worker_ms = median(
        median(
            1e3 * sum(r["times"][:-1]) / max(1, steps - 1) for r in ranks if r["worker"]
        )
        for ranks in per_round
    )  # fmt: skip
    row = {"contender": name, "workers": P - S, "servers": S, "step_ms": step_ms}
    row |= {"worker_ms": worker_ms, "steps": steps, "nprocs": P}
    if S:
        row["server_in_kb"] = max(r["bytes_in"] for r in per_round[0]) / steps / 1e3
        row["max_staleness"] = per_round[0][0]["max_staleness"]
    else:
        row["ring_rank_kb"] = max(r["bytes_out"] for r in per_round[0]) / steps / 1e3
    return row


def plot(rows: list[dict], P: int, out: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["contender"] for r in rows]
    left.barh(names, [r["worker_ms"] for r in rows])
    left.set_xlabel("ms per step (median worker)")
    traffic = [(r["contender"], r.get("server_in_kb") or r.get("ring_rank_kb")) for r in rows]
    right.barh([n for n, _ in traffic], [kb for _, kb in traffic], color="tab:orange")
    right.set_xlabel("kB per step: into the busiest server / sent by one ring rank")
    fig.suptitle(f"bench ps, {P} ranks")
    save(fig, f"{out}/bench_ps_{P}ranks.png")


def main(argv: list[str]) -> int:
    parser = Parser(prog="minidp bench ps", description=summary(__doc__))
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--slow-ms", type=float, default=50.0, help="slow worker's sleep")
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    parser.add_argument("--out", metavar="DIR", help="save the PNG here")
    args = parser.parse_args(argv)
    group = comm.world()
    if group.size < 2:
        print0("bench ps needs at least 2 ranks: mpiexec -n 3 python -m minidp bench ps")
        return 2
    from threadpoolctl import threadpool_limits

    base = TrainConfig(model=args.model, steps=args.steps, warmup=2, sample_tokens=0)
    runs = contenders(base, group.size, args.slow_ms)
    names = list(runs)
    results: dict[str, list] = {name: [] for name in names}
    with threadpool_limits(limits=1, user_api="blas"):
        env = environment()
        print0(
            f"bench ps | {args.model}, global batch {base.batch_size}, {args.steps} steps x "
            f"{args.rounds} rounds | {group.size} ranks | slow worker +{args.slow_ms:g} ms"
        )
        for i in range(args.rounds):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                mine = run_once(runs[name], group)
                results[name].append(group.comm.allgather(mine))  # every rank's, as objects
    if group.rank == 0:
        rows = [summarize(n, runs[n], results[n], group.size) for n in names]
        print_table(rows, COLUMNS)
        write_json(args.json, [{"bench": "ps", **env, **r} for r in rows])
        if args.out:
            plot(rows, group.size, args.out)
    return 0
