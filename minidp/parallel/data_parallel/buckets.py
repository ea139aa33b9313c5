"""Gradient buckets: a few flat buffers that every parameter's `.grad` is a view into, once
DDP has weighed it in.

One message per bucket instead of one per parameter pays the α (latency) term of a
collective once per bucket, and a flat buffer can be reduced in place with no packing copy.
Parameters are assigned in *reverse* order, the order backward produces their gradients,
so the first bucket is complete first and its communication can start earliest:

    params   W0 b0 W1 b1 W2 b2            (forward order)
    buckets  [b2 W2 b1] [W1 b0] [W0]      (reverse order, each up to cap_bytes)

A bucket is closed when adding the next parameter would take it past `cap_bytes`; a
parameter larger than the cap gets a bucket of its own. PyTorch DDP and Horovod's tensor
fusion bucket the same way (PyTorch's default cap is 25 MiB; minidp's models are tiny, so
ddp.py defaults to 0.25 MiB).
"""

import numpy as np

from minidp.engine.backend import namespace


class Bucket:
    """A flat gradient buffer and the parameters whose .grad are views into it.

    `pending` counts the gradients still to come in this backward (ddp.py counts
    it down from the grad-ready hooks), `weighed` marks the slots already weighed into the
    bucket (`weigh`), both until `rearm`; `index` is the bucket's place in launch order."""

    def __init__(self, index: int, params: list, dtype, zeros=None):
        self.index = index
        self.params = params
        # on the parameters' own library and device (a torch tensor with --backend torch),
        # or where `zeros(count, dtype)` puts it (shm_arena.py: shared memory)
        zeros = zeros or namespace(params[0].data).zeros
        self.data = zeros(sum(p.size for p in params), dtype=dtype)
        self.views, self.offsets = [], []
        offset = 0
        for p in params:
            self.views.append(self.data[offset : offset + p.size].reshape(p.shape))
            self.offsets.append(offset)
            offset += p.size
        self.rearm()

    def attach(self) -> None:
        """Point every parameter's .grad at its slot in this bucket."""
        for p, view in zip(self.params, self.views):
            p.grad = view

    def move_to_private_memory(self) -> None:
        """Move the buffer into private memory, values kept and every .grad still its view,
        so that the memory it lay in can be reused (shm_arena.release: DDP.close hands its
        shared memory back)."""
        grads = [p.grad for p in self.params]  # first: reading multiplies deferred rows in
        data = self.data.copy()
        views = [data[o : o + p.size].reshape(p.shape) for o, p in zip(self.offsets, self.params)]
        for p, grad, old, new in zip(self.params, grads, self.views, views):
            if grad is old:
                p.grad = new
        self.data, self.views = data, views

    def weigh(self, i: int, scale: float) -> bool:
        """Slot i = scale * parameter i's gradient, in one pass; once per backward.

        DDP weighs each gradient by n_r / B (its share of the global mean) the moment backward
        has finished it, while it is still in cache, so the bucket is never read again just
        to be scaled or copied. A .grad made elsewhere (after an optimizer's set-to-None
        zero_grad, or assigned by hand) is multiplied into its slot on the way; no .grad at
        all is zeros. The bits are those of copying first and scaling after: one rounding.
        Returns whether the parameter came with a gradient of its own (not None, not its
        slot): one assigned by hand counts as reached, as one from backward does."""
        p, view = self.params[i], self.views[i]
        grad = p.grad  # one read (it multiplies in any rows a deferred weight kept)
        factor = self.data.dtype.type(scale) if isinstance(self.data, np.ndarray) else scale
        if grad is None:
            view[...] = 0
        elif grad is view:
            if scale != 1.0:
                view *= factor
        elif isinstance(view, np.ndarray) and grad.dtype == view.dtype:
            np.multiply(grad, factor, out=view)
        else:  # a torch tensor (--backend torch), or another dtype: copy, then scale
            view[...] = grad
            view *= factor
        p.grad = view
        self.weighed[i] = True
        return grad is not None and grad is not view

    def collect(self, scale: float = 1.0) -> list:
        """Before the reduction: weigh every slot not weighed yet (all of them when DDP hooks
        no gradient), and return the parameters among them that came with a gradient of
        their own (assigned by hand). Every slot stays marked weighed until `rearm`, after
        the reduction: a gradient that arrives in between is a second backward (DDP refuses
        it)."""
        return [
            self.params[i]
            for i, done in enumerate(self.weighed)
            if not done and self.weigh(i, scale)
        ]

    def rearm(self) -> None:
        """A new backward: every gradient still to come, none weighed."""
        self.pending = len(self.params)
        self.weighed = [False] * len(self.params)


def assign_buckets(params: list, cap_bytes: int, zeros=None) -> list[Bucket]:
    """Cut `params` (already in the order their gradients arrive) into buckets of at most
    cap_bytes each, keeping that order; every bucket has the first parameter's dtype, and its
    buffer comes from `zeros(count, dtype)` (default: the parameters' own library)."""
    groups = bucket_groups(params, cap_bytes)
    return [Bucket(i, ps, params[0].dtype, zeros) for i, ps in enumerate(groups)]


def bucket_groups(params: list, cap_bytes: int) -> list[list]:
    """The parameters of each bucket assign_buckets would make, without their buffers (ZeRO
    cuts its flat vector the same way, and keeps no whole-gradient buffer at stage 2)."""
    if not params:
        return []
    groups: list[list] = [[]]
    filled = 0
    for p in params:
        if groups[-1] and filled + p.data.nbytes > cap_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(p)
        filled += p.data.nbytes
    return groups
