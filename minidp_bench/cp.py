"""Context parallelism, measured: one attention call (forward and backward) per rank, its
time, the bytes it sends, its score work and the bytes it keeps for backward.

    mpiexec -n C python -m minidp bench cp [--batch-size 2] [--block-size 256] [--n-embd 64]
                                           [--n-head 4] [--iters 10] [--warmup 3] [--json FILE]
    mpiexec -n C python -m minidp bench cp --block-size 128,256,512,1024    # against T

The world is the context-parallel group (C = its size). Contenders: ring attention with the
contiguous layout and with zig-zag, DeepSpeed-Ulysses (when the heads divide by C), and at
C = 1 also one process's fused attention (fast/fused_attention.py). Each runs on the same
random q, k, v (float64), is first checked against one process's attention on the whole
sequence (1e-10; a wrong answer stops the benchmark with exit code 1), then timed: the
slowest rank's forward plus backward, median over rounds. Columns: KB each rank sends per
call (forward and backward, the counters of its group), score elements of the busiest rank
over the mean (the causal imbalance), and KB kept for backward by the busiest rank
(tracemalloc: what the forward leaves allocated, its output not counted), and that over
1/C of one process's (its fused attention's on the whole sequence, measured on each rank
in the same run): `kept_vs_1/C` 1.00 is exactly 1/C. A list of block sizes sweeps T. BLAS
runs one thread per rank (threadpoolctl), so ranks do not fight over the cores.
"""

import time

import numpy as np

from minidp import comm
from minidp.engine.tensor import Tensor
from minidp.fast.fused_attention import causal_self_attention
from minidp.parallel.context_parallel import (
    RingWork,
    SequenceLayout,
    ring_attention,
    ulysses_attention,
)
from minidp.tools.log import die, print0
from minidp.tools.memory import kept_for_backward
from minidp.tools.parser import Parser
from minidp_bench._common import add_round_options, median, print_table, summary, write_json


def contenders(args, p: int) -> dict:
    """{name: (layout, attend(qkv Tensor, work) -> Tensor)}."""
    plain, zigzag = SequenceLayout(args.block_size, p), SequenceLayout(args.block_size, p, True)
    group, H = comm.world(), args.n_head
    table = {
        "ring": (plain, lambda x, w: ring_attention(x, H, group, plain, w)),
        "ring zigzag": (zigzag, lambda x, w: ring_attention(x, H, group, zigzag, w)),
    }
    if H % p == 0:
        table["ulysses"] = (plain, lambda x, w: ulysses_attention(x, H, group, plain))
    if p == 1:
        future = np.triu(np.ones((args.block_size,) * 2, dtype=bool), k=1)
        table["one process"] = (plain, lambda x, w: causal_self_attention(x, H, future))
    return table


def kept_bytes(attend, qkv: np.ndarray) -> int:
    kept, y = kept_for_backward(lambda x: attend(x, None), qkv)
    y.backward(np.ones_like(y.data))  # every rank's messages answered
    return kept


def measure(name, layout, attend, qkv, seed, want, args, group, whole_kept) -> dict:
    me, mpi = group.rank, group.comm
    x = Tensor(layout.shard(qkv, me), requires_grad=True)
    work = RingWork()
    group.reset_counters()
    y = attend(x, work)
    sent_forward = sum(c["bytes_sent"] for k, c in group.counters.items() if k != "checks")
    y.backward(layout.shard(seed, me))
    sent = sum(c["bytes_sent"] for k, c in group.counters.items() if k != "checks")
    wrong = np.abs(y.data - layout.shard(want[0], me)).max()
    wrong = max(wrong, np.abs(x.grad - layout.shard(want[1], me)).max())
    if mpi.allreduce(wrong, op=_max()) > 1e-10:
        raise die(f"bench cp: {name} differs from one process by {wrong:.2e}: not timing it")
    times = []
    for i in range(args.warmup + args.iters):
        x = Tensor(layout.shard(qkv, me), requires_grad=True)
        mpi.Barrier()
        start = time.perf_counter()
        attend(x, None).backward(layout.shard(seed, me))
        if i >= args.warmup:
            times.append(mpi.allreduce(time.perf_counter() - start, op=_max()))
    works = mpi.allgather(work.forward)
    kept = mpi.allreduce(kept_bytes(attend, layout.shard(qkv, me)), op=_max())
    return {
        "T": qkv.shape[1],
        "C": group.size,
        "algo": name,
        "ms": 1e3 * median(times),
        "fwd_KB": sent_forward / 1024,
        "bwd_KB": (sent - sent_forward) / 1024,
        "busiest/mean": max(works) / np.mean(works) if any(works) else None,
        "kept_KB": kept / 1024,
        "kept_vs_1/C": kept * group.size / whole_kept,
    }


def at_length(T: int, args, group) -> list[dict]:
    """The rows of every contender at block size T, each checked against one process's
    attention on the whole sequence, whose kept bytes the rows' last column divides by."""
    rng = np.random.default_rng(0)
    B, C = args.batch_size, args.n_embd
    qkv, seed = rng.standard_normal((B, T, 3 * C)), rng.standard_normal((B, T, C))
    future = np.triu(np.ones((T, T), dtype=bool), k=1)

    def whole(x, work=None):
        return causal_self_attention(x, args.n_head, future)

    x = Tensor(qkv, requires_grad=True)
    y = whole(x)
    y.backward(seed)
    want, whole_kept = (y.data, x.grad), kept_bytes(whole, qkv)
    args.block_size = T  # the contenders' layouts
    return [
        measure(name, layout, attend, qkv, seed, want, args, group, whole_kept)
        for name, (layout, attend) in contenders(args, group.size).items()
    ]


def _max():
    from mpi4py import MPI  # here: --help needs no MPI

    return MPI.MAX


def main(argv: list[str]) -> int:
    parser = Parser(prog="minidp bench cp", description=summary(__doc__))
    parser.add_argument("--batch-size", type=int, default=2, help="B (default 2)")
    parser.add_argument(
        "--block-size", default="256", help="T, or T1,T2,... to sweep (default 256)"
    )
    parser.add_argument("--n-embd", type=int, default=64, help="C' (default 64)")
    parser.add_argument("--n-head", type=int, default=4, help="H (default 4)")
    add_round_options(parser, iters=10, warmup=3)
    args = parser.parse_args(argv)
    group = comm.world()
    try:
        lengths = [int(T) for T in args.block_size.split(",")]
    except ValueError:
        raise die(f"bench cp: --block-size {args.block_size}: integers, comma-separated") from None
    B, C = args.batch_size, args.n_embd
    for T in lengths:
        if T < 1 or T % (2 * group.size) or C % args.n_head:
            raise die(f"bench cp: T {T} must divide by 2C = {2 * group.size}, n_embd by n_head")
    print0(f"bench cp: C = {group.size}, B {B}, T {args.block_size}, n_embd {C}, "
           f"heads {args.n_head}, float64")  # fmt: skip
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        rows = [row for T in lengths for row in at_length(T, args, group)]
    columns = [("T", "d"), ("C", "d"), ("algo", "s"), ("ms", ".1f"), ("fwd_KB", ".0f")]
    columns += [("bwd_KB", ".0f")]
    columns += [("busiest/mean", ".2f"), ("kept_KB", ".0f"), ("kept_vs_1/C", ".2f")]
    if group.rank == 0:
        print_table(rows, columns)
        write_json(args.json, [{"bench": "cp", **r} for r in rows])
    return 0
