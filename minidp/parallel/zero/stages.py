"""ZeRO stage 1, 2 or 3 of a model over a data-parallel group, as one piece (Rajbhandari,
Rasley, Ruwase & He, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020): what `--strategy zero` and the hybrid's ZeRO drive, and the paper's table.

    zero = ZeROStages(model, group, stage=2, make_optimizer=lambda ps: optim.AdamW(ps, lr=1e-3))
    zero.sync.zero_grad(); loss.backward(); zero.sync.finish_gradient_sync()
    zero.optimizer.step(); for hook in zero.after_step: hook()    # stages 1, 2: allgather

Ψ parameters, N_d data-parallel ranks, K bytes of optimizer state per parameter. The paper
trains in mixed precision (2 + 2 + K, K = 12); here it is fp32 weights and gradients and
AdamW's two fp32 moments, K = 8. Model states per rank (`model_state_bytes`):

    stage           parameters   gradients   optimizer   total             Ψ=7.5B, N_d=64
    DP              4Ψ           4Ψ          KΨ          16Ψ               120 GB
    1: P_os         4Ψ           4Ψ          KΨ/N_d      8Ψ + 8Ψ/N_d       61 GB
    2: P_os+g       4Ψ           4Ψ/N_d      KΨ/N_d      4Ψ + 12Ψ/N_d      31 GB
    3: P_os+g+p     4Ψ/N_d       4Ψ/N_d      KΨ/N_d      16Ψ/N_d           1.9 GB

Besides these (counted by `held()`, from the arrays): AdamW's 8-byte step counter per piece;
the groups' scratch; at stage 3 two gather slots of the largest layer (stage3.py). Within a
step: one layer's full gradients until its reduce-scatter (grads.py). A rank's chunks
differ by at most one element per segment, so "Ψ/N_d" is this rank's count.

The flat vector is cut into segments (DDP's buckets of `bucket_mb`, in reverse parameter
order, at stages 1 and 2; one per layer, units_of's, at stage 3) and rank r owns chunk r of
each (flat.py). One step:

    stage 1   DDP's buckets, each reduce-scattered by a comm hook (overlapped as DDP's
              allreduces are); the optimizer on my chunks, but the part of a parameter no
              rank's backward reached (.grad None) put back after it, as DDP's optimizer
              skips it; allgather every bucket (`after_step`)
    stage 2   a segment's gradients go to a staging vector when ready and are
              reduce-scattered into my gradient shard (grads.py); allgather after the step
    stage 3   parameters sharded too: each layer allgathered before its forward and again
              before its backward, released after (stage3.py); no allgather

At stages 2 and 3 every chunk is stepped (FullyShardedDataParallel, fsdp.py, the same
stages for a user's model, skips a parameter no rank reached, for one small max-allreduce
a step). Communication per rank per step (ring, n elements): DP allreduces 2(N-1)/N·Ψ;
stages 1 and 2 reduce-scatter and allgather (N-1)/N·Ψ each, the same bytes; stage 3 adds the
allgather of backward, 3(N-1)/N·Ψ = 1.5x. Gradient accumulation (`sync.no_sync()`): at
stages 1 and 2 the sums stay local until the last backward; stage 3 reduce-scatters every
micro-batch and adds the chunks (holding a whole model's gradients is what it avoids).
"""

import time

import numpy as np

from minidp import comm
from minidp.comm.trace import Timeline
from minidp.engine.backend import is_half
from minidp.engine.deferred import materialize
from minidp.engine.units import units_of
from minidp.parallel.checkpoint import Slice
from minidp.parallel.data_parallel.buckets import bucket_groups
from minidp.parallel.data_parallel.comm_thread import overlap_helps
from minidp.parallel.data_parallel.ddp import DistributedDataParallel
from minidp.parallel.same_model import broadcast_parameters, check_same_model
from minidp.parallel.zero.flat import (
    ShardLayout,
    allgather_flat,
    chunk_slices,
    flat_parameters,
    pieces,
)
from minidp.parallel.zero.offload import Offload
from minidp.parallel.zero.sharded import ShardedModel
from minidp.tools.memory import model_state_bytes as model_state_bytes  # the table's, here too
from minidp.tools.memory import optimizer_bytes


