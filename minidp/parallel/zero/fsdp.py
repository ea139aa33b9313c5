"""`FullyShardedDataParallel`: ZeRO stages 3 and 2 as a piece around the user's own model, as
PyTorch's FSDP (Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel", VLDB 2023; Rajbhandari et al., "ZeRO", SC 2020; Ψ, K, N as in stages.py's
table).

    with nn.deferred_init():            # optional: the model never whole on any rank, each
        model = MyModel(rng)            # rank draws only its chunks (engine/deferred.py)
    fsdp = FullyShardedDataParallel(model, sharding="full")   # or "grad_op"
    opt = optim.AdamW(fsdp.parameters(), lr=1e-3)             # this rank's shards only
    loss = cross_entropy(fsdp(x), y)    # "full": each layer gathered around its forward
    loss.backward()                     # each layer's gradients reduce-scattered when ready
    fsdp.finish_gradient_sync()         # the shards' .grad: the global batch's mean
    opt.step()                          # steps this rank's shards
    state = fsdp.full_state_dict()      # every parameter whole, by name, on every rank

Units. Each direct child of the model that owns trainable parameters is a unit (PyTorch
wraps each in an FSDP unit with one flat parameter); the parameters outside them, or shared
by two of them (a tied weight), make a unit of the model itself
(minidp.engine.units.units_of). Unit u's parameters, end to end, are segment u of the flat
vector, and rank r owns chunk r of every segment (chunk_bounds: Ψ need not divide by N, an
edge may fall inside a tensor):

    segments  | unit 0: W0 (12), b0 (3)           | unit 1: W1 (4), b1 (2) |  Ψ = 21, N = 3
    chunks    | 0 1 2 3 4 | 5 6 7 8 9 | 10 ... 14 | 15 16 | 17 18 | 19 20  |
    rank        r0          r1          r2          r0      r1      r2
    pieces    r0: W0[0:5], W1[0:2]    r1: W0[5:10], W1[2:4]    r2: W0[10:12], b0, b1

fsdp.parameters() on rank r: its pieces, Tensors over its chunks, one per parameter a
chunk touches (PyTorch's use_orig_params=True views).

Who holds what between steps, per rank (b bytes a number; the user's optimizer, over the
shards, holds K·Ψ/N whichever the sharding):

    sharding    PyTorch         ZeRO      parameters   gradients
    "full"      FULL_SHARD      stage 3   b·Ψ/N        b·Ψ/N      (+ stage3.py's gather slots)
    "grad_op"   SHARD_GRAD_OP   stage 2   b·Ψ          b·Ψ/N

What is sent when (ring algorithms: a rank sends (N-1)/N of each vector it moves):

    "full"      forward    allgather unit u before its forward; release it after
                backward   allgather unit u again before its backward; once its last
                           gradient is ready, reduce-scatter the unit's gradients (each
                           rank's weighted n_r/B) into my chunk, and release the unit
                           3(N-1)/N·Ψ·b a step: 1.5x DP's allreduce
    "grad_op"   backward   reduce-scatter each unit's gradients as "full" does
                forward    the first forward after a sync allgathers every unit's updated
                           chunks into the whole parameters (PyTorch: its pre-forward hook)
                           2(N-1)/N·Ψ·b a step: DP's bytes
    both        finish_gradient_sync(): one max-allreduce, on `group` (the comm group
                carries gradients and parameters only), of an int32 flag per trainable
                parameter: which no rank's backward reached

Which parameters, as DDP (parallel/data_parallel/ddp.py) treats them:
- *frozen* (requires_grad False before wrapping): broadcast from rank 0 with the rest at
  construction (drawn whole if deferred), then left whole on every rank: in no unit, no
  gradient, never moved.
- *shared* (a tied weight): model.parameters() lists it once, so it is one entry in one
  segment, and its pieces get the sum of its uses.
- *unused* by every rank's backward since the last sync: its pieces' .grad is None after
  the sync, so optimizers skip it (no weight decay, no moments), as DDP leaves it.

Gradients and averaging follow DDP's contract: a rank's loss is the mean over its n_r
examples, and `set_batch_share(n_r, B)` weighs its gradients by n_r / B before the sum
(default 1/N: equal slices). Each sync's reduce-scatter overwrites the gradient shards:
gradients add up only inside `no_sync()`, so optimizer.zero_grad() is harmless, not needed.
"""

