"""The compute a step prediction starts from, timed on this process, for any model.

    compute = measure(model.parameters(), loss_of, [(inputs, targets)], optimizer)
    step = predict(Layout("zero", dp=4, zero_stage=3), model_shapes(model), compute, network,
                   batch_size=len(inputs))

`measure` runs whole training steps on the batches given (their examples are the batch the
times are for), and times forward (`loss_of(*batch)`, the loss included), backward, and the
clip with the optimizer's step, each the median of `steps` after `warmup`; it leaves the
parameters as it found them and their gradients None. cost/step.py scales forward and
backward to a rank's share of the global batch and the optimizer to the parameters it
steps. The training loop measures the model a strategy runs through this function too
(cost/predict_compute.py).
"""

import statistics
import time

from minidp.cost.step import Compute
from minidp.engine import optim


def measure(
    params: list, loss_of, batches: list, optimizer, *, clip: float = 0.0, warmup: int = 2,
    steps: int = 7, inside=None,
) -> Compute:  # fmt: skip
    """Compute of one step over `batches` (micro-batches, gradients summed over them):
    `loss_of(*batch)` is a batch's loss Tensor, `optimizer` steps `params` (clip > 0: their
    gradients' norm clipped first). `inside()`: seconds spent inside collectives so far (a
    group's `seconds`), taken out of forward and backward; None: nothing to take out."""
    kept = [p.data.copy() for p in params]  # the measurement leaves the model as it was
    clock = inside or (lambda: 0.0)
    times = []
    for _ in range(warmup + steps):
        for p in params:
            p.grad = None
        forward = backward = 0.0
        for batch in batches:
            t0, c0 = time.perf_counter(), clock()
            loss = loss_of(*batch)
            t1, c1 = time.perf_counter(), clock()
            loss.backward()
            t2, c2 = time.perf_counter(), clock()
            forward, backward = forward + t1 - t0 - (c1 - c0), backward + t2 - t1 - (c2 - c1)
        t2 = time.perf_counter()
        if clip:  # the clip runs in the step's optimizer span too
            optim.clip_grad_norm(params, clip)
        optimizer.step()
        times.append((forward, backward, time.perf_counter() - t2))
    for p, data in zip(params, kept):
        p.data[...] = data
        p.grad = None
    f, b, o = (statistics.median(t[i] for t in times[warmup:]) for i in range(3))
    examples = sum(len(batch[0]) for batch in batches)
    return Compute(f, b, o, examples, sum(p.size for p in params if p.requires_grad))
