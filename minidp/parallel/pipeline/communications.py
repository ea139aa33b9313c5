"""The messages of pipeline parallelism, as autograd ops: activations forward, gradients back.

A model cut into stages (GPipe, Huang et al. 2019) passes one tensor across each cut, per
micro-batch: stage s sends its output activations y to stage s + 1 in forward, and stage
s + 1 sends back dL/dy in backward. Written as two ops, each the other's conjugate (as
Megatron's f and g are, tensor_parallel/communications.py):

    send_activations(y):     forward  isend y downstream          ->  a 0-d handle h
                             backward receive dL/dy from downstream (h's seed is ignored)
    receive_activations():   forward  receive x from upstream     ->  x
                             backward isend dL/dx upstream

    stage s:   ... -> y --send--> h          h.backward(): recv dL/dy, backprop, ...
                           |  ^
                 (mb, fwd) |  | (mb, bwd)
                           v  |
    stage s+1:        recv --> x -> ... -> loss      loss.backward(): ..., isend dL/dx

so a stage's whole backward is one call, `root.backward()`, where the root is the loss on the
last stage and the send's handle h on the others: the engine receives, backpropagates and
sends in the right order by itself.

Matching: every message is tagged by (micro-batch, boundary, direction), so a schedule that
runs micro-batches out of order (1F1B, interleaved) receives the message it means, whatever
was sent first; the boundary (the sending stage's index in forward) tells apart two stages
of one rank (interleaved placement). A forward message is a small header (dtype, shape)
then the payload, on one tag (MPI keeps the order of two messages between one pair with one
tag); a gradient needs no header, since its sender knows the shape it sent forward.

Sends are non-blocking (`p2p.isend`): a stage never waits for its neighbour to be ready to
receive. Receives block, so an order of actions completes when the schedule's dry run
(dry_run.py) says it does, not merely because each rank respects its data dependencies.
The `Outbox` keeps each send's buffer alive until MPI is done with it. Receives wait with
the group's deadline (`group.timeout`, set by default; checks.py): a message that never
comes fails naming the peer instead of hanging.

Every blocking wait (a receive, the wait for a message to arrive, the sends' wait at the end
of a step) adds its wall time to `group.seconds`, the clock the group's collectives add to
(group.py): a pipeline's communication time is the time its ranks spent waiting for a
neighbour, the bubble included.
"""

import contextlib
import time

import numpy as np

from minidp.comm import p2p
from minidp.engine.tensor import Tensor, op

FORWARD, BACKWARD = 0, 1
_TAG_BASE = 10000  # above p2p's DATA_TAG and CHECK_TAG
_HEADER = 8  # int64s: dtype number, ndim, then up to six dimensions
_DTYPES = (np.float64, np.float32, np.float16, np.int64, np.int32)


def message_tag(group, micro_batch: int, boundary: int, num_stages: int, direction: int) -> int:
    """The tag of the message across `boundary` (stage boundary -> boundary + 1) for
    `micro_batch` in `direction` (FORWARD or BACKWARD): distinct for every triple."""
    tag = _TAG_BASE + 2 * (micro_batch * num_stages + boundary) + direction
    upper = p2p.max_tag(group)
    if upper is not None and tag > upper:
        raise ValueError(f"micro_batch {micro_batch}: its message tag {tag} exceeds MPI's {upper}")
    return tag


class Outbox:
    """The sends still in flight: each request with the buffer MPI reads from."""

    def __init__(self, group) -> None:
        self.group = group
        self.pending: list = []  # (request, buffer, peer)

    def send(self, buf: np.ndarray, dest: int, tag: int) -> None:
        self.pending = [s for s in self.pending if not s[0].Test()]  # forget those done
        self.pending.append((p2p.isend(self.group, buf, dest, tag), buf, dest))

    def wait(self) -> None:
        """Wait until every send has been received (with the group's deadline)."""
        pending, self.pending = self.pending, []
        if pending:
            _wait(self.group, [s[0] for s in pending], [s[2] for s in pending])


@contextlib.contextmanager
def clocked(group):
    """Add the block's wall time to `group.seconds` (as a collective's _Running does)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        group.seconds += time.perf_counter() - start


def await_message(group, source: int, tag: int) -> bool:
    """Wait (clocked) until a message from `source` with `tag` can be received, without
    receiving it; False when the group's deadline passes first."""
    with clocked(group):
        return p2p.probe(group, source, tag, timeout=group.timeout) is not None


def _wait(group, requests: list, peers: list[int]) -> None:
    with clocked(group):
        if group.timeout is None:
            p2p.waitall(group, requests, peers)
        else:
            p2p.waitall_within(group, requests, peers, group.timeout)


def _receive(group, buf: np.ndarray, source: int, tag: int) -> np.ndarray:
    _wait(group, [p2p.irecv(group, buf, source, tag)], [source])
    return buf


def _header(x: np.ndarray) -> np.ndarray:
    if x.ndim > _HEADER - 2:
        raise ValueError(f"send_activations: {x.ndim} dimensions, at most {_HEADER - 2}")
    dtype = next((i for i, d in enumerate(_DTYPES) if x.dtype == d), None)
    if dtype is None:
        raise TypeError(f"send_activations: dtype {x.dtype} is not one of {_DTYPES}")
    header = np.zeros(_HEADER, np.int64)
    header[:2] = dtype, x.ndim
    header[2 : 2 + x.ndim] = x.shape
    return header


# ---- the two ops ---------------------------------------------------------------------------
def send_activations(y: Tensor, outbox: Outbox, dest: int, forward_tag: int, backward_tag: int):
    """Forward: isend y to rank `dest` (header, then payload, tag `forward_tag`); returns a
    0-d handle. Backward (of the handle, whatever its seed): receive dL/dy from `dest` on
    `backward_tag` and hand it to y."""
    payload = np.ascontiguousarray(y.data)
    outbox.send(_header(payload), dest, forward_tag)
    outbox.send(payload, dest, forward_tag)
    shape, dtype = y.shape, y.dtype

    def backward(_seed):  # dL/dy comes from downstream, not from the seed
        return (_receive(outbox.group, np.empty(shape, dtype), dest, backward_tag),)

    return op(np.zeros((), dtype), (y,), backward)


def receive_activations(
    anchor: Tensor, outbox: Outbox, source: int, forward_tag: int, backward_tag: int
):
    """Forward: receive x from rank `source` (header, then payload, tag `forward_tag`).
    Backward: isend dL/dx back to `source` on `backward_tag`, at once.

    `anchor` is a leaf that requires a gradient and gets none: op() records a node only when
    a parent needs a gradient, and x comes from no tensor of this rank."""
    group = outbox.group
    header = _receive(group, np.empty(_HEADER, np.int64), source, forward_tag)
    dtype, ndim = _DTYPES[header[0]], int(header[1])
    x = _receive(group, np.empty(tuple(header[2 : 2 + ndim]), dtype), source, forward_tag)

    def backward(g):  # dL/dx goes upstream; the anchor needs nothing
        outbox.send(np.ascontiguousarray(g), source, backward_tag)
        return (None,)

    return op(x, (anchor,), backward)
