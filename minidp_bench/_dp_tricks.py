"""`bench dp --case tricks`: what each of DDP's speed tricks buys, on against off, side by side.

    mpiexec -n 2 python -m minidp bench dp --case tricks [--iters 30] [--json FILE]

The weak case's step (forward, backward, the buckets reduced, SGD; an MLP 784-1024-1024-10,
a batch of 256 per rank, float32, one BLAS thread per rank). For each trick of
data_parallel.TRICKS, two DDPs around the same weights, one with the trick and one without
(every other trick as by default), in the setting where the trick acts:

    shared_memory  overlap off, algo auto  buckets carved from a shared arena (shm_arena.py),
                                           or plain arrays copied through the shm scratch
    coalesce       overlap off, algo auto  the buckets in one allreduce_coalesced, or one
                                           allreduce each (coalesce.py)
    quick_gil      overlap on,  algo auto  a 0.2 ms GIL switch interval while the comm
                                           thread runs, or Python's 5 ms (gil.py)
    host_stage     torch tensors (CPU)     reused host buffers (host_stage.HostStage), or
                                           t.cpu().numpy() each time (PlainStage: a view)

(the modules are in minidp/parallel/data_parallel/)

All contenders run in one loop, the order rotated each round; on/off is the median of the
per-round ratios of the pair (< 1: the trick pays). host_stage runs when torch imports
(not with --no-torch).
"""

from minidp.parallel import DistributedDataParallel
from minidp.parallel.data_parallel.ddp import TRICKS
from minidp_bench._common import median, median_ratio, rotated_rounds
from minidp_bench._mlp import ddp_sgd_step, make_data, make_model

SETTINGS = {  # trick: (overlap, backend) where it acts
    "shared_memory": (False, "numpy"),
    "coalesce": (False, "numpy"),
    "quick_gil": (True, "numpy"),
    "host_stage": (False, "torch"),
}


def _torch_ready(args) -> bool:
    if args.no_torch:
        return False
    try:
        import torch
    except ImportError:
        return False
    torch.set_num_threads(1)
    return True


def measure(args, group, world) -> tuple[list[dict], list, str]:
    from minidp.engine import backend

    sizes, batch = args.sizes, args.batch
    x, y = make_data(sizes, batch, seed=100 + world.rank)
    tricks = [t for t, (_, lib) in SETTINGS.items() if lib == "numpy" or _torch_ready(args)]
    ddps, steps = {}, {}
    for trick in tricks:
        overlap, lib = SETTINGS[trick]
        for on in (True, False):
            model = make_model(sizes)
            xs = x
            if lib == "torch":
                backend.use("torch", "cpu")
                backend.move_model(model)
                xs = backend.to_backend(x)
            ddp = DistributedDataParallel(
                model, group, bucket_cap_mb=args.bucket_mb, overlap=overlap, tricks={trick: on}
            )
            ddps[(trick, on)] = ddp
            steps[(trick, on)] = ddp_sgd_step(ddp, xs, y)
            backend.use("numpy")
    times = rotated_rounds(steps, args.warmup, args.iters, world)
    rows = []
    for trick in tricks:
        on, off = times[(trick, True)], times[(trick, False)]
        overlap, lib = SETTINGS[trick]
        rows.append(
            {
                "case": "tricks",
                "trick": trick,
                "overlap": overlap,
                "backend": lib,
                "nprocs": world.size,
                "threads": 1,
                "batch_per_rank": batch,
                "sizes": "-".join(map(str, sizes)),
                "buckets": len(ddps[(trick, True)].buckets),
                "on_ms": 1e3 * median(on),
                "off_ms": 1e3 * median(off),
                "on/off": median_ratio(on, off),
                "default": TRICKS[trick],
            }
        )
    for ddp in ddps.values():
        ddp.close()
    columns = [
        ("trick", "s"),
        ("overlap", ""),
        ("backend", "s"),
        ("buckets", "d"),
        ("on_ms", ".2f"),
        ("off_ms", ".2f"),
        ("on/off", ".3f"),
        ("default", ""),
    ]
    goal = "each trick on by default only where on/off < 1 (median of per-round ratios)"
    return rows, columns, goal
