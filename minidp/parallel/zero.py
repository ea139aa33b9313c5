"""`--strategy zero --zero-stage 1|2|3`: data parallelism without every rank holding every
model state (Rajbhandari, Rasley, Ruwase & He, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020).

    mpiexec -n 4 python -m minidp --strategy zero --zero-stage 3

Ψ parameters, N_d data-parallel ranks, K bytes of optimizer state per parameter. The paper
trains in mixed precision (2 + 2 + K, K = 12); minidp has no mixed precision, so here it is
fp32 weights and gradients and AdamW's two fp32 moments, K = 8. Model states per rank:

    stage           parameters   gradients   optimizer   total             Ψ=7.5B, N_d=64
    DP              4Ψ           4Ψ          KΨ          16Ψ               120 GB
    1: P_os         4Ψ           4Ψ          KΨ/N_d      8Ψ + 8Ψ/N_d       61 GB
    2: P_os+g       4Ψ           4Ψ/N_d      KΨ/N_d      4Ψ + 12Ψ/N_d      31 GB
    3: P_os+g+p     4Ψ/N_d       4Ψ/N_d      KΨ/N_d      16Ψ/N_d           1.9 GB

Besides these (counted in memory_bytes, from the arrays): AdamW's 8-byte step counter per
tensor it steps (DP: per parameter tensor; ZeRO: per segment piece, zero_flat.py); the
groups' scratch; at stage 3 two gather slots of the largest layer (zero3.py). Within a step
(not in memory_bytes, read after it; bench memory's tracemalloc peak sees it): one layer's
full gradients until its reduce-scatter (zero_grads.py). A rank's chunks differ
by at most one element per segment, so "Ψ/N_d" is this rank's count, summing to Ψ exactly.

One step, over the data-parallel `group` (the whole world, or a mesh's DP axis):

    stage 1   forward; backward into DDP's whole-gradient buckets, each bucket reduce-
              scattered (overlapped as DDP's allreduces are); clip by the global norm
              (each rank's squared norm of its chunks, summed); AdamW on my chunks only;
              allgather every bucket's parameters
    stage 2   the same, but a bucket's gradients go to a staging vector when ready and are
              dropped after its reduce-scatter: only my gradient chunks stay (zero_grads.py)
    stage 3   parameters sharded too: each layer is allgathered before its forward and
              again before its backward, released after (zero3.py); its gradients are
              reduce-scattered when ready; AdamW on my chunks; nothing to gather after

Communication per rank per step (ring algorithms, n elements): DP allreduces 2(N-1)/N·Ψ;
stages 1 and 2 reduce-scatter and allgather (N-1)/N·Ψ each, the same bytes; stage 3 adds the
allgather of backward, 3(N-1)/N·Ψ = 1.5x. Stages 2 and 3 are assembled by zero_sharded.py,
which FullyShardedDataParallel (fsdp.py, the same stages as a piece) builds on too.

--grad-accum K: at stages 1 and 2 the first K - 1 backwards sum their gradients locally
(DDP's buckets at stage 1, the parameters' own .grad at stage 2), the last reduce-scatters
the sums once, as DDP does; stage 3 reduce-scatters every micro-batch and adds the chunks
(zero_grads.py: holding every layer's whole gradient is what it exists to avoid).
The pieces are `ZeROAxis` (the data-parallel axis as ZeRO: what a recipe hands the step
skeleton, step.py) and the `ZeRO` recipe over the whole group; over a mesh's DP axis, with a
TP model inside, the hybrid recipe (tp_strategy.py) builds the same axis (zero_hybrid.py).
"""

import time

import numpy as np

