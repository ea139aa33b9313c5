"""`ZeroRedundancyOptimizer`: ZeRO stage 1 (P_os, the optimizer state sharded) as a piece
wrapped around the user's own optimizer class, as PyTorch's
`torch.distributed.optim.ZeroRedundancyOptimizer` (Rajbhandari et al., "ZeRO", SC 2020;
Ψ, K and N_d as in stages.py's table).

    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optim.AdamW, lr=1e-3, weight_decay=0.1)
    loss.backward(); ddp.finish_gradient_sync(); opt.step()

or without DDP, once every rank holds the same whole gradients (averaged by the user).

Who owns what. The Ψ trainable parameters (requires_grad; each Parameter once, in the order
given) are laid end to end in one flat vector, and every `p.data` becomes a view of it
(flat.flat_parameters). The vector is cut into N chunks by chunk_bounds, as
`allgather` cuts it; rank r owns chunk r, Ψ/N elements to within one, its edges wherever
they fall, inside a tensor or not:

    params    | W0 (10)                 | b0 (2) | W1 (6)           | b1 (2) |   Ψ = 20
    N = 3     | 0 1 2 3 4 5 6 | 7 8 9     10 11    12 13 | 14 15 16 17  18 19 |
    rank        r0            | r1                       | r2                 |
    pieces      W0[0:7]         W0[7:10], b0, W1[0:2]      W1[2:6], b1

Rank r steps `optimizer_class(pieces, **defaults)`: one *piece* per parameter its chunk
touches, a Tensor whose .data views that parameter's elements in the chunk and whose .grad,
at each step, views the same elements of `p.grad` (None when p.grad is None: an unused
parameter is skipped, as by any minidp optimizer). minidp's optimizers are elementwise, so
stepping the pieces is stepping those elements of the whole model, bit for bit; only the
chunk has state (AdamW's m and v, SGD's velocity): KΨ/N bytes where a plain optimizer
holds KΨ.

One step, over `group`:
    1. every rank holds the whole gradient, the same on every rank: nothing is sent for it
       here (DDP has allreduced it, or the user has)
    2. rank r steps its pieces: chunk r of the parameters is updated, the rest is stale
    3. allgather(flat[chunk r], out=flat): every chunk to every rank, straight into the
       parameters (views of flat): every replica the same, to the bit

Bytes sent per rank per step, ring algorithms, b bytes a number: the allgather's
(N-1)/N·Ψ·b; after DDP's allreduce, 2(N-1)/N·Ψ·b, that is 1.5x plain DP, as PyTorch's piece
after DDP. (`--strategy zero --zero-stage 1` pays DP's bytes: a DDP comm hook
reduce-scatters each bucket instead of allreducing it, stages.py.)
"""

import json

import numpy as np

from minidp import comm
from minidp.engine import optim
from minidp.engine.tensor import Tensor
from minidp.parallel.zero.flat import (
    ShardLayout,
    allgather_flat,
    flat_parameters,
    pieces,
    slices_in,
)


