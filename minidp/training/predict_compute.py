"""The compute a prediction starts from: one step of the model the strategy runs, timed on
this process.

    with runs_alone(task, tp) as run:
        compute = measure_compute(run, config, examples)

`measure_compute` times forward (with the loss), backward, and the clip with the optimizer
step, each the median of `steps` after `warmup`, and leaves the model as it found it.

`runs_alone(task, tp)` is what it times. Data parallelism and ZeRO run the task's own model.
Tensor parallelism runs another one, `TensorParallelGPT`, whose ops are not the plain GPT's:
a LayerNorm apart from the Linear after it (the copy f sits between them), a vocabulary-
parallel embedding and loss. With tp > 1 the TP model is built over a group of this one
process (MPI.COMM_SELF), where f and g move nothing: the same ops on the whole model, which
cost/step.py then divides by tp (all but the part measured not to shrink with the work).
Measured 2026-12-04 at tp 2 (one process, `python -m minidp predict --strategy tp --world
2`): the plain GPT predicted 8.4 ms of compute, the TP model on a group of one 9.7, against a
TP rank's 10.3 ms in a run (its step less its time inside collectives). What is left is the
work TP keeps whole on every rank, which the division by tp takes for split; under mpiexec
the ranks measure the TP model itself (training/predicted.py, `tensor_parallel_compute`).
"""

import contextlib
import statistics
import time

import numpy as np

from minidp import optim
from minidp.cost.step import Compute


class _Alone:
    """A task whose model is `model` (the TP model on a group of one): batch and loss."""

    def __init__(self, task, model):
        self.model, self.batch = model, task.batch

    def loss(self, inputs, targets):
        return self.model.loss(inputs, targets)


@contextlib.contextmanager
def runs_alone(task, tp: int):
    """The task to time: `task` itself for tp 1; else the TP model on a group of one."""
    if tp == 1:
        yield task
        return
    from mpi4py import MPI

    from minidp import comm
    from minidp.parallel.tensor_parallel.gpt import TensorParallelGPT

    alone = comm.Group(MPI.COMM_SELF.Dup(), checks=False)
    try:
        yield _Alone(task, TensorParallelGPT(task.model, alone))
    finally:
        alone.free()


def measure_compute(task, config, examples: int, warmup: int = 2, steps: int = 7) -> Compute:
    """Compute (forward, backward, clip and optimizer seconds, medians of `steps` after
    `warmup`) of the whole model on `examples` examples, on this process."""
    model = task.model
    params = model.parameters()
    optimizer = optim.make_optimizer(config.optimizer, params, config.lr, config.weight_decay)
    kept = [p.data.copy() for p in params]  # the measurement leaves the model as it was
    indices = np.arange(examples)
    times = []
    for _ in range(warmup + steps):
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        loss = task.loss(*task.batch(indices))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if config.grad_clip:  # the clip runs in the step's optimizer span too
            optim.clip_grad_norm(params, config.grad_clip)
        optimizer.step()
        times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    for p, data in zip(params, kept):
        p.data[...] = data
        p.grad = None
    f, b, o = (statistics.median(t[i] for t in times[warmup:]) for i in range(3))
    return Compute(f, b, o, examples, sum(p.size for p in params))
