"""minidp's training loop, in plain PyTorch: one process, or PyTorch DDP over torch.distributed.

    losses, net = train_reference(config)                 # one process
    losses, net = train_reference(config, group)          # DDP over the group's ranks

The same step as `python -m minidp train --strategy dp`, written the way PyTorch users
write it: the task's data (minidp's Task and DistributedSampler: the same examples, in the
same order), minidp's initial weights (torch_ref.py loads them), then per step

    lr = warmup_cosine(step)                              # set on the param group
    loss = F.cross_entropy(net(x), y); loss.backward()    # DDP averages the gradients here
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    torch.optim.AdamW(lr, betas=(0.9, 0.999), eps=1e-8, weight_decay).step()

PyTorch DDP runs inside the same `mpiexec` job: rank and world size come from MPI (the
group), rank 0 picks a free TCP port on 127.0.0.1 and broadcasts it over minidp.comm, and
torch.distributed's gloo backend then carries the gradient allreduce (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020). The global
loss, for the log, is summed over the group with minidp.comm, as minidp's strategies do.
"""

import socket

import numpy as np
import torch
import torch.nn.functional as F

from minidp import comm
from minidp.cli.training.config import TrainConfig
from minidp.engine import optim
from minidp.engine.tensor import Tensor
from minidp.models import data
from minidp.models.tasks import Task
from minidp.models.torch_ref import torch_model
from minidp.tools.info import cores_per_rank

DTYPES = {"float32": torch.float32, "float64": torch.float64}


_STORE: list = []  # rank 0's TCPStore serves every rank's teardown: kept until close_gloo


def init_gloo(group: comm.Group) -> None:
    """torch.distributed over gloo on 127.0.0.1, rank and world from `group` (MPI)."""
    import torch.distributed as dist

    port = np.zeros(1, dtype=np.int64)
    if group.rank == 0:
        with socket.socket() as s:  # a free port: bind to 0, read what the OS gave
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    comm.broadcast(port, root=0, group=group)
    store = dist.TCPStore("127.0.0.1", int(port[0]), group.size, is_master=group.rank == 0)
    _STORE.append(store)
    dist.init_process_group("gloo", store=store, rank=group.rank, world_size=group.size)


def close_gloo(group: comm.Group) -> None:
    """Tear torch.distributed down on every rank of `group` without a hang: all gloo work
    done first (a barrier), and rank 0's store kept serving until every rank has let go
    (an MPI barrier after). Without them one rank could wait forever in its teardown."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    comm.barrier(group=group)
    _STORE.clear()


class ReferenceRun:
    """The plain-PyTorch twin of a minidp run: model, optimizer, data, one `step(step)`.

    `group` None: one process; otherwise DDP over its ranks (init_gloo first)."""

    def __init__(self, config: TrainConfig, group: comm.Group | None = None, device="cpu"):
        config = config.resolved()  # --warmup unset: its fraction of --steps
        self.config, self.group = config, group
        torch.set_num_threads(config.threads or max(1, int(cores_per_rank())))  # as Task does
        self.task = Task(_numpy_config(config), np.dtype(config.dtype))  # data, init weights
        self.device = device
        self.net = torch_model(self.task.model, DTYPES[config.dtype], device)
        self.model = self.net
        if group is not None:
            self.model = torch.nn.parallel.DistributedDataParallel(self.net)
        rank, size = (0, 1) if group is None else (group.rank, group.size)
        self.sampler = data.DistributedSampler(
            self.task.num_examples, config.batch_size, rank, size, seed=config.seed
        )
        self.opt = torch.optim.AdamW(
            self.net.parameters(), lr=config.lr, betas=(0.9, 0.999), eps=1e-8,
            weight_decay=config.weight_decay,
        )  # fmt: skip

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.task.batch(indices)
        x = inputs.data if isinstance(inputs, Tensor) else inputs  # the MLP's come as a Tensor
        return torch.from_numpy(x).to(self.device), torch.from_numpy(targets).to(self.device)

    def step(self, step: int) -> float:
        """One optimizer step; returns the global batch's mean loss."""
        c = self.config
        lr = optim.warmup_cosine(step, c.lr, c.warmup, c.steps, c.min_lr_ratio)
        for group in self.opt.param_groups:
            group["lr"] = lr
        local = self.sampler.local_indices(step)
        x, y = self.batch(local)
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if c.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), c.grad_clip)
        self.opt.step()
        value = loss.item()
        if self.group is None:
            return value
        share = len(local) / c.batch_size  # n_r / B, as minidp's global_loss
        return float(comm.allreduce(np.array([value * share]), group=self.group)[0])


class MinidpRun:
    """minidp's own side of a comparison: the "dp" strategy over `group` (a one-rank group:
    one process), stepped exactly as training/loop.py steps it. `close()` when done."""

    def __init__(self, config: TrainConfig, group: comm.Group, timeline=None):
        from minidp.cli.strategies import DataParallel

        config = config.resolved()  # --warmup unset: its fraction of --steps
        self.config = config
        self.task = Task(config, np.dtype(config.dtype))
        self.strategy = DataParallel(self.task, config, group, timeline)
        self.sampler = data.DistributedSampler(
            self.task.num_examples, config.batch_size, *self.strategy.data_shard, seed=config.seed
        )

    def step(self, step: int) -> float:
        c = self.config
        lr = optim.warmup_cosine(step, c.lr, c.warmup, c.steps, c.min_lr_ratio)
        return self.strategy.step(self.sampler.local_indices(step), lr).loss

    def close(self) -> None:
        self.strategy.close()


def minidp_losses(config: TrainConfig, group: comm.Group) -> tuple[list[float], MinidpRun]:
    """config.steps steps of minidp's DP over `group`: the per-step global losses, the run."""
    run = MinidpRun(config, group)
    try:
        return [run.step(s) for s in range(config.steps)], run
    finally:
        run.close()


def _numpy_config(config: TrainConfig) -> TrainConfig:
    """The config with --backend numpy: the reference takes minidp's data and weights only."""
    from dataclasses import replace

    return replace(config, backend="numpy", device="cpu")


def train_reference(
    config: TrainConfig, group: comm.Group | None = None, device: str = "cpu"
) -> tuple[list[float], torch.nn.Module]:
    """Train `config.steps` steps in plain PyTorch (DDP over `group` when given); returns
    the per-step global losses and the trained torch model. Initializes and tears down
    torch.distributed around a DDP run."""
    if group is not None:
        init_gloo(group)
    run = ReferenceRun(config, group, device)
    losses = [run.step(s) for s in range(config.steps)]
    if group is not None:
        close_gloo(group)  # on success only: a rank that raised is ending the job anyway
    return losses, run.net
