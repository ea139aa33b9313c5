"""ZeROAxis: the data-parallel axis as ZeRO stage 1, 2 or 3, the pieces a recipe hands the
step skeleton (step.py): the flat vector's layout, this rank's chunks as the optimizer's
parameters, the gradient synchronizer and the parameter allgather. What each stage holds
and sends, and why: zero.py's table; the `ZeRO` recipe there and the hybrid's
(tp.py, zero_over_tp.py) build it.

    stage 1   DDP's buckets, each reduce-scattered by a comm hook; allgather after the step
    stage 2   ShardedGradients (parallel/zero/grads.py): each segment's gradients reduce-scattered
              when ready, into this rank's gradient shard; allgather after the step
    stage 3   the same, with each layer gathered around its use (parallel/zero/stage3.py):
              no allgather
"""

import time

import numpy as np

from minidp import comm
from minidp.cli.strategies.ddp_axis import OVERLAP
from minidp.cli.strategies.protocol import Clock
from minidp.cli.strategies.step import Step
from minidp.engine import optim
from minidp.engine.units import units_of
from minidp.parallel.checkpoint import Slice
from minidp.parallel.data_parallel.buckets import bucket_groups
from minidp.parallel.data_parallel.comm_thread import overlap_helps
from minidp.parallel.data_parallel.ddp import DistributedDataParallel
from minidp.parallel.same_model import check_same_model
from minidp.parallel.zero.flat import (
    ShardLayout,
    allgather_flat,
    chunk_slices,
    flat_parameters,
    pieces,
)
from minidp.parallel.zero.sharded import ShardedModel
from minidp.tools.memory import optimizer_bytes


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
        else:  # stages 2 and 3: parallel/zero/sharded.py
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
        self.after_sync, self.after_step = [], [self.gather_flat] if stage < 3 else []
        if stage == 1:  # DDP's rule: what no rank's backward reached is not stepped
            self.slices, self.aside = chunk_slices(layout), []
            self.after_sync, self.after_step = [self._set_aside], [self._put_back, *self.after_step]
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

    def make_step(self, loss, clip, after_step=()) -> Step:
        """The skeleton over these pieces (`clip`: the recipe's, each chunk counted once)."""
        config = self.config
        return Step(
            *(loss, self.sync, self.optimizer),
            batch_size=config.batch_size,
            grad_accum=config.grad_accum,
            dp_group=self.dp_group,
            timeline=self.timeline,
            clip=clip if config.grad_clip else None,
            after_sync=self.after_sync,
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

    def record(self, steps_done: int = 0) -> dict:
        return {
            "zero_stage": self.stage,
            "shard_elements": self.layout.shard_numel,
            "segments": len(self.layout.segments),
            "overlap": self.overlap,
        }

    def state_dict(self) -> dict:
        return {"stage": self.stage, "shard": self.shard(), **self.optimizer.state_dict()}

    def summary(self, steps_done: int = 0) -> str:
        return ""

    part = ""  # which flat vector this axis shards, where ranks shard different ones

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
        if self.ddp is not None:
            self.ddp.close()
            return
        self.shards.close()