from minidp import comm, optim
from minidp.config import BadConfig
from minidp.memory import optimizer_bytes
from minidp.parallel.buckets import bucket_groups
from minidp.parallel.data_parallel import DistributedDataParallel, check_same_model, overlap_helps
from minidp.parallel.dp_strategy import OVERLAP
from minidp.parallel.step import Step, check_micro_batches
from minidp.parallel.strategy import Clock, Recipe, global_l2, replica_spread
from minidp.parallel.zero3 import units_of
from minidp.parallel.zero_flat import ShardLayout, allgather_flat, flat_parameters, pieces
from minidp.parallel.zero_sharded import ALGOS, ShardedModel


def model_state_bytes(stage: int, psi: int, n: int, itemsize: int = 4, k: int = 8) -> dict:
    """The paper's formulas (table above) per category, for Ψ parameters on N_d = n ranks;
    stage 0 is plain DP. Exact when n divides psi; otherwise a rank's Ψ/N_d is its count."""
    shard = psi / n
    return {
        "parameters": itemsize * (shard if stage == 3 else psi),
        "gradients": itemsize * (shard if stage >= 2 else psi),
        "optimizer": k * (shard if stage >= 1 else psi),
    }


def check_zero(config, dp_size: int, name: str = "zero") -> None:
    """BadConfig (one line, alike on every rank) unless --zero-stage and --allreduce work."""
    if config.zero_stage not in (1, 2, 3):
        raise BadConfig(f"--strategy {name} needs --zero-stage 1, 2 or 3, got {config.zero_stage}")
    check_micro_batches(config, dp_size)
    if config.allreduce not in ALGOS:
        raise BadConfig(
            f"--strategy zero reduce-scatters and allgathers: --allreduce "
            f"{config.allreduce} is not one of theirs; choose from {', '.join(ALGOS)}"
        )


