"""A model's gradients (ZeRO stage 2) and optionally its parameters (stage 3) sharded over a
group: the one assembly of flat.py, grads.py and stage3.py that `--strategy zero`
(stages.py) and FullyShardedDataParallel (fsdp.py) both build on.

    segments          the trainable parameters, laid end to end and cut into segments
                      (DDP's buckets, or units_of's layers): a ShardLayout; a model
                      built under deferred_init gives each rank only its chunks' values
    grad_shard        this rank's chunk of every segment's gradient: ShardedGradients
                      reduce-scatters each segment into it as backward finishes it
    parameters, not sharded (stage 2, SHARD_GRAD_OP):
      flat            all Ψ parameters, every p.data a view of it; this rank updates its
                      chunks, allgather_flat brings the others' before the next forward
    parameters, sharded (stage 3, FULL_SHARD: `modules` given, one per segment):
      param_shard     this rank's chunk of every segment; GatheredUnits gathers a layer
                      around its forward and its backward, released once reduce-scattered

`param_chunks[s]` and `grad_chunks[s]` are this rank's chunk of segment s (views of flat or
param_shard, and of grad_shard): what the sharded optimizer steps (flat.pieces).
Communication runs on a duplicate of `group` (`comm_group`), its counters this scheme's own.
"""

import numpy as np

from minidp import comm
from minidp.comm.trace import Timeline
from minidp.parallel.zero.flat import ShardLayout, flat_parameters
from minidp.parallel.zero.grads import ShardedGradients
from minidp.parallel.zero.stage3 import GatheredUnits
from minidp.tools.names import ALGORITHMS

# the algorithms both reduce_scatter and allgather accept
ALGOS = ("auto", *(a for a in ALGORITHMS["reduce_scatter"] if a in ALGORITHMS["allgather"]))


class ShardedModel:
    """`segments` (lists of trainable parameters of one dtype, each parameter in one) sharded
    over `group`, gradients reduce-scattered in `launch_order` (segment indices, the order
    backward finishes them). `names`: {id(parameter): dotted name}. `modules`: shard the
    parameters too, gathering segment s around modules[s]'s forward (`outer`: modules[0] is
    the model around the others, stage3.py). `overlap`: reduce-scatter on a communication
    thread (only without `modules`: stage 3 gathers inside backward)."""

    def __init__(
        self,
        segments: list[list],
        names: dict[int, str],
        group: comm.Group,
        algo: str,
        *,
        launch_order: list[int],
        modules=None,
        outer: bool = False,
        overlap: bool = False,
        timeline: Timeline | None = None,
    ):
        dtype = segments[0][0].dtype
        self.layout = layout = ShardLayout(segments, names, group.size, group.rank)
        self.comm_group = group.dup()
        self.comm_group.patient = overlap
        self.grad_shard = np.zeros(layout.shard_numel, dtype)
        every = range(len(segments))
        self.grad_chunks = [layout.my_chunk(self.grad_shard, s) for s in every]
        self.flat = self.param_shard = self.gathered = None
        if modules is None:
            self.flat = flat_parameters(layout, dtype)
            self.param_chunks = [self.flat[lo:hi] for lo, hi in layout.ranges()]
        else:
            self.param_shard = layout.shard_of_parameters(dtype)  # deferred: drawn in chunks
            for p in (p for segment in segments for p in segment):
                p.recipe = None  # its values are the shards' now (deferred_init's or not)
            self.param_chunks = [layout.my_chunk(self.param_shard, s) for s in every]
            self.gathered = GatheredUnits(
                modules, layout, self.param_shard, self.comm_group, algo, outer
            )
        self.grads = ShardedGradients(
            *(layout, launch_order, self.grad_shard, self.comm_group, algo, overlap),
            timeline=timeline or Timeline(False),
            launched=self.gathered.release if self.gathered else None,
            reduce_each=modules is not None,
        )

    @property
    def parameter_bytes(self) -> int:
        """The parameters this rank holds: all Ψ (flat), or its chunks (param_shard)."""
        return (self.param_shard if self.flat is None else self.flat).nbytes

    def close(self) -> None:
        """Stop the thread, unhook and unwrap the model, free the communicator (unless a
        thread is still stuck in it, after an error elsewhere, as DDP.close)."""
        stuck = self.grads.close()
        if self.gathered is not None:
            self.gathered.unwrap()
        if not stuck and not self.comm_group.broken:
            self.comm_group.free()
