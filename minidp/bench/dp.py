"""Data-parallel weak scaling: how much of a second rank's compute do we keep?

    mpiexec -n 2 python -m minidp bench dp [--iters 15] [--algos ring,mpi] [--json FILE]

The step: forward, backward, gradient allreduce, SGD, for an MLP 784-1024-1024-10 with a
batch of 256 *per rank*, float32, one BLAS thread per rank. In each round, alternating:
  solo        rank 0 trains alone (same model, no communication) while the others wait
  dp ALGO     every rank takes a data-parallel step, gradients reduced with ALGO, with and
              without overlapping communication and backward
  torch DDP   the same step in PyTorch DDP (gloo over 127.0.0.1), when torch is installed
Weak-scaling efficiency = solo time / DP time (1.0: the second rank costs nothing).
Each time is the maximum over ranks (barrier, time, allreduce-max); medians of per-round
ratios are reported.
"""

import socket

import numpy as np
from mpi4py import MPI

from minidp import comm, nn, optim
from minidp.autograd import Tensor
from minidp.bench._common import (
    environment,
    median,
    print_table,
    timed,
    torch_mlp_step,
    write_json,
)
from minidp.bench.autograd import BATCH, LR, SIZES, minidp_step  # its MLP, batch (per rank), lr
from minidp.log import die, print0
from minidp.parallel import DistributedDataParallel
from minidp.parser import Parser

ALGOS = ("ring", "recursive_doubling", "rabenseifner", "tree", "mpi")


def make_model(seed: int = 0) -> nn.MLP:
    return nn.MLP(list(SIZES), rng=np.random.default_rng(seed))


def data(rank: int):
    rng = np.random.default_rng(100 + rank)
    return (
        rng.standard_normal((BATCH, SIZES[0])).astype(np.float32),
        rng.integers(0, SIZES[-1], BATCH),
    )


def dp_step(ddp: DistributedDataParallel, x, y):
    opt = optim.SGD(ddp.parameters(), lr=LR)

    def step():
        ddp.zero_grad()
        nn.cross_entropy(ddp(Tensor(x)), y).backward()
        ddp.finish_gradient_sync()
        opt.step()

    return step


def torch_ddp_step(world, x, y):
    """The same step in torch.nn.parallel.DistributedDataParallel over gloo (or None)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    port = np.zeros(1, dtype=np.int64)
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    world.Bcast(port, root=0)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{int(port[0])}",
        rank=world.rank,
        world_size=world.size,
    )
    wrap = torch.nn.parallel.DistributedDataParallel
    return torch_mlp_step(torch, make_model(), x, y, LR, wrap=wrap)


def main(argv: list[str]) -> int:
    parser = Parser(prog="minidp bench dp", description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds (default 3)")
    parser.add_argument("--algos", default=",".join(ALGOS), help="allreduce algorithms")
    parser.add_argument("--bucket-mb", type=float, default=2.0, help="bucket size (MiB)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch DDP")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    args = parser.parse_args(argv)
    algos = args.algos.split(",")
    known = ("auto", *comm.ALGORITHMS["allreduce"])
    unknown = [a for a in algos if a not in known]
    if unknown:
        raise die(f"bench dp: unknown allreduce algorithm(s) {unknown}; choose from {known}")
    from threadpoolctl import threadpool_limits

    world, group = MPI.COMM_WORLD, comm.world()
    if world.size < 2:
        print0("bench dp needs at least 2 ranks: mpiexec -n 2 python -m minidp bench dp")
        return 2
    x, y = data(world.rank)
    contenders = {}
    solo_model = make_model()
    solo = minidp_step(solo_model, optim.SGD(solo_model.parameters(), lr=LR), x, y)
    contenders["solo"] = lambda: solo() if world.rank == 0 else None
    ddps = []
    for algo in algos:
        for overlap in (True, False):
            ddp = DistributedDataParallel(
                make_model(), group, bucket_cap_mb=args.bucket_mb, algo=algo, overlap=overlap
            )
            ddps.append(ddp)
            contenders[(algo, overlap)] = (dp_step(ddp, x, y), ddp)
    torch_step = None if args.no_torch else torch_ddp_step(world, x, y)
    if torch_step:
        contenders["torch"] = torch_step

    times: dict = {name: [] for name in contenders}
    with threadpool_limits(limits=1, user_api="blas"):
        for i in range(args.warmup + args.iters):
            for name, entry in contenders.items():
                if isinstance(name, tuple):
                    step, ddp = entry
                    if i == args.warmup:  # count exposed communication over timed rounds only
                        ddp.exposed_seconds = ddp.comm_seconds = 0.0
                else:
                    step = entry
                elapsed = timed(step, world)[0]
                if i >= args.warmup:
                    times[name].append(elapsed)
    rows = []
    for name, ts in times.items():
        if not isinstance(name, tuple):
            continue
        algo, overlap = name
        ddp = contenders[name][1]
        row = {
            "algo": algo,
            "overlap": overlap,
            "nprocs": world.size,
            "threads": 1,
            "buckets": len(ddp.buckets),
            "step_ms": 1e3 * median(ts),
            "efficiency": median(s / t for s, t in zip(times["solo"], ts)),
            "exposed_ms": 1e3 * ddp.exposed_seconds / args.iters,
            "comm_ms": 1e3 * ddp.comm_seconds / args.iters,
        }
        if ("mpi", overlap) in times:
            row["vs_mpi_dp"] = median(a / b for a, b in zip(ts, times[("mpi", overlap)]))
        if "torch" in times:
            row["vs_torch_ddp"] = median(a / b for a, b in zip(ts, times["torch"]))
        rows.append(row)
    for ddp in ddps:
        ddp.close()
    if world.rank == 0:
        env = environment()
        print(
            f"bench dp: MLP {'-'.join(map(str, SIZES))}, batch {BATCH}/rank, float32, "
            f"{world.size} ranks x 1 BLAS thread | bucket {args.bucket_mb} MiB | {env['blas']}"
        )
        print(
            f"solo step {1e3 * median(times['solo']):.2f} ms"
            + (
                f" | torch DDP step {1e3 * median(times['torch']):.2f} ms"
                if "torch" in times
                else ""
            )
        )
        print_table(
            rows,
            [
                ("algo", "s"),
                ("overlap", ""),
                ("buckets", "d"),
                ("step_ms", ".2f"),
                ("efficiency", ".3f"),
                ("comm_ms", ".2f"),
                ("exposed_ms", ".2f"),
                ("vs_mpi_dp", ".3f"),
                ("vs_torch_ddp", ".3f"),
            ],
        )
        print(
            "goals: efficiency >= 0.80 (stretch 0.85); ring within 3% of mpi (vs_mpi_dp <= 1.03); "
            "vs_torch_ddp <= 0.8",
            flush=True,
        )
        write_json(
            args.json,
            [
                {
                    "bench": "dp",
                    **env,
                    "solo_ms": 1e3 * median(times["solo"]),
                    "torch_ddp_ms": 1e3 * median(times["torch"]) if "torch" in times else None,
                    **r,
                }
                for r in rows
            ],
        )
    return 0
