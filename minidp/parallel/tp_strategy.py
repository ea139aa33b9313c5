"""`--strategy tp` and `--strategy hybrid`: tensor parallelism inside each TP group of the
mesh, data parallelism across its DP axis.

    mpiexec -n 4 python -m minidp --strategy tp --tp 4                 # dp 1 x tp 4
    mpiexec -n 4 python -m minidp --strategy hybrid --dp 2 --tp 2      # dp 2 x tp 2
    mpiexec -n 4 python -m minidp --strategy hybrid --dp 2 --tp 2 --sequence-parallel

Every rank builds the whole nn.GPT from the seed (the task's model) and keeps its TP slice of
it (tp_gpt.py). Ranks of one TP group read the same examples: the data shard is the DP
coordinate, (d, dp). One step is data parallelism's step (dp_strategy.py) on the TP model:

    forward / backward        f, g (or the sequence pairs) over the TP group, inside the model
    DDP buckets               allreduce over the DP group: each rank reduces its own shard's
                              gradients with the ranks that hold the same shard
    replicated gradients      sequence parallel: each rank saw T/p positions, so the group
                              sums them (allreduce over TP)
    clip                      ||g||^2 = allreduce_TP(sum of squares of the shards)
                                        + sum of squares of the replicated (counted once)
    AdamW                     on this rank's shard; replicated parameters update alike on
                              every rank of the group, bit for bit (their gradients are)

Why replicated gradients agree bit for bit without sequence parallelism: every TP rank
computes them from the same inputs (g's output and f's backward are allreduce results,
identical on every rank). The DP allreduce then sums the same operands on every TP rank,
but in an order that depends on the bucket layout, which differs between TP ranks when the
shards differ in size (an uneven vocabulary). With 2 DP ranks a sum of two is the same
either way; from 3 on, TP rank 0's replicated gradients are broadcast over the group.
"""

import math

import numpy as np

from minidp import comm, optim
from minidp.config import BadConfig
from minidp.parallel.dp_strategy import DataParallel
from minidp.parallel.mesh import Mesh
from minidp.parallel.strategy import bytes_sent, replica_spread, stand_in
from minidp.parallel.tp_gpt import TensorParallelGPT


