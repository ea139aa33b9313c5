"""What every benchmark shares: medians, environment facts, a plain table, JSON lines."""

import json
import platform
import resource
import statistics
import time

import numpy as np

from minidp.info import blas_info


def median(values) -> float:
    return float(statistics.median(values))


def timed(call, mpi) -> tuple[float, int]:
    """One timed call: Barrier (all start together), time it, then the max over ranks (a
    collective takes as long as its slowest rank). Returns (the slowest rank's seconds, this
    rank's minor page faults during the call)."""
    from mpi4py import MPI  # here: the serial benchmarks never start MPI

    mpi.Barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    call()
    elapsed = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return mpi.allreduce(elapsed, op=MPI.MAX), faults


def environment() -> dict:
    import os

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": blas_info(),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
    }


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Print rows as an aligned table; columns are (key, format spec) pairs."""
    cells = [
        [format(r[k], spec) if r.get(k) is not None else "-" for k, spec in columns] for r in rows
    ]
    heads = [k for k, _ in columns]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)
    ]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths)), flush=True)
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)), flush=True)


def write_json(path: str | None, records: list[dict]) -> None:
    """Write the records to path (replacing it), one JSON object per line."""
    if not path:
        return
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def torch_mlp_step(torch, model, x, y, lr: float, wrap=None):
    """A torch twin of a minidp MLP (same weights; W is (in, out) here, (out, in) in torch)
    and one SGD training step on (x, y). `wrap` wraps the torch model (e.g. in DDP)."""
    layers = []
    for i, layer in enumerate(model.layers):
        linear = torch.nn.Linear(*layer.weight.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(layer.weight.data.T.copy()))
            linear.bias.copy_(torch.from_numpy(layer.bias.data))
        layers += [linear] + ([torch.nn.ReLU()] if i < len(model.layers) - 1 else [])
    net = torch.nn.Sequential(*layers)
    net = wrap(net) if wrap else net
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        loss = torch.nn.functional.cross_entropy(net(tx), ty)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step