import contextlib

import numpy as np

from minidp import comm
from minidp.engine.deferred import materialize
from minidp.engine.nn import Module
from minidp.engine.units import units_of
from minidp.parallel.across_ranks import clip_global_norm
from minidp.parallel.same_model import broadcast_parameters, check_same_model
from minidp.parallel.zero.flat import allgather_flat, gather_whole, pieces, slices_in
from minidp.parallel.zero.sharded import ALGOS, ShardedModel

SHARDINGS = ("full", "grad_op")  # PyTorch's FULL_SHARD and SHARD_GRAD_OP


class FullyShardedDataParallel:
    """Shard `model`'s trainable parameters over `group` (default: the world).

    `sharding`: "full" (parameters, gradients and optimizer state sharded: between steps the
    model's parameters are read-only stand-ins; forward through the wrapper or the model
    alike) or "grad_op" (parameters whole on every rank). `algo`: the reduce-scatters' and
    allgathers' algorithm. Collective: the constructor, every forward under "full", the
    first forward after a sync under "grad_op", finish_gradient_sync and full_state_dict
    run on every rank of the group. Freeze parameters before wrapping. Use it as a context
    manager, or call close(), to unwrap the model and free the communicator.

    "grad_op" gathers lazily: the first forward through the wrapper after
    finish_gradient_sync() allgathers the updated shards into the whole parameters, so step
    the optimizer between the two; until then the model's own parameters are stale but for
    this rank's chunks (full_state_dict() reads the shards, never the stale copy)."""

    def __init__(
        self, model: Module, group: comm.Group | None = None, sharding: str = "full", algo="auto"
    ):
        if sharding not in SHARDINGS:
            raise ValueError(
                "sharding must be 'full' (FULL_SHARD, ZeRO stage 3) or 'grad_op' "
                f"(SHARD_GRAD_OP, ZeRO stage 2), got {sharding!r}"
            )
        if not isinstance(model, Module):
            raise TypeError(f"model must be a minidp.nn.Module, got {type(model).__name__}")
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {', '.join(ALGOS)}, got {algo!r}")
        self.model, self.sharding, self.algo = model, sharding, algo
        self.group = group = group or comm.world()
        check_same_model(model, group, deferred_ok=True)  # frozen ones too: alike everywhere
        units = units_of(model)
        if not units:
            raise ValueError("model has no parameter that requires grad: nothing to shard")
        dtypes = sorted({str(p.dtype) for _, _, params in units for p in params})
        if len(dtypes) > 1:
            raise TypeError(f"model's trainable parameters must share one dtype, got {dtypes}")
        broadcast_parameters(model.parameters(), group)  # every rank from rank 0's weights
        materialize(*(p for p in model.parameters() if not p.requires_grad))  # kept whole
        self.units = [name or "(the model's own)" for name, _, _ in units]
        segments = [params for _, _, params in units]
        self.shards = ShardedModel(
            segments,
            {id(p): name for name, p in model.named_parameters()},
            group,
            algo,
            launch_order=list(range(len(units)))[::-1],  # backward finishes the last first
            modules=[module for _, module, _ in units] if sharding == "full" else None,
            outer=units[0][1] is model,
        )
        self.layout, self.comm_group = self.shards.layout, self.shards.comm_group
        # one piece per parameter a chunk touches (as ZeroRedundancyOptimizer's): its data a
        # view of my parameter chunk, its gradient a view of my gradient chunk, given at
        # each sync to the pieces whose parameter some rank's backward reached
        data, self._grads, self._param_index, self._places = [], [], [], []
        first = np.cumsum([0, *map(len, segments)])  # index of each segment's first parameter
        for s, (lo, hi) in enumerate(self.layout.chunks):
            offset = 0
            for i, start, stop in slices_in(segments[s], lo, hi):
                end = offset + stop - start
                data.append(self.shards.param_chunks[s][offset:end])
                self._grads.append(self.shards.grad_chunks[s][offset:end])
                self._param_index.append(first[s] + i)
                self._places.append((segments[s][i], start, stop))
                offset = end
        self._pieces = pieces(data, [None] * len(data))
        self._accumulating = False  # inside no_sync()
        self._stale = False  # "grad_op": the whole parameters wait for the updated chunks

    def __call__(self, *args, **kwargs):
        if self._stale:
            allgather_flat(self.shards.flat, self.layout, self.comm_group, self.algo)
            self._stale = False
        return self.model(*args, **kwargs)

    def __enter__(self) -> "FullyShardedDataParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def parameters(self) -> list:
        """This rank's shards: Tensors over its chunks, one per parameter a chunk touches,
        for any minidp optimizer (elementwise: a chunk steps as the whole would)."""
        return list(self._pieces)

    def piece_places(self) -> list[tuple]:
        """(parameter, lo, hi) of each of parameters()'s pieces: elements [lo, hi) of the
        flattened parameter (what checkpoint.get_state_dict saves and reshards)."""
        return list(self._places)

    def state_loaded(self) -> None:
        """After the shards were loaded (checkpoint.set_state_dict): "grad_op" gathers the
        whole parameters again before the next forward; "full" gathers around each use."""
        self._stale = self.sharding == "grad_op"

    @property
    def shard_numel(self) -> int:
        """How many of the Ψ trainable elements this rank holds (about Ψ/N)."""
        return self.layout.shard_numel

    def set_batch_share(self, local_examples: int, global_examples: int) -> None:
        """This rank averages over local_examples of global_examples: weight n_r / B."""
        self.shards.grads.share = local_examples / global_examples

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation, for all micro-batches but the last (the next backward
        outside syncs). "grad_op": whole gradients add up on the parameters and go in one
        reduce-scatter; "full": each micro-batch is reduce-scattered and added to the shard,
        never a whole model's gradients (grads.py)."""
        self._accumulating = True
        try:
            with self.shards.grads.no_sync():
                yield
        finally:
            self._accumulating = False

    def finish_gradient_sync(self) -> None:
        """After backward: reduce-scatter what is left, wait; then each shard's .grad is the
        global batch's gradient of its elements, or None where no rank's backward reached
        its parameter since the last sync. Nothing happens inside no_sync()."""
        if self._accumulating:
            return
        grads = self.shards.grads
        grads.finish()
        if self.group.size > 1:  # reached anywhere?
            comm.allreduce(grads.reached, op="max", group=self.group, out=grads.reached)
        for piece, grad, k in zip(self._pieces, self._grads, self._param_index):
            piece.grad = grad if grads.reached[k] else None
        grads.reached[:] = 0
        self._stale = self.sharding == "grad_op"

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the shards' gradients by the whole model's norm (each rank's squares, summed
        over the group: PyTorch FSDP's clip_grad_norm_); returns the norm before clipping."""
        return clip_global_norm(self._pieces, max_norm, shard_group=self.group)

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Collective: {name: whole array} for every parameter, frozen ones too, under each of
        a tied weight's names (as model.state_dict()), on every rank (PyTorch's
        FULL_STATE_DICT with rank0_only=False): each unit allgathered from the shards into
        new arrays, which a plain copy of the model loads (load_state_dict)."""
        whole = gather_whole(self.layout, self.shards.param_chunks, self.comm_group, self.algo)
        named = self.model.named_parameters(remove_duplicate=False)
        return {name: whole[id(p)] if id(p) in whole else np.array(p.data) for name, p in named}

    def close(self) -> None:
        """Unhook and unwrap the model, free the communicator. Under "full" the model keeps
        its stand-ins, and under "grad_op" whole parameters stale but for this rank's chunk
        after a step: take full_state_dict() first to keep the trained weights."""
        self.shards.close()
