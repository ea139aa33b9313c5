"""Pipeline parallelism, the plain idea: GPipe (Huang et al., 2019) with one stage per rank.

    mpiexec -n 2 python examples/pipeline.py      (a model of your own, cut in two)

The model is cut into P stages, stage s on rank s. The batch is cut into m micro-batches,
so that stage s + 1 can work on micro-batch j while stage s already does j + 1:

    rank 0   F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3          F: forward of micro-batch j
    rank 1   .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .           B: its backward
    rank 2   .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .           (P = 3, m = 4, F = B = 1)

Every forward first, then every backward, each in micro-batch order. Between stages one
tensor crosses per micro-batch: the activations y forward (s -> s + 1), their gradient
dL/dy back (s + 1 -> s). The ranks idle in the dots: the bubble, (P - 1) / (m + P - 1) of
the step (here 4 of 12 slots). Each stage holds all m micro-batches' activations until
their backward: what 1F1B bounds (schedules.py).

The last stage weighs micro-batch j's mean loss by its share of the batch, B_j / B, so the
m weighted losses sum to the batch's mean loss and their gradients to its gradient: the
step one process takes on the whole batch. Blocking sends and receives cannot deadlock
here: in the forwards every message goes s -> s + 1, in the backwards s + 1 -> s, and a
rank finishes its forwards before it waits for a gradient.

The full machinery (schedules as checked data, 1F1B, interleaved and zero-bubble schedules,
several stages per rank, non-blocking sends, the bubble measured) is schedules.py,
stage.py and executor.py; `ScheduleGPipe` there computes the same bits as this file.
"""

import numpy as np

from minidp import comm
from minidp.comm import p2p
from minidp.engine import functional
from minidp.engine.nn import Module
from minidp.engine.tensor import Tensor

HEADER = 8  # before an activation, int64s: its dtype's letter, its ndim, its shape


class SimpleGPipe:
    """Stage `group.rank` of a GPipe pipeline over `group` (stage s on rank s), running
    `stage` (this rank's part of the model) on `n_microbatches` micro-batches a step.
    `loss_fn(output, targets)`: the last stage's loss, a mean over its examples. The first
    stage is given the inputs as they are (a Tensor or data, such as token ids); an
    activation crosses in its own dtype, and its gradient comes back in the same."""

    def __init__(self, stage: Module, group: comm.Group, n_microbatches: int,
                 loss_fn=functional.cross_entropy):  # fmt: skip
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
        self.stage, self.group, self.m, self.loss_fn = stage, group, n_microbatches, loss_fn
        self.first, self.last = group.rank == 0, group.rank == group.size - 1

    def step(self, inputs=None, target=None) -> float:
        """One step's forwards and backwards: `inputs` (the batch) on the first stage,
        `target` on the last, neither on the others. Adds the batch's gradient into the
        stage's .grad (zero them before, step the optimizer after); returns the batch's
        mean loss on every rank."""
        if self.last and target is None:
            raise ValueError("the last stage's step needs the batch's target")
        sizes = self._micro_sizes(inputs)
        shares = sizes / sizes.sum()
        edges = np.concatenate([[0], np.cumsum(sizes)])
        cut = [slice(edges[j], edges[j + 1]) for j in range(self.m)]
        received, roots = [], []  # per micro-batch: the input Tensor, the root of backward
        for j in range(self.m):  # every forward
            x = inputs[cut[j]] if self.first else self._receive_activations()
            received.append(x)
            y = self.stage(x)
            if self.last:
                roots.append(self.loss_fn(y, target[cut[j]]) * float(shares[j]))
            else:
                self._send_activations(y.data)
                roots.append(y)
        loss = 0.0
        for j in range(self.m):  # every backward
            if self.last:
                roots[j].backward()
                loss += roots[j].item()
            else:
                dy = np.empty(roots[j].shape, roots[j].dtype)  # in the dtype y went in
                p2p.recv(self.group, dy, self.group.rank + 1)
                roots[j].backward(dy)
            if not self.first:
                dx = np.ascontiguousarray(received[j].grad, dtype=received[j].dtype)
                p2p.send(self.group, dx, self.group.rank - 1)
        total = np.array([loss])
        return float(comm.broadcast(total, root=self.group.size - 1, group=self.group)[0])

    def _micro_sizes(self, batch) -> np.ndarray:
        """The micro-batches' sizes (np.array_split's: the first B % m one longer), which
        the first stage knows and tells the others (the last needs them for the shares)."""
        sizes = np.zeros(self.m, np.int64)
        if self.first:
            if batch is None or len(batch) < self.m:
                raise ValueError(f"the first stage needs inputs of at least {self.m} examples")
            sizes[:] = [len(part) for part in np.array_split(np.arange(len(batch)), self.m)]
        return comm.broadcast(sizes, root=0, group=self.group)

    def _send_activations(self, y: np.ndarray) -> None:
        header = np.zeros(HEADER, np.int64)
        header[0], header[1], header[2 : 2 + y.ndim] = ord(y.dtype.char), y.ndim, y.shape
        p2p.send(self.group, header, self.group.rank + 1)
        p2p.send(self.group, np.ascontiguousarray(y), self.group.rank + 1)

    def _receive_activations(self) -> Tensor:
        header = np.empty(HEADER, np.int64)
        p2p.recv(self.group, header, self.group.rank - 1)
        x = np.empty(tuple(header[2 : 2 + header[1]]), np.dtype(chr(header[0])))
        p2p.recv(self.group, x, self.group.rank - 1)
        return Tensor(x, requires_grad=True)