class ZeROStages:
    """ZeRO `stage` 1, 2 or 3 of `model` over `group`: `layout` (the flat vector's segments
    and this rank's chunks), `pieces` (one Tensor per segment over this rank's chunks),
    `optimizer` (`make_optimizer(pieces)`: any elementwise minidp optimizer), `sync` (what
    reduces the gradients: DDP with a reduce-scatter hook at stage 1, ShardedGradients at 2
    and 3, with zero_grad, no_sync, set_batch_share and finish_gradient_sync), and the hooks
    to run `after_sync` and `after_step` (stages 1, 2: the parameter allgather).
    `overlap`: True, False or "auto" (reduce on a thread where each rank has a spare core;
    never at stage 3, which gathers inside backward). Collective: the constructor, every
    step, load_state_dict."""

    part = ""  # which flat vector this shards, where ranks shard different ones (over_tp.py)

    def __init__(
        self, model, group: comm.Group, stage: int, make_optimizer, *, bucket_mb: float = 0.25,
        algo: str = "auto", overlap="auto", timeline: Timeline | None = None,
        offload: bool = False,
    ):  # fmt: skip
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        self.dp_group, self.stage, self.algo = group, stage, algo
        self.timeline = timeline = timeline or Timeline(enabled=False)
        if stage > 1:  # (at stage 1 DDP does both)
            check_same_model(model, group, deferred_ok=True)
            broadcast_parameters(model.parameters(), group)  # every rank from rank 0's weights
        # deferred_init's model: the frozen parameters drawn whole (they stay whole), the
        # trainable ones drawn into the flat vector (stages 1, 2) or a chunk at a time (3)
        materialize(*(p for p in model.parameters() if not p.requires_grad))
        names = {id(p): name for name, p in model.named_parameters()}
        if stage < 3:  # the flat vector is cut as DDP's buckets: reverse parameter order
            cap = max(1, int(bucket_mb * 2**20))
            trainable = [p for p in model.parameters() if p.requires_grad]  # as DDP takes them
            segments = bucket_groups(trainable[::-1], cap)
        else:  # one segment per layer, in forward order
            self.units = units_of(model)
            segments = [params for _, _, params in self.units]
        if overlap == "auto":
            overlap = overlap_helps(group.size)[0]
        self.overlap = overlap and stage < 3  # stage 3 gathers inside backward: inline
        self.model, self.ddp, self.shards, self.gathered = model, None, None, None
        if stage == 1:
            self.layout = layout = ShardLayout(segments, names, group.size, group.rank)
            self.flat = flat_parameters(layout, model.parameters()[0].dtype)
            self.ddp = self.sync = DistributedDataParallel(
                model, group, bucket_mb, overlap=self.overlap, timeline=timeline
            )
            self.ddp.register_comm_hook(self._reduce_scatter_bucket)
            self.comm_group = self.ddp.comm_group
            param_chunks = [self.flat[lo:hi] for lo, hi in layout.ranges()]
            grad_chunks = [b.data[lo:hi] for b, (lo, hi) in zip(self.ddp.buckets, layout.chunks)]
        else:  # stages 2 and 3: sharded.py
            order = list(range(len(segments)))  # buckets: index order; layers: last first
            self.shards = shards = ShardedModel(
                *(segments, names, group, algo),
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
        self.optimizer = make_optimizer(self.pieces)
        # the optimizer's state in a memory-mapped file, paged in for each update (offload.py)
        self.offload = Offload(self.optimizer) if offload else None
        self.gather_seconds = 0.0  # stages 1, 2: the parameter allgathers, in total
        self.after_sync, self.after_step = [], [self.gather_flat] if stage < 3 else []
        if stage == 1:  # DDP's rule: what no rank's backward reached is not stepped
            self.slices, self.aside = chunk_slices(layout), []
            if is_half(self.pieces[0].data) and hasattr(self.optimizer, "init_state"):
                self.optimizer.init_state()  # 16-bit: the masters exist to be set aside too
            self.after_sync, self.after_step = [self._set_aside], [self._put_back, *self.after_step]

    @property
    def comm_seconds(self) -> float:
        """Reductions (on a thread or not) and allgathers, in total."""
        return self.sync.reducer.seconds + self._gathers()

    @property
    def exposed_seconds(self) -> float:
        """The part of comm_seconds nothing hid (allgathers never are)."""
        return self.sync.exposed_seconds + self._gathers()

    def _gathers(self) -> float:
        return self.gathered.seconds if self.gathered else self.gather_seconds

    def _reduce_scatter_bucket(self, bucket, group: comm.Group) -> None:
        """Stage 1's DDP hook: only this rank's chunk of the bucket is summed (and only it
        is read by the optimizer); it passes through a scratch chunk, as out= may not
        overlap the input."""
        lo, hi = self.layout.chunks[bucket.index]
        mine = group.scratch.get("zero.chunk", hi - lo, bucket.data.dtype)
        comm.reduce_scatter(bucket.data, algo=self.algo, group=group, out=mine)
        bucket.data[lo:hi] = mine

    def _set_aside(self) -> None:
        """Stage 1, after the sync: the optimizer steps whole segment chunks, which hold
        zeros where a parameter has .grad None (no rank's backward reached it); keep that
        part of my chunks, and of their optimizer state, to put back after the step, so it
        is neither moved nor decayed (DDP's optimizer skips such a parameter). No copy when
        every parameter was reached. Not all of DDP's rule: AdamW's step count is per piece
        (a segment's chunk), so a parameter skipped on some steps and reached on others gets
        the bias correction of its piece's count, not of its own. Reads the state of
        minidp.optim's optimizers (a list of per-piece dicts of arrays)."""
        states = getattr(self.optimizer, "state", [{}] * len(self.pieces))
        self.aside = [
            (array, s, array[s].copy())
            for piece, state, mine in zip(self.pieces, states, self.slices)
            for p, s in mine
            if p.grad is None
            for array in (piece.data, *(v for v in state.values() if np.ndim(v)))
        ]

    def _put_back(self) -> None:
        for array, s, kept in self.aside:
            array[s] = kept
        self.aside = []

    def gather_flat(self) -> None:
        """Stages 1 and 2: every segment's updated chunks to every rank, into the model."""
        with self.timeline.span("parameter allgather"):
            start = time.perf_counter()
            allgather_flat(self.flat, self.layout, self.comm_group, self.algo)
            self.gather_seconds += time.perf_counter() - start

    def gather_model(self) -> None:
        """Collective at stage 3: every layer whole in the model again (its own arrays)."""
        if self.gathered is not None:
            self.gathered.materialize()

    def shard(self) -> np.ndarray:
        """This rank's parameter chunks, concatenated (layout.ranges() says where from)."""
        return np.concatenate([p.data for p in self.pieces])

    def held(self) -> dict[str, list]:
        """This rank's arrays (and byte counts) by memory category."""
        parameters = self.flat.nbytes if self.stage == 1 else self.shards.parameter_bytes
        grads = [b.data for b in self.ddp.buckets] if self.ddp else [self.shards.grad_shard]
        # and any whole gradient still on a parameter (none, after a step, at stages 2, 3)
        held = {
            "parameters": [parameters],
            "gradients": [*grads, *(p.grad for p in self.model.parameters())],
            "optimizer": [0 if self.offload else optimizer_bytes(self.optimizer)],
            "buffers": [self.comm_group.buffer_bytes()],
        }
        if self.offload is not None:  # in the file, not this process's memory
            held["offloaded"] = [self.offload.nbytes]
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
            f"{'on' if self.overlap else 'off'}"
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

    def state_layout(self) -> dict:
        """How state_dict()'s arrays are cut, for resharding (minidp.parallel.checkpoint): the
        shard is this rank's ranges of the flat vector of Ψ elements, each piece's optimizer
        state its chunk of segment s; a segment's cut depends on N, its extent does not."""
        layout, part = self.layout, self.part
        places = {"shard": Slice.flat(layout.numel, layout.ranges(), part)}
        for s, (lo, hi) in enumerate(layout.chunks):  # each piece's moments (first step on)
            places[f"state/{s}/"] = Slice.flat(layout.lengths[s], [(lo, hi)], part)
        return places

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
        if self.offload is not None:
            self.offload.close()
        if self.ddp is not None:
            self.ddp.close()
        else:
            self.shards.close()
