"""Gradient buckets: a few flat buffers that every parameter's `.grad` is a view into.

One message per bucket instead of one per parameter pays the α (latency) term of a
collective once per bucket, and a flat buffer can be reduced in place with no packing copy.
Parameters are assigned in *reverse* order, the order backward produces their gradients,
so the first bucket is complete first and its communication can start earliest:

    params   W0 b0 W1 b1 W2 b2            (forward order)
    buckets  [b2 W2 b1] [W1 b0] [W0]      (reverse order, each up to cap_bytes)

A bucket is closed when adding the next parameter would take it past `cap_bytes`; a
parameter larger than the cap gets a bucket of its own. PyTorch DDP and Horovod's tensor
fusion bucket the same way (PyTorch's default cap is 25 MiB; minidp's models are tiny, so
data_parallel.py defaults to 0.25 MiB).
"""

from minidp.backend import namespace


class Bucket:
    """A flat gradient buffer and the parameters whose .grad are views into it.

    `pending` counts the gradients still to come in this backward (data_parallel.py counts
    it down from the grad-ready hooks); `index` is the bucket's place in launch order."""

    def __init__(self, index: int, params: list, dtype):
        self.index = index
        self.params = params
        # on the parameters' own library and device (a torch tensor with --backend torch)
        self.data = namespace(params[0].data).zeros(sum(p.size for p in params), dtype=dtype)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.data[offset : offset + p.size].reshape(p.shape))
            offset += p.size
        self.pending = len(params)

    def attach(self) -> None:
        """Point every parameter's .grad at its slot in this bucket (zero_grad's half)."""
        for p, view in zip(self.params, self.views):
            p.grad = view

    def collect(self) -> None:
        """Before the reduction: a .grad made elsewhere (after an optimizer's set-to-None
        zero_grad, or assigned by hand) is copied into its slot; no .grad at all is zeros."""
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                view[...] = 0 if p.grad is None else p.grad
                p.grad = view


def assign_buckets(params: list, cap_bytes: int) -> list[Bucket]:
    """Cut `params` (already in the order their gradients arrive) into buckets of at most
    cap_bytes each, keeping that order; every bucket has the first parameter's dtype."""
    return [Bucket(i, ps, params[0].dtype) for i, ps in enumerate(bucket_groups(params, cap_bytes))]


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
