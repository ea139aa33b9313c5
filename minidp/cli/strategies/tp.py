"""`--strategy tp` and `--strategy hybrid`: tensor parallelism inside each TP group of the
mesh, data parallelism across its DP axis.

    mpiexec -n 4 python -m minidp --strategy tp --tp 4                 # dp 1 x tp 4
    mpiexec -n 4 python -m minidp --strategy hybrid --dp 2 --tp 2      # dp 2 x tp 2
    mpiexec -n 4 python -m minidp --strategy hybrid --dp 2 --tp 2 --sequence-parallel
    mpiexec -n 4 python -m minidp --strategy hybrid --dp 2 --cp 2      # dp 2 x cp 2, ring

Every rank builds the whole nn.GPT from the seed (the task's model) and keeps its TP slice
(parallel/tensor_parallel/gpt.py); ranks of one TP group read the same examples (the data
shard is the DP coordinate). The recipe: a Mesh, the TP GPT on its TP group, and over its
DP group DDP (ddp_axis.py) or, with `--zero-stage S`, ZeRO on the TP shards
(parallel/zero/over_tp.py), handed to the one step skeleton (step.py). After DDP's sync the
replicated parameters' gradients are made alike over TP (parallel/tensor_parallel/
replicated.py: summed under sequence parallelism, TP rank 0's where DP sums may differ);
the clip's norm counts each shard once. docs/tensor_parallel.md and docs/hybrid.md have
the step, what is sent, and the measured tables.

With `--cp C` (context parallelism, docs/context_parallel.md) the mesh is dp x cp x tp and
ContextParallel wraps the TP GPT over the CP group: each rank feeds its T/C positions of
the examples its DP coordinate reads, attends by ring attention or Ulysses with its TP
heads, and the loss is the whole batch's mean. Its gradients are partial sums over the
CP group: summed there after DDP's sync (before the replicated ones are made alike).
"""

import contextlib
from dataclasses import replace

from minidp import comm
from minidp.cli.strategies.ddp_axis import DDPAxis
from minidp.cli.strategies.protocol import Exposed, Recipe
from minidp.cli.strategies.step import check_micro_batches, step_from
from minidp.cli.strategies.zero import check_zero, zero_options
from minidp.cli.training.config import BadConfig
from minidp.cli.training.scheme_checks import cp_zigzag
from minidp.parallel.across_ranks import replica_spread, stand_in
from minidp.parallel.mesh import Mesh
from minidp.parallel.tensor_parallel.mesh_gpt import MeshGPT
from minidp.parallel.zero.over_tp import ZeROOverTP, drifts


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


def check_drift(config, dp: int, tp: int, vocab: int) -> bool:
    """Whether ZeRO must broadcast TP rank 0's replicated parameters (BadConfig: stage 3)."""
    drift = drifts(dp, tp, vocab)
    if drift and config.precision != "fp32":  # TP rank 0's masters would have to go too
        raise BadConfig(
            f"--precision {config.precision} with ZeRO over --dp {dp} > 2 and TP shards of "
            f"unequal sizes (a vocabulary of {vocab} over --tp {tp}) is not yet supported: "
            "the replicated weights' float32 masters would drift apart; use --precision fp32"
        )
    if drift and config.zero_stage == 3:
        raise BadConfig(
            f"--zero-stage 3 over --dp {dp} > 2 with TP shards of unequal sizes (a "
            f"vocabulary of {vocab} over --tp {tp}) is not yet supported: use "
            "--zero-stage 1 or 2"
        )
    return drift


