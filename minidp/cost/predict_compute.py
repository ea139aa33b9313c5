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
What that still misses is the work TP keeps whole on every rank (LayerNorms, residuals):
dividing by tp counts it as split. Under mpiexec the ranks measure the TP model itself
instead (cost/predicted.py, `tensor_parallel_compute`); docs/cost_model.md has both
against runs.
"""

import contextlib

import numpy as np

from minidp.cost.compute import measure
from minidp.cost.step import Compute
from minidp.engine import optim
from minidp.tools.chunks import chunk_bounds


class Alone:
    """A task whose model is `model` (a TP model, on a group of one or on the ranks): the
    task's batches, the model's own loss."""

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
        yield Alone(task, TensorParallelGPT(task.model, alone))
    finally:
        alone.free()


def measure_compute(
    task, config, examples: int, warmup: int = 2, steps: int = 7, *, micro: int = 1, inside=None
) -> Compute:
    """Compute (forward, backward, clip and optimizer seconds, medians of `steps` after
    `warmup`) of the task's model on `examples` examples, in `micro` micro-batches as the
    run cuts them, on this process (cost.compute.measure). `inside()`: seconds spent inside
    collectives so far (a group's `seconds`), taken out of forward and backward."""
    params = task.model.parameters()
    optimizer = optim.make_optimizer(config.optimizer, params, config.lr, config.weight_decay)
    bounds = chunk_bounds(examples, micro)
    batches = [task.batch(np.arange(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
    return measure(
        params, task.loss, batches, optimizer,
        clip=config.grad_clip, warmup=warmup, steps=steps, inside=inside,
    )  # fmt: skip