class ZeROAxis:
    """The data-parallel axis as ZeRO stage 1, 2 or 3 (config.zero_stage) of `model` over
    `group`: `layout` (the flat vector's segments and this rank's chunks), `pieces` (one
    Tensor per segment over this rank's chunks, what `optimizer` steps), `sync` (what
    reduces the gradients: DDP with a reduce-scatter hook at stage 1, ShardedGradients at
    2 and 3) and `after_step` (stages 1, 2: the parameter allgather).

    `make_optimizer(params)`: the optimizer over the pieces (default: --optimizer, AdamW
    unless set, with the config's lr and weight decay); any elementwise optimizer works."""

    def __init__(self, model, group: comm.Group, config, timeline, make_optimizer=None):
        self.config, self.dp_group, self.timeline = config, group, timeline
        self.stage = stage = config.zero_stage
        self.algo = config.allreduce
        if stage > 1:  # (at stage 1 DDP does both)
            check_same_model(model, group)
            for p in model.parameters():  # every rank starts from rank 0's weights
                comm.broadcast(p.data, root=0, group=group)
        names = {id(p): name for name, p in model.named_parameters()}
        if stage < 3:  # the flat vector is cut as DDP's buckets: reverse parameter order
            cap = max(1, int(config.bucket_mb * 2**20))
            trainable = [p for p in model.parameters() if p.requires_grad]  # as DDP takes them
            segments = bucket_groups(trainable[::-1], cap)
        else:  # one segment per layer, in forward order
            self.units = units_of(model)
            segments = [params for _, _, params in self.units]
        overlap = OVERLAP[config.overlap]
        if overlap == "auto":
            overlap = overlap_helps(group.size)[0]
        self.overlap = overlap and stage < 3  # stage 3 gathers inside backward: inline
        self.model, self.ddp, self.shards, self.gathered = model, None, None, None
        if stage == 1:
            self.layout = layout = ShardLayout(segments, names, group.size, group.rank)
            self.flat = flat_parameters(layout, model.parameters()[0].dtype)
            self.ddp = self.sync = DistributedDataParallel(
                model, group, config.bucket_mb, overlap=self.overlap, timeline=timeline
            )
            self.ddp.register_comm_hook(self._reduce_scatter_bucket)
            self.comm_group = self.ddp.comm_group
            param_chunks = [self.flat[lo:hi] for lo, hi in layout.ranges()]
            grad_chunks = [b.data[lo:hi] for b, (lo, hi) in zip(self.ddp.buckets, layout.chunks)]
        else:  # stages 2 and 3: zero_sharded.py
            order = list(range(len(segments)))  # buckets: index order; layers: last first
            self.shards = shards = ShardedModel(
                *(segments, names, group, self.algo),
                launch_order=order if stage == 2 else order[::-1],
                modules=[child for _, child, _ in self.units] if stage == 3 else None,
                outer=stage == 3 and self.units[0][1] is model,
                overlap=self.overlap,
                timeline=timeline,
            )
            self.layout, self.comm_group, self.sync = shards.layout, shards.comm_group, shards.grads
            self.gathered, self.flat = shards.gathered, shards.flat
            param_chunks, grad_chunks = shards.param_chunks, shards.grad_chunks
        self.pieces = pieces(param_chunks, grad_chunks)
        self.optimizer = (make_optimizer or self._optimizer)(self.pieces)
        self.gather_seconds = 0.0  # stages 1, 2: the parameter allgathers, in total
        self.after_step = [self.gather_flat] if stage < 3 else []
        gathers = (lambda: self.gathered.seconds) if self.gathered else lambda: self.gather_seconds
        sync = self.sync  # reductions (on a thread or not) and allgathers (never hidden)
        self.clock = Clock(
            lambda: sync.reducer.seconds + gathers(), lambda: sync.exposed_seconds + gathers()
        )

    def _optimizer(self, params):
        """--optimizer over this rank's pieces (AdamW by default): each piece's state only."""
        c = self.config
        return optim.make_optimizer(c.optimizer, params, c.lr, c.weight_decay)

    def _reduce_scatter_bucket(self, bucket, group: comm.Group) -> None:
        """Stage 1's DDP hook: only this rank's chunk of the bucket is summed (and only it
        is read by the optimizer); it passes through a scratch chunk, as out= may not
        overlap the input."""
        lo, hi = self.layout.chunks[bucket.index]
        mine = group.scratch.get("zero.chunk", hi - lo, bucket.data.dtype)
        comm.reduce_scatter(bucket.data, algo=self.algo, group=group, out=mine)
        bucket.data[lo:hi] = mine

    def step(self, loss, clip, after_step=()) -> Step:
        """The skeleton over these pieces (`clip`: the recipe's, each chunk counted once)."""
        config = self.config
        return Step(
            *(loss, self.sync, self.optimizer),
            batch_size=config.batch_size,
            grad_accum=config.grad_accum,
            dp_group=self.dp_group,
            timeline=self.timeline,
            clip=clip if config.grad_clip else None,
            after_step=[*self.after_step, *after_step],
        )

    def gather_flat(self) -> None:
        """Stages 1 and 2: every segment's updated chunks to every rank, into the model."""
        with self.timeline.span("parameter allgather"):
            start = time.perf_counter()
            allgather_flat(self.flat, self.layout, self.comm_group, self.algo)
            self.gather_seconds += time.perf_counter() - start

    def shard(self) -> np.ndarray:
        """This rank's parameter chunks, concatenated (layout.ranges() says where from)."""
        return np.concatenate([p.data for p in self.pieces])

    def held(self) -> dict[str, list]:
        """By memory category (the recipe adds its groups' scratch to the buffers)."""
        parameters = self.flat.nbytes if self.stage == 1 else self.shards.parameter_bytes
        grads = [b.data for b in self.ddp.buckets] if self.ddp else [self.shards.grad_shard]
        # and any whole gradient still on a parameter (none, after a step, at stages 2, 3)
        held = {
            "parameters": [parameters],
            "gradients": [*grads, *(p.grad for p in self.model.parameters())],
            "optimizer": [optimizer_bytes(self.optimizer)],
            "buffers": [self.comm_group.scratch.nbytes],
        }
        if self.gathered is not None:
            held["buffers"] += self.gathered.slots
            held["gathered_peak"] = [self.gathered.gathered_peak]
        return held

    def describe(self) -> str:
        layout = self.layout
        return (
            f"ZeRO stage {self.stage} over {self.dp_group.size} ranks | shard "
            f"{layout.shard_numel:,} of {layout.numel:,} parameters in {len(layout.segments)} "
            f"segments | reduce_scatter/allgather {self.algo} | overlap "
            f"{'on' if self.overlap else 'off'} | grad accumulation {self.config.grad_accum}"
        )

    def record(self) -> dict:
        return {
            "zero_stage": self.stage,
            "shard_elements": self.layout.shard_numel,
            "segments": len(self.layout.segments),
            "overlap": self.overlap,
        }

    def state_dict(self) -> dict:
        return {"stage": self.stage, "shard": self.shard(), **self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Collective: this rank's chunks back, and (stages 1, 2) the whole model rebuilt."""
        if state["stage"] != self.stage:
            raise ValueError(f"a ZeRO stage {state['stage']} state for stage {self.stage}")
        shard = state["shard"]
        offsets = [0, *np.cumsum([p.size for p in self.pieces])]
        if shard.size != offsets[-1]:  # saved over another N_d or other segments
            raise ValueError(
                f"a ZeRO shard of {shard.size} elements for a rank that holds {offsets[-1]}: "
                "was it saved with another number of ranks or --bucket-mb?"
            )
        for p, lo, hi in zip(self.pieces, offsets[:-1], offsets[1:]):
            p.data[...] = shard[lo:hi]
        self.optimizer.load_state_dict(state)
        if self.stage < 3:
            self.gather_flat()

    def close(self) -> None:
        if self.ddp is not None:
            self.ddp.close()
            return
        self.shards.close()


class ZeRO(Recipe):
    """ZeRO stage 1, 2 or 3 (config.zero_stage) over the whole `group` (ZeROAxis)."""

    name = "zero"

    def __init__(self, task, config, group: comm.Group, timeline=None, make_optimizer=None):
        super().__init__(task, config, group, timeline)
        check_zero(config, group.size)  # alike on every rank, before any message
        self.model, self.dp_group = task.model, group
        self.zero = z = ZeROAxis(task.model, group, config, self.timeline, make_optimizer)
        self.stage, self.layout, self.pieces, self.shard = z.stage, z.layout, z.pieces, z.shard
        self.optimizer, self.comm_group, self.gathered = z.optimizer, z.comm_group, z.gathered
        self.units = getattr(z, "units", None)
        self.axes, self.clocks, self.clip_params = (
            {"dp": [z.comm_group, group]},
            [z.clock],
            z.pieces,
        )
        self.run = z.step(self.loss, self.clip)
        self.data_shard = (group.rank, group.size)

    def loss(self, indices: np.ndarray):
        """The mean loss over these examples (a Tensor, to backpropagate)."""
        return self.task.loss(*self.task.batch(indices))

    def norm(self, kind: str) -> float:
        """Each rank's chunks, their squares summed over the data-parallel group."""
        return global_l2([getattr(p, kind) for p in self.pieces], shard_group=self.dp_group)

    def max_param_diff(self) -> float:
        """Spread among the ranks of the whole model (after gather_model, at stage 3)."""
        return replica_spread([p.data for p in self.task.model.parameters()], self.group)

    def gather_model(self) -> None:
        if self.gathered is not None:
            self.gathered.materialize()

    def held(self) -> dict[str, list]:
        held = self.zero.held()
        held["buffers"].insert(0, self.dp_group.scratch.nbytes)
        return held

    def describe(self) -> str:
        return self.zero.describe()

    def record(self) -> dict:
        return self.zero.record()

    def state_dict(self) -> dict:
        return self.zero.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.zero.load_state_dict(state)

    def close(self) -> None:
        self.zero.close()