def hybrid_sizes(config, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, cp) of the mesh the tp or hybrid flags ask for (mesh_sizes on world / cp);
    BadConfig (one line) when the flags cannot work. Their product may not be the world."""
    cp = config.cp  # (1 for --strategy tp: --cp is hybrid's)
    if world_size % cp:
        raise BadConfig(f"--cp {cp} does not divide the world's {world_size} ranks")
    if cp > 1 and config.dp == config.tp == 0:  # --cp alone: the rest of the world is DP
        config = replace(config, tp=1)
    dp, tp = mesh_sizes(config, world_size // cp)
    if cp > 1 and config.cp_algo == "ulysses" and config.n_head % (tp * cp):
        raise BadConfig(
            f"--cp-algo ulysses: --n-head {config.n_head} must divide by --tp {tp} x --cp {cp}"
        )
    return dp, tp, cp


def check_mesh(config, world_size: int, gpt) -> tuple[int, int, bool]:
    """(dp, tp, drifts): the mesh the tp or hybrid flags ask for, and whether ZeRO must
    broadcast TP rank 0's replicated parameters after each step (check_drift), for the
    task's `gpt`; BadConfig (one line) when the flags cannot work."""
    dp, tp, cp = hybrid_sizes(config, world_size)
    drifts = False
    if config.zero_stage:
        drifts = check_drift(config, dp, tp, gpt.config.vocab_size)
    if dp * tp * cp != world_size:  # Mesh would refuse it naming its arguments: say flags
        sizes = {"dp": dp, "tp": tp, "pp": 1, **({"cp": cp} if cp > 1 else {})}
        flags = "--dp, --tp and --cp" if cp > 1 else "--dp and --tp"
        raise BadConfig(
            f"mesh: {' x '.join(sizes)} = {' x '.join(map(str, sizes.values()))} = "
            f"{dp * tp * cp}, but the world has {world_size} ranks; choose {flags} whose "
            f"product is {world_size}"
        )
    if config.zero_stage:
        check_zero(config, dp, "hybrid")
    else:
        check_micro_batches(config, dp)
    return dp, tp, drifts


class MeshRecipe(Recipe):
    """A recipe on a Mesh with one data-parallel axis (`self.axis`: `self.dp`, a DDPAxis, or
    `self.zero`, a ZeROOverTP): the mesh's groups' scratch counted, the mesh in the record,
    and closed after the axis. The tp and hybrid recipes (OnTheMesh) and the pipeline's
    (pp.py) share it."""

    def scratch_groups(self) -> list[comm.Group]:
        return [self.group, *self.mesh.groups().values()]

    def record(self) -> dict:
        mesh = self.mesh
        sizes = {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "cp": mesh.cp}
        return {**super().record(), "mesh": sizes}

    def close(self) -> None:
        super().close()
        self.mesh.close()


