"""`bench dp --case shallowspeed`: minidp's DDP against a data-parallel loop written by hand.

    mpiexec -n 2 python -m minidp bench dp --case shallowspeed
    mpiexec -n 4 python -m minidp bench dp --case shallowspeed --algos auto,ring

The setup of ShallowSpeed (github.com/siboehm/ShallowSpeed), a small NumPy + mpi4py trainer:
an MLP 784-128-127-126-125-124-123-10, a global batch of 128 split over the ranks (strong
scaling: more ranks, fewer examples each), each rank's slice cut into 4 micro-batches
(gradient accumulation), SGD, float32, one BLAS thread per rank. Two contenders:

    hand    per micro-batch, forward and backward written out in NumPy (_mlp.numpy_gradients),
            the gradients added up; then one MPI Iallreduce per parameter, Waitall, SGD
    minidp  DDP around nn.MLP: no_sync() for the first 3 micro-batches (which defers the
            weight gradients: each weight whose rows fit takes one product over all of
            them, at the last backward), then the buckets reduced with ALGO during the last
            backward (overlap on) or after it (off: all in one call where ALGO allows,
            comm.allreduce_coalesced); SGD

Both start from the same weights and see the same examples: before anything is timed, one
step of each is taken and their parameters compared (float32 tolerance; exit code 1 if they
differ). Then they alternate, the order rotated each round; ratio = minidp / hand per round,
median (< 1: minidp is faster).
"""

import contextlib
import functools

import numpy as np
from mpi4py import MPI

from minidp import comm
from minidp.engine import nn, optim
from minidp.engine.tensor import Tensor
from minidp.parallel import DistributedDataParallel
from minidp.tools.log import die, print0
from minidp_bench._common import (
    max_over_ranks,
    median,
    median_ratio,
    per_timed_step_ms,
    rotated_rounds,
    zero_comm_seconds,
)
from minidp_bench._mlp import (
    LR,
    ddp_per_algo,
    make_data,
    make_model,
    numpy_gradients,
    weights_of,
)

SIZES = (784, 128, 127, 126, 125, 124, 123, 10)  # ShallowSpeed's MLP: 182,000 weights
GLOBAL_BATCH = 128  # split over the ranks: 64 per rank at 2 ranks, 32 at 4
MICRO_BATCHES = 4  # per rank and step: 16 examples each at 2 ranks, 8 at 4
BUCKET_MB = 0.25  # DistributedDataParallel's default: 3 buckets for this 0.73 MB model


def micro_batches(world) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """This rank's slice of the global batch, in MICRO_BATCHES pieces; and its length n_r."""
    x, y = make_data(SIZES, GLOBAL_BATCH, seed=7)
    bounds = comm.chunk_bounds(GLOBAL_BATCH, world.size)
    lo, hi = bounds[world.rank], bounds[world.rank + 1]
    cuts = comm.chunk_bounds(hi - lo, MICRO_BATCHES)
    return [(x[lo + a : lo + b], y[lo + a : lo + b]) for a, b in zip(cuts, cuts[1:])], hi - lo


def minidp_step(ddp: DistributedDataParallel, micro, local: int):
    """Micro-batch k's loss weighs m_k / n_r (their sum: the local mean), DDP weighs n_r / B."""
    opt = optim.SGD(ddp.parameters(), lr=LR)
    ddp.set_batch_share(local, GLOBAL_BATCH)

    def step():
        ddp.zero_grad()
        for k, (x, y) in enumerate(micro):
            with ddp.no_sync() if k < len(micro) - 1 else contextlib.nullcontext():
                loss = nn.cross_entropy(ddp(Tensor(x)), y) * (len(y) / local)
                loss.backward()
        ddp.finish_gradient_sync()
        opt.step()

    return step


