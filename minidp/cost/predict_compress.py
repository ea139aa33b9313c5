"""`python -m minidp predict` with `--compress`: the compressor's wire and its own work.

    python -m minidp predict --strategy dp --compress topk:0.01 --world 4
    mpiexec -n 4 python -m minidp predict --compress sign

The wire is exact: each bucket's calls are the compressor's (cost/calls.py,
`compressor_calls`), priced by the collectives' α-β-γ model like any other call. The
compressor's own work (choosing the top k, packing bits, error feedback, decoding) is
measured here: the compressor of the flags reduces one step's buckets, filled with the
model's own gradients, on a group of one rank (MPI.COMM_SELF), where its exchange moves
nothing and it decodes one payload; cost/step.py adds the decoding of the
other ranks' payloads for the compressors that gather them.

What is refused, in one line: `--compress-on update` and `velocity` (the reduction moves
into the optimizer), and `--compress-warmup` (its first rounds are the plain allreduce: the
steady state is what the model predicts). PowerSGD's three allreduces per bucket follow its
matrices' shapes (cost/calls.py, `powersgd_calls`, from `Shapes.dims`).
"""

import statistics
import time

import numpy as np

from minidp.cli.training.config import BadConfig
from minidp.cost.calls import bucket_members


def check_compress(config) -> None:
    """BadConfig (one line, alike on every rank) for a --compress value that is not one (a
    training run finds it building its DDP) or one the model does not cover."""
    from minidp.parallel.compression.table import make_compressor

    try:
        make_compressor(config.compress, config.allreduce, config.seed)
    except ValueError as error:
        raise BadConfig(f"--compress {error}") from None
    if config.compress_on != "gradient":
        raise BadConfig(f"predict models --compress-on gradient; got {config.compress_on}")
    if config.compress_warmup:
        raise BadConfig("predict models the compressed steps; drop --compress-warmup")


def spelled_out(spec: str) -> str:
    """The --compress value with its PARAM written, the class's default for a bare name
    ("topk" -> "topk:0.01"): what cost/calls.py reads, so no default lives there twice."""
    from minidp.parallel.compression.table import parse_compress

    name, param = parse_compress(spec)
    return name if param is None else f"{name}:{param}"


def compressor_seconds(config, task, examples: int, warmup: int = 2, steps: int = 7) -> float:
    """Median seconds of the compressor's work on one step's buckets on a group of one. The
    buckets hold the model's own gradients of `examples` examples, weighed as DDP weighs a
    rank's (by examples / batch): a compressor's speed can depend on the values (float16's
    subnormals take a slow path). Each round starts from fresh copies of them; the residuals
    carry over, as in training."""
    from mpi4py import MPI

    from minidp import comm
    from minidp.parallel.compression.table import make_compressor

    params = task.model.parameters()
    task.loss(*task.batch(np.arange(examples))).backward()
    share = examples / config.batch_size
    dtype = np.dtype(config.dtype)
    cap = max(1, int(config.bucket_mb * 2**20))
    members = bucket_members([p.size for p in params], cap, dtype.itemsize)  # DDP's cut

    def flat(bucket: list[int]) -> np.ndarray:  # its gradients end to end, weighed as DDP's
        return np.concatenate([np.asarray(params[i].grad).reshape(-1) for i in bucket]) * share

    grads = [flat(bucket).astype(dtype) for bucket in members]
    shapes = [[params[i].shape for i in bucket] for bucket in members]  # PowerSGD's matrices
    for p in params:
        p.grad = None
    work = [g.copy() for g in grads]
    compressor = make_compressor(config.compress, config.allreduce, config.seed)
    alone = comm.Group(MPI.COMM_SELF.Dup(), checks=False)
    times = []
    try:
        for _ in range(warmup + steps):
            for x, g in zip(work, grads):
                np.copyto(x, g)
            start = time.perf_counter()
            for key, (x, dims) in enumerate(zip(work, shapes)):
                compressor.reduce(x, key, alone, dims)
            times.append(time.perf_counter() - start)
    finally:
        alone.free()
    return statistics.median(times[warmup:])