class OnTheMesh(MeshRecipe):
    """What the tp and hybrid recipes share: the mesh, the TP GPT on its TP group, and the
    reports (the mesh in the header and the record, bytes per mesh axis, the whole model
    gathered back). A recipe's __init__ checks its flags, then builds its data-parallel axis
    inside `with self.on_mesh(dp, tp):` with `use_ddp` or `use_zero`."""

    @contextlib.contextmanager
    def on_mesh(self, dp: int, tp: int, cp: int = 1):
        """The mesh and the GPT on it (`self.net`, parallel/tensor_parallel/mesh_gpt.py: the
        TP GPT, and with cp > 1 its ContextParallel); the mesh closed again if what
        follows fails."""
        self.mesh = mesh = Mesh(dp=dp, tp=tp, group=self.group, cp=cp)
        self.dp_group, self.dp, self.zero, config = mesh.dp_group, None, None, self.config
        try:
            self.net = net = MeshGPT(
                self.task.model, mesh, sequence_parallel=config.sequence_parallel,
                cp_algo=config.cp_algo, zigzag=cp_zigzag(config),
            )  # fmt: skip
            self.model, self.sharded, self.replicated = net.model, net.sharded, net.replicated
            yield
        except BaseException:
            mesh.close()
            raise
        # f and g, the ring's hops and Ulysses' all-to-alls: on the critical path
        self.clocks += [Exposed(mesh.tp_group), Exposed(mesh.cp_group)]
        self.axes = {
            "dp": [self.comm_group, mesh.dp_group],
            "tp": [mesh.tp_group],
            "pp": [mesh.pp_group],
            "cp": [mesh.cp_group],
        }
        for p in self.task.model.parameters():  # the TP model holds copies of its slices:
            p.data = stand_in(p)  # free the whole model's (gather_model builds fresh ones)
        self.data_shard = (mesh.dp_group.rank, mesh.dp_group.size)

    def use_ddp(self, optimizer=None) -> None:
        """DistributedDataParallel over the DP axis; the replicated gradients made alike."""
        self.dp = self.axis = dp = DDPAxis(
            self.model, self.dp_group, self.config, self.timeline, optimizer
        )
        self.ddp, self.optimizer, self.comm_group = dp.ddp, dp.optimizer, dp.ddp.comm_group
        self.compressor, self.pruning = dp.compressor, dp.pruning
        self.clocks, self.clip_params = [dp.ddp], self.model.parameters()
        self.run = dp.make_step(self.loss, self.clip, self.timeline, self.group, [self.after_sync])

    def use_zero(self, make_optimizer=None) -> None:
        """ZeRO over the DP axis (parallel/zero/over_tp.py): rank (d, t) keeps chunk d of TP
        shard t."""
        options = zero_options(self.config, self.timeline, make_optimizer)
        self.zero = self.axis = z = ZeROOverTP(
            self.model, self.mesh, self.sharded, self.replicated, **options
        )
        self.optimizer, self.comm_group, self.gathered = z.optimizer, z.comm_group, z.gathered
        self.layout, self.pieces, self.shard = z.layout, z.pieces, z.shard
        self.clocks, self.clip_params = [z], z.pieces
        self.run = step_from(
            *(self.config, self.loss, z.sync, z.optimizer, self.dp_group, self.timeline),
            self.clip,
            job=self.group,
            after_sync=z.after_sync,
            after_step=[*z.after_step, self.broadcast_drift],
        )

    def after_sync(self) -> None:
        """After DDP's sync: the CP parts summed, the replicated gradients alike over TP
        (TP rank 0's where DP sums may differ by rank)."""
        self.net.after_dp_sync(take_rank0=self.mesh.dp > 2 or self.compressor is not None)

    def broadcast_drift(self) -> None:
        """After ZeRO's step: TP rank 0's replicated parameters, where they may drift."""
        if self.drifts:
            self.zero.broadcast_replicated()

    def norm(self, kind: str) -> float:
        return (self.zero or self.net).norm(kind)

    def replicas(self) -> list:
        """The TP shards alike over DP and CP, the replicated parameters on every rank
        (under ZeRO the DP axis holds shards: only the replicated ones)."""
        return self.net.replicas(self.group, shards=self.zero is None)

    def max_param_diff(self) -> float:
        if self.zero is not None:  # as ZeRO: the whole model after gather_model
            return replica_spread([p.data for p in self.task.model.parameters()], self.group)
        return self.net.max_param_diff(self.group)

    def gather_model(self) -> None:
        """Collective: the TP model whole on each TP rank (ZeRO stage 3 gathers it over DP
        first), then the whole model in task.model from the TP shards."""
        if self.zero is not None:
            self.zero.gather_model()
        self.net.gather_into(self.task.model)

    def describe(self) -> str:
        return f"{self.mesh.describe()} | {self.net.describe()} | {super().describe()}"

    def record(self) -> dict:
        return {**super().record(), "sequence_parallel": self.model.sequence_parallel}


class TensorParallel(OnTheMesh):
    """`--strategy tp`: the TP GPT on the whole group, DDP over a DP axis of one."""

    name = "tp"

    def __init__(self, task, config, group: comm.Group, timeline=None, optimizer=None):
        super().__init__(task, config, group, timeline)
        # alike on every rank, before any message (no --zero-stage for tp: no drift)
        dp, tp, _ = check_mesh(config, group.size, task.model)
        with self.on_mesh(dp, tp):
            self.use_ddp(optimizer)


class Hybrid(OnTheMesh):
    """`--strategy hybrid --dp D --tp T [--cp C]`: the TP GPT on a D x T (x C) mesh with DDP
    over its DP axis (and ContextParallel over its CP axis); with `--zero-stage S`, ZeRO
    over the DP axis instead."""

    name = "hybrid"

    def __init__(self, task, config, group: comm.Group, timeline=None, optimizer=None):
        super().__init__(task, config, group, timeline)
        # alike on every rank, before any message; drifts: see broadcast_drift
        dp, tp, self.drifts = check_mesh(config, group.size, task.model)
        with self.on_mesh(dp, tp, config.cp):
            if config.zero_stage:
                self.use_zero(optimizer)  # (a function of the pieces, as ZeRO takes it)
            else:
                self.use_ddp(optimizer)
