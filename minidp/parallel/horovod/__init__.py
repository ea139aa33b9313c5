"""Horovod's API on minidp's pieces: `import minidp.horovod as hvd`.

    hvd.init()
    model, opt = Net(), optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)    # every rank from rank 0's
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in my_shard_of_the_data:
        opt.zero_grad()
        cross_entropy(model(x), y).backward()
        opt.step()                     # the gradients allreduced (averaged), then the step
    hvd.join()                         # out of data: shadow the others' steps until all are

Horovod (Sergeev & Del Balso, 2018) is data parallelism by allreduce, as DDP is, with its
own names; minidp's collectives (comm/) do the moving:

    init, rank, size           the world (MPI's): rank and size
    local_rank, local_size     this rank among the ranks of its machine
    DistributedOptimizer       wraps an optimizer: step() first agrees which ranks are still
                               in (join), then allreduces every gradient (one flat vector;
                               Horovod's tensor fusion), scales it, and steps
      op=Average               the sum over the ranks still in, divided by their count
      op=Sum                   the sum
      op=Adasum                the adaptive sum (adasum.py), per parameter
      compression              Compression.none, or .fp16: the gradients sent as float16
                               (half the bytes), cast back after
      backward_passes_per_step gradients of this many backward passes add up in .grad before
                               one allreduce (scale each loss by 1/N for their mean); more
                               passes than that before step() is an error, as in Horovod
      gradient_predivide_factor  f: divided by f before the sum, by (ranks / f) after
    broadcast_parameters       the root's values into every rank's arrays, in place (a
                               state dict's arrays are the parameters': Module.state_dict)
    broadcast_optimizer_state  the root's optimizer state (made where no step has run)
    allreduce, allgather, broadcast, alltoall    on arrays and Tensors
    join()                     this rank is out of data: it joins each step the others still
                               take with zero gradients (no hang), until every rank joined;
                               returns the rank that joined last

Where Horovod overlaps the allreduces with backward (hooks and a background thread),
this one reduces in step(), plainly: DistributedDataParallel is minidp's overlapped one.
"""

import numpy as np

from minidp import comm
from minidp.engine.tensor import Tensor
from minidp.parallel.horovod.adasum import adasum_tree

Average, Sum, Adasum = "average", "sum", "adasum"
_state = {"group": None, "local": None, "optimizers": []}


class Compression:
    """How gradients travel: `none` as they are, `fp16` as float16 (Horovod's)."""

    none = "none"
    fp16 = "fp16"


def init(group: comm.Group | None = None) -> None:
    """Start: every call below runs over `group` (default: the world)."""
    from mpi4py import MPI

    _state["group"] = group or comm.world()
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    _state["local"] = (local.Get_rank(), local.Get_size())
    local.Free()


def _group() -> comm.Group:
    if _state["group"] is None:
        raise ValueError("call hvd.init() first")
    return _state["group"]


def rank() -> int:
    return _group().rank


def size() -> int:
    return _group().size


def local_rank() -> int:
    _group()
    return _state["local"][0]


def local_size() -> int:
    _group()
    return _state["local"][1]


def _array(x) -> np.ndarray:
    return x.data if isinstance(x, Tensor) else np.asarray(x)


def allreduce(x, op: str = Average, process_set: comm.Group | None = None):
    """The op over every rank's x (an array or a Tensor; a new one of the same kind)."""
    group = process_set or _group()
    a = _array(x)
    if op == Adasum:
        out = adasum_tree(list(comm.allgather(a, group=group)))
    else:
        out = comm.allreduce(a, group=group)
        if op == Average:
            out = out / group.size
    return Tensor(out) if isinstance(x, Tensor) else out


def allgather(x, process_set: comm.Group | None = None):
    """Every rank's x, concatenated along the first axis in rank order (each rank's x of
    one shape: Horovod's may differ along the first axis, minidp's allgather may not)."""
    group = process_set or _group()
    out = np.concatenate(list(comm.allgather(_array(x), group=group)))
    return Tensor(out) if isinstance(x, Tensor) else out


def broadcast(x, root_rank: int, process_set: comm.Group | None = None):
    """The root's x on every rank (a new array or Tensor)."""
    out = comm.broadcast(np.array(_array(x)), root=root_rank, group=process_set or _group())
    return Tensor(out) if isinstance(x, Tensor) else out


def alltoall(x, process_set: comm.Group | None = None):
    """Row block j of x to rank j (x's first axis split in equal blocks, one per rank)."""
    group = process_set or _group()
    a = _array(x)
    out = comm.alltoall(a.reshape(group.size, -1, *a.shape[1:]), group=group)
    out = out.reshape(-1, *a.shape[1:])
    return Tensor(out) if isinstance(x, Tensor) else out


def broadcast_parameters(params, root_rank: int, process_set=None) -> None:
    """The root's values into every rank's arrays, in place: `params` a state dict
    (Module.state_dict(): the parameters' own arrays) or (name, Tensor) pairs
    (model.named_parameters()). NumPy backend only: a torch tensor is refused."""
    group = process_set or _group()
    items = params.items() if isinstance(params, dict) else params
    for _, value in sorted(items, key=lambda item: item[0]):
        array = _array(value)
        if not isinstance(array, np.ndarray) or not array.flags.writeable:
            raise ValueError("broadcast_parameters needs the parameters' own arrays")
        comm.broadcast(array, root=root_rank, group=group)