def mesh_sizes(config, world_size: int) -> tuple[int, int]:
    """(dp, tp) of the mesh the flags ask for; BadConfig (one line) when they cannot work."""
    if config.strategy == "tp":
        dp, tp = 1, config.tp or world_size
    elif config.dp == config.tp == 0:
        raise BadConfig("--strategy hybrid needs --dp or --tp (or both)")
    else:
        dp = config.dp or max(1, world_size // config.tp)
        tp = config.tp or max(1, world_size // config.dp)
    if config.model != "gpt":
        raise BadConfig(f"--strategy {config.strategy} splits the GPT; --model is {config.model}")
    for what, n in (("--n-head", config.n_head), ("4 x --n-embd", 4 * config.n_embd)):
        if n % tp:
            raise BadConfig(f"--tp {tp} must divide {what} ({n})")
    if config.sequence_parallel:
        if tp == 1:
            raise BadConfig("--sequence-parallel needs a TP group of more than one rank")
        if config.block_size % tp:
            raise BadConfig(
                f"--sequence-parallel: --block-size {config.block_size} must divide by --tp {tp}"
            )
    return dp, tp


class OnTheMesh:
    """What a strategy with a TP GPT on a mesh reports (TensorParallel, and ZeROHybrid in
    zero_hybrid.py): the mesh in the header and the record, bytes per axis, the whole model
    gathered back. It needs `mesh`, `model` (a TensorParallelGPT) and `dp_comm_group` (where
    the DP axis's gradient collectives run); put it before the strategy it extends."""

    def bytes_sent_by_axis(self) -> dict[str, int]:
        mesh = self.mesh
        return {
            "dp": bytes_sent(self.dp_comm_group, mesh.dp_group),
            "tp": bytes_sent(mesh.tp_group),
            "pp": bytes_sent(mesh.pp_group),
        }

    @property
    def comm_seconds(self) -> float:
        """The DP axis's gradient collectives plus the TP collectives in forward and backward."""
        return super().comm_seconds + self.mesh.tp_group.seconds

    @property
    def exposed_seconds(self) -> float:
        """The TP collectives sit on the critical path of forward and backward: all exposed."""
        return super().exposed_seconds + self.mesh.tp_group.seconds

    def release_whole_model(self) -> None:
        """The TP model holds copies of its slices: free the whole model's arrays (stand-ins
        until gather_model builds fresh ones), so memory_bytes is what this rank holds."""
        for p in self.task.model.parameters():
            p.data = stand_in(p)

    def gather_model(self) -> None:
        self.model.gather_into(self.task.model)

    def describe(self) -> str:
        sp = "on" if self.model.sequence_parallel else "off"
        return f"{self.mesh.describe()} | sequence parallel {sp} | {super().describe()}"

    def record(self) -> dict:
        mesh = self.mesh
        return {
            **super().record(),
            "mesh": {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp},
            "sequence_parallel": self.model.sequence_parallel,
        }


class TensorParallel(OnTheMesh, DataParallel):
    """The TP GPT on the mesh's TP group, DistributedDataParallel over its DP group."""

    name = "tp"

    def __init__(self, task, config, group: comm.Group, timeline=None, optimizer=None):
        dp, tp = mesh_sizes(config, group.size)  # alike on every rank, before any message
        self.mesh = Mesh(dp=dp, tp=tp, group=group)
        try:
            model = TensorParallelGPT(
                task.model, self.mesh.tp_group, sequence_parallel=config.sequence_parallel
            )
            super().__init__(
                task, config, group, timeline, optimizer, model=model, dp_group=self.mesh.dp_group
            )
        except BaseException:
            self.mesh.close()
            raise
        self.sharded, self.replicated = model.sharded_and_replicated()
        self.release_whole_model()
        self.dp_comm_group = self.ddp.comm_group

    # ---- the step's hooks (dp_strategy.py) ---------------------------------------------
    def loss(self, indices: np.ndarray):
        return self.model.loss(*self.task.batch(indices))

    def after_sync(self) -> None:
        tp_group = self.mesh.tp_group
        if tp_group.size == 1 or not self.replicated:
            return
        grads = [p.grad for p in self.replicated]
        flat = np.concatenate([g.ravel() for g in grads])
        if self.model.replicated_grads_partial:  # each rank saw its T/p positions: sum them
            comm.allreduce(flat, out=flat, group=tp_group)
        elif self.mesh.dp > 2 or self.compressor is not None:
            # the DP sums may differ by rank: in order (dp > 2), or in what a compressor
            # chose from each TP rank's own bucket (top-k, a scale): take rank 0's
            comm.broadcast(flat, root=0, group=tp_group)
        else:
            return
        offset = 0
        for g in grads:
            g[...] = flat[offset : offset + g.size].reshape(g.shape)
            offset += g.size

    def _l2(self, sharded, replicated) -> float:
        """sqrt(sum over the TP group of the shards' squares + the replicated once)."""
        total = np.array([optim.sum_of_squares(sharded)])
        if self.mesh.tp > 1:
            comm.allreduce(total, out=total, group=self.mesh.tp_group)
        return math.sqrt(float(total[0]) + optim.sum_of_squares(replicated))

    def clip_gradients(self) -> None:
        norm = self._l2([p.grad for p in self.sharded], [p.grad for p in self.replicated])
        optim.clip_grad_norm(self.model.parameters(), self.config.grad_clip, total_norm=norm)

    # ---- what the loop reports -----------------------------------------------------------
    def param_l2(self) -> float:
        return self._l2([p.data for p in self.sharded], [p.data for p in self.replicated])

    def max_param_diff(self) -> float:
        """Shards against their DP replicas; replicated parameters against every rank."""
        shards = replica_spread([p.data for p in self.sharded], self.mesh.dp_group)
        return max(shards, replica_spread([p.data for p in self.replicated], self.group))

    def memory_bytes(self) -> dict[str, int]:
        memory = super().memory_bytes()
        memory["buffers"] += sum(g.scratch.nbytes for g in self.mesh.groups().values())
        return memory

    def close(self) -> None:
        super().close()
        self.mesh.close()


class Hybrid(TensorParallel):
    """`--strategy hybrid --dp D --tp T`: the same scheme on a D x T mesh; with
    `--zero-stage S`, ZeRO over the DP axis instead of DDP (zero_hybrid.ZeROHybrid)."""

    name = "hybrid"

    def __new__(cls, task, config, *args, **kwargs):
        if config.zero_stage:  # not a Hybrid: Python runs no Hybrid.__init__ on it
            from minidp.parallel.zero_hybrid import ZeROHybrid  # (it imports this module)

            return ZeROHybrid(task, config, *args, **kwargs)
        return super().__new__(cls)
