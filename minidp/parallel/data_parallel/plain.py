"""Data parallelism, the plain idea: every rank holds the whole model, reads its slice of the
global batch, and after backward the ranks average every gradient, one allreduce per
parameter. Then every replica takes the step one process would take on the whole batch.

    mpiexec -n 4 python tutorials/05_data_parallel.py     (builds up to this, then beyond)

    ddp = SimpleDistributedDataParallel(model)   # every rank starts from rank 0's weights
    opt.zero_grad()
    loss = cross_entropy(ddp(x), y)              # each rank: the mean over its own examples
    loss.backward()
    ddp.finish_gradient_sync()                   # w.grad <- (1/N) sum_r w.grad_r, for each w
    opt.step()

Why the average is right: with N ranks on equal slices, the global mean loss is
(1/N) sum_r L_r, so its gradient is (1/N) sum_r grad L_r. Cost per step, in the α-β model
(Thakur et al.): one allreduce per parameter, so k parameters pay k·α of latency besides the
bandwidth term.

ddp.py's DistributedDataParallel is this with the speed put back: gradients packed
into a few buckets (one α per bucket), reduced as backward produces them (overlap), uneven
slices weighted by n_r / B, and speed tricks plugged in beside it (shm_arena.py, coalesce.py,
gil.py, host_stage.py).
"""

from minidp import comm
from minidp.engine.nn import Module


class SimpleDistributedDataParallel:
    """Wrap `model` for data-parallel training over `group` (default: the world): one
    allreduce(avg) per parameter after backward. Parameters that are frozen, or that no
    backward reached (.grad None on every rank), are left alone; every rank must have the
    same ones without a gradient (their allreduces pair up by order)."""

    def __init__(self, model: Module, group: comm.Group | None = None, algo: str = "auto"):
        self.model, self.group, self.algo = model, group or comm.world(), algo
        for p in model.parameters():  # every rank starts from rank 0's weights
            comm.broadcast(p.data, root=0, group=self.group)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def parameters(self):
        return self.model.parameters()

    def finish_gradient_sync(self) -> None:
        """After backward: every .grad becomes the mean over the ranks, in place."""
        for p in self.model.parameters():
            if p.requires_grad and p.grad is not None:
                comm.allreduce(p.grad, op="avg", algo=self.algo, group=self.group, out=p.grad)