def broadcast_optimizer_state(optimizer, root_rank: int, process_set=None) -> None:
    """The root's optimizer state (its moments, step counts, lr) into every rank's."""
    group = process_set or _group()
    inner = getattr(optimizer, "optimizer", optimizer)
    inner.init_state()
    for state in inner.state:
        for key in sorted(state):
            if np.ndim(state[key]) == 0:  # a step count: a 0-d array of its own
                one = comm.broadcast(np.array([state[key]]), root=root_rank, group=group)
                state[key] = np.array(one[0])
            else:
                comm.broadcast(state[key], root=root_rank, group=group)
    scalars = np.array([inner.lr, inner.step_count], dtype=np.float64)
    comm.broadcast(scalars, root=root_rank, group=group)
    inner.lr, inner.step_count = float(scalars[0]), int(scalars[1])


class DistributedOptimizer:
    """`optimizer` whose step() first allreduces the gradients (see the module doc)."""

    def __init__(
        self,
        optimizer,
        named_parameters=None,
        compression: str = Compression.none,
        backward_passes_per_step: int = 1,
        op: str = Average,
        gradient_predivide_factor: float = 1.0,
        process_set: comm.Group | None = None,
    ):
        if op not in (Average, Sum, Adasum):
            raise ValueError(f"op must be hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}")
        if compression not in (Compression.none, Compression.fp16):
            raise ValueError(f"compression must be Compression.none or .fp16, got {compression!r}")
        if not (isinstance(backward_passes_per_step, int) and backward_passes_per_step >= 1):
            raise ValueError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
            )
        if op == Adasum and compression != Compression.none:
            raise ValueError("compression with op=Adasum: Adasum combines full-precision tensors")
        if not gradient_predivide_factor > 0 or (gradient_predivide_factor != 1 and op != Average):
            raise ValueError("gradient_predivide_factor: a positive number, with op=Average only")
        self.optimizer, self.group = optimizer, process_set or _group()
        self.compression, self.op, self.passes = compression, op, backward_passes_per_step
        self.predivide = gradient_predivide_factor
        self.params = [p for p in optimizer.params if p.requires_grad]  # frozen: untouched
        if named_parameters is not None:  # Horovod checks that the names cover the params
            named = {id(p) for _, p in named_parameters}
            if any(id(p) not in named for p in self.params):
                raise ValueError("named_parameters does not name every parameter of optimizer")
        mine = {id(p) for p in self.params}
        for old in list(_state["optimizers"]):  # wrappers of these parameters: replaced
            if mine & {id(p) for p in old.params}:
                old.close()
        self._counts = [0] * len(self.params)  # backward passes that reached each
        self._unhook = [
            p.register_grad_ready_hook(lambda p, i=i: self._count(i))
            for i, p in enumerate(self.params)
        ]
        _state["optimizers"].append(self)

    def close(self) -> None:
        """Unhook; hvd.join() no longer joins this optimizer's steps."""
        for unhook in self._unhook:
            unhook()
        self._unhook = []
        if self in _state["optimizers"]:
            _state["optimizers"].remove(self)

    def _count(self, i: int) -> None:
        self._counts[i] += 1
        if self._counts[i] > self.passes:
            raise ValueError(
                f"a gradient was computed {self._counts[i]} times before step(): more than "
                f"backward_passes_per_step={self.passes}; call step() (or raise it)"
            )

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.lr = value

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.synchronize(active=True)
        self.optimizer.step()

    def synchronize(self, active: bool = True) -> int:
        """Collective: agree how many ranks are still in, then reduce the gradients (zeros
        from a rank that joined); returns how many are in (0: every rank joined)."""
        live = int(comm.allreduce(np.array([int(active)], np.int64), group=self.group)[0])
        if live == 0:
            return 0
        self._counts = [0] * len(self.params)
        flat = np.concatenate([  # one vector (Horovod's tensor fusion); zeros where no grad
            p.grad.ravel() if active and p.grad is not None else np.zeros(p.size, p.dtype)
            for p in self.params
        ])  # fmt: skip
        if self.op == Adasum:
            reduced = self._adasum(flat)
        else:
            wire = np.float16 if self.compression == Compression.fp16 else flat.dtype
            sent = (flat / self.predivide).astype(wire)  # fp16: half the bytes on the wire
            reduced = comm.allreduce(sent, group=self.group).astype(flat.dtype)
            if self.op == Average:
                reduced *= self.predivide / live
        if active:
            offset = 0
            for p in self.params:
                p.grad = reduced[offset : offset + p.size].reshape(p.shape).copy()
                offset += p.size
        return live

    def _adasum(self, flat: np.ndarray) -> np.ndarray:
        every = comm.allgather(flat, group=self.group)
        out, offset = np.empty_like(flat), 0
        for p in self.params:  # per parameter, as Horovod combines each tensor
            part = slice(offset, offset + p.size)
            out[part] = adasum_tree([row[part] for row in every])
            offset += p.size
        return out

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def join() -> int:
    """Collective: this rank is out of data. Until every rank has joined, it takes part in
    each step the others take (the newest DistributedOptimizer's), with zero gradients;
    returns the rank that joined last (the lowest of those that joined together)."""
    if not _state["optimizers"]:
        raise ValueError("hvd.join() joins a DistributedOptimizer's steps: make one first")
    optimizer = _state["optimizers"][-1]
    group = optimizer.group  # its process set: the ranks that step it
    rounds = 0
    while optimizer.synchronize(active=False):
        rounds += 1
    every = comm.allgather(np.array([rounds], np.int64), group=group).ravel()
    return int(np.argmin(every))  # the fewest steps shadowed: the last to join