def hand_step(weights, micro, mpi):
    """The loop ShallowSpeed writes: gradients of m_k / B * mean_k summed over micro-batches
    (so the sum over ranks is the global mean), one Iallreduce per parameter, SGD."""
    params = [t for pair in weights for t in pair]

    def step():
        total = None
        for x, y in micro:
            grads = numpy_gradients(weights, x, y, scale=len(y) / GLOBAL_BATCH)
            grads = [g for pair in grads for g in pair]
            if total is None:
                total = grads
            else:
                for t, g in zip(total, grads, strict=True):
                    t += g
        MPI.Request.Waitall([mpi.Iallreduce(MPI.IN_PLACE, g, op=MPI.SUM) for g in total])
        for w, g in zip(params, total, strict=True):
            w -= LR * g

    return step


def check_same_step(ddp, step, micro, world) -> None:
    """One step of `step` (minidp) and of the hand loop from the same weights: die on every
    rank (exit code 1) unless the parameters agree to float32 rounding."""
    reference = weights_of(ddp.model)
    hand_step(reference, micro, world)()
    step()
    error = 0.0
    for layer, (W, b) in zip(ddp.model.layers, reference, strict=True):
        for ours, theirs in ((layer.weight.data, W), (layer.bias.data, b)):
            diff = float(np.abs(ours - theirs).max())
            error = max(error, diff if diff > 1e-5 * float(np.abs(theirs).max()) else 0.0)
    error = max_over_ranks(error, world)
    if error:
        raise die(
            f"bench dp: after one step minidp's DDP ({ddp.algo}, overlap {ddp.overlap}) and "
            f"the hand-written loop hold other parameters (max |difference| {error:.3g}); "
            "not timing a wrong answer",
            code=1,
        )


def measure(args, group: comm.Group, world) -> tuple[list[dict], list, str]:
    """One row per (algo, overlap): minidp's step against the hand-written one."""
    if GLOBAL_BATCH // world.size < MICRO_BATCHES:
        raise die(f"bench dp: --case shallowspeed runs on at most {GLOBAL_BATCH // 4} ranks")
    micro, local = micro_batches(world)
    steps = {"hand": hand_step(weights_of(make_model(SIZES)), micro, world)}
    ddps = ddp_per_algo(SIZES, group, args.algos, args.bucket_mb)
    for name, ddp in ddps.items():
        steps[name] = minidp_step(ddp, micro, local)
        check_same_step(ddp, steps[name], micro, world)
    print0(f"checked: each minidp step equals the hand-written one after one step ({len(ddps)})")

    forget_warmup = functools.partial(zero_comm_seconds, ddps.values())
    times = rotated_rounds(steps, args.warmup, args.iters, world, forget_warmup)
    rows = []
    for (algo, overlap), ddp in ddps.items():
        ts = times[(algo, overlap)]
        rows.append(
            {
                "case": "shallowspeed",
                "algo": algo,
                "overlap": overlap,
                "nprocs": world.size,
                "threads": 1,
                "sizes": "-".join(map(str, SIZES)),
                "global_batch": GLOBAL_BATCH,
                "micro_batches": MICRO_BATCHES,
                "buckets": len(ddp.buckets),
                "minidp_ms": 1e3 * median(ts),
                "hand_ms": 1e3 * median(times["hand"]),
                "minidp/hand": median_ratio(ts, times["hand"]),
                "comm_ms": per_timed_step_ms(ddp.comm_seconds, args.iters, world),
                "exposed_ms": per_timed_step_ms(ddp.exposed_seconds, args.iters, world),
            }
        )
        ddp.close()
    columns = [
        ("algo", "s"),
        ("overlap", ""),
        ("buckets", "d"),
        ("minidp_ms", ".2f"),
        ("hand_ms", ".2f"),
        ("minidp/hand", ".3f"),
        ("comm_ms", ".2f"),
        ("exposed_ms", ".2f"),
    ]
    goal = "goal: minidp/hand <= 1.0 at 2 and 4 ranks (median of per-round ratios)"
    return rows, columns, goal