class ZeroRedundancyOptimizer:
    """`optimizer_class(my pieces, **defaults)` on each rank of `group` (default: the world),
    then an allgather of the updated parameters.

    `params`: Tensors over NumPy arrays of one dtype (a model's parameters()); those with
    requires_grad False are left out (frozen: never stepped, never sent), a repeated one is
    taken once. Every rank passes the same parameters in the same order, with the same
    values (DDP broadcasts rank 0's; alone, build them from one seed). `optimizer_class`: a
    minidp.optim.Optimizer subclass (SGD, Adam, AdamW: elementwise, so a chunk steps as the
    whole would). Collective: the constructor and `step()` are called on every rank.

    `lr` reads and sets the learning rate (a schedule sets it before each step);
    `state_dict()` is this rank's shard of the optimizer state (see there)."""

    def __init__(self, params, optimizer_class, group: comm.Group | None = None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, optim.Optimizer)):
            raise TypeError(
                "optimizer_class must be a minidp.optim.Optimizer subclass (SGD, Adam, AdamW), "
                f"got {optimizer_class!r}"
            )
        self.params = trainable(params)
        self.group = group = group or comm.world()
        dtype = self.params[0].dtype
        check_same_params(self.params, group)
        names = {id(p): f"params[{i}]" for i, p in enumerate(self.params)}
        self.layout = ShardLayout([self.params], names, group.size, group.rank)  # 1 segment
        self.flat = flat_parameters(self.layout, dtype)  # every p.data now a view of it
        self._views = [p.data for p in self.params]
        self.chunk = self.layout.ranges()[0]  # [lo, hi) of flat: mine
        # a rank whose chunk is empty (Ψ < N) gets one empty slice, so that its optimizer
        # still exists (and holds lr)
        self._slices = slices_in(self.params, *self.chunk) or [(0, 0, 0)]
        data = [self.params[i].data.reshape(-1)[lo:hi] for i, lo, hi in self._slices]  # views
        self.pieces = pieces(data, [None] * len(data))
        self.optimizer = optimizer_class(self.pieces, **defaults)

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.lr = value

    @property
    def shard_numel(self) -> int:
        """How many of the Ψ elements this rank steps (and holds optimizer state for)."""
        lo, hi = self.chunk
        return hi - lo

    def zero_grad(self) -> None:
        """Every managed parameter's .grad to None (the whole gradients, not only mine)."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """Step my chunk with the parameters' current gradients, then allgather every chunk."""
        for p, view in zip(self.params, self._views):
            if p.data is not view:
                raise RuntimeError(
                    "a parameter's .data was replaced after ZeroRedundancyOptimizer was built "
                    "(the optimizer updates the views it made); change values in place instead"
                )
        for piece, (i, lo, hi) in zip(self.pieces, self._slices):
            grad = self.params[i].grad
            piece.grad = None if grad is None else grad.reshape(-1)[lo:hi]
        self.optimizer.step()
        self._consolidated = None  # a consolidated state is of the step it was taken at
        for piece in self.pieces:
            piece.grad = None  # hold no view of the user's gradients between steps
        allgather_flat(self.flat, self.layout, self.group, "auto")

    def piece_places(self) -> list[tuple]:
        """(parameter, lo, hi) of each piece the inner optimizer steps: elements [lo, hi) of
        the flattened parameter (what checkpoint.get_state_dict saves and reshards)."""
        return [(self.params[i], lo, hi) for i, lo, hi in self._slices]

    # ---- resuming -------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: gather every rank's shard of the optimizer state onto rank `to`,
        whose state_dict() then returns the whole of it (PyTorch's: call it on every rank,
        then save rank `to`'s state_dict())."""
        self.optimizer.init_state()
        mine = comm.gather_text(json.dumps(_state_json(self)), root=to, group=self.group)
        self._consolidated = None
        if self.group.rank == to:
            self._consolidated = _whole_state(self, [json.loads(t) for t in mine])

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state, and the cut it belongs to (Ψ, N, r);
        after consolidate_state_dict(to), on rank `to`, the whole state instead (keyed by
        parameter index, every array whole). The parameters are not in it: the model's
        state_dict() holds them, whole on every rank. (checkpoint.get_state_dict gives a
        state dict that reshards over any number of ranks.)"""
        consolidated = getattr(self, "_consolidated", None)
        if consolidated is not None:
            return consolidated
        return {
            "numel": self.layout.numel,
            "size": self.group.size,
            "rank": self.group.rank,
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take back what this rank's state_dict() gave (local: no message), or a
        consolidated whole state: this rank keeps its chunk of it."""
        self._consolidated = None
        if "whole" in state:
            self._load_whole(state)
            return
        saved = (state["numel"], state["size"], state["rank"])
        here = (self.layout.numel, self.group.size, self.group.rank)
        if saved != here:
            raise ValueError(
                f"state is the shard of rank {saved[2]} of {saved[1]} over Ψ = {saved[0]} "
                f"elements; this is rank {here[2]} of {here[1]} over Ψ = {here[0]}"
            )
        self.optimizer.load_state_dict(state["optimizer"])

    def _load_whole(self, state: dict) -> None:
        """This rank's chunk of a consolidated state (every parameter's arrays whole)."""
        inner = self.optimizer
        inner.init_state()
        for (i, lo, hi), mine in zip(self._slices, inner.state):
            saved = state["whole"].get(i, state["whole"].get(str(i)))
            if saved is None and hi > lo:
                raise ValueError(f"the consolidated state has no parameter {i}")
            for key, value in saved.items() if hi > lo else ():
                value = np.asarray(value)
                scalar = np.ndim(mine.get(key, value)) == 0  # a step count (not a 0-d param)
                mine[key] = value.copy() if scalar else value.reshape(-1)[lo:hi].copy()
        inner.lr, inner.hyper = state["lr"], dict(state["hyper"])
        inner.step_count = state["step_count"]


def trainable(params) -> list[Tensor]:
    """The parameters to shard: requires_grad ones, each once, in the order given."""
    params = list(params)
    if not params:
        raise ValueError("params is empty: ZeroRedundancyOptimizer needs parameters to step")
    out, seen = [], set()
    for i, p in enumerate(params):
        if not isinstance(p, Tensor) or not isinstance(p.data, np.ndarray):
            raise TypeError(f"params[{i}] must be a Tensor over a NumPy array, got {p!r}")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    if not out:
        raise ValueError(f"params has {len(params)} tensors and none requires grad (all frozen)")
    dtypes = sorted({str(p.dtype) for p in out})
    if len(dtypes) > 1:
        raise TypeError(f"params must share one dtype (one flat vector), got {', '.join(dtypes)}")
    return out


def check_same_params(params: list[Tensor], group: comm.Group) -> None:
    """ValueError on every rank unless every rank passed as many parameters, as many elements."""
    mine = np.array([len(params), sum(p.size for p in params)], dtype=np.int64)
    every = comm.allgather(mine, group=group).reshape(group.size, 2)
    if not (every == every[0]).all():
        counts = ", ".join(f"rank {r}: {n} tensors, {e} elements" for r, (n, e) in enumerate(every))
        raise ValueError(f"params differ across the ranks of group ({counts})")


def _state_json(zero: "ZeroRedundancyOptimizer") -> list:
    """This rank's per-piece state as JSON-able lists: [(param index, lo, hi, {key: list})]."""
    out = []
    for (i, lo, hi), state in zip(zero._slices, zero.optimizer.state):
        if hi > lo:
            out.append([i, lo, hi, {k: np.asarray(v).tolist() for k, v in state.items()}])
    return out


def _whole_state(zero: "ZeroRedundancyOptimizer", every: list) -> dict:
    """Every rank's pieces (from _state_json) put together into whole arrays per parameter."""
    whole: dict[int, dict] = {}
    for pieces_of_rank in every:
        for i, lo, hi, state in pieces_of_rank:
            p = zero.params[i]
            entry = whole.setdefault(i, {})
            for key, value in state.items():
                value = np.asarray(value, dtype=np.int64 if key == "step" else p.dtype)
                if value.ndim == 0:
                    entry[key] = value
                else:
                    flat = entry.setdefault(key, np.zeros(p.size, p.dtype))
                    flat[lo:hi] = value
    inner = zero.optimizer
    return {
        "whole": {
            i: {k: v.reshape(zero.params[i].shape) if v.ndim else v for k, v in s.items()}
            for i, s in sorted(whole.items())
        },
        "lr": inner.lr,
        "hyper": dict(inner.hyper),
        "step_count": inner.step_count,
    }
