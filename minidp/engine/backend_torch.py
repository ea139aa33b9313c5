"""NumPy's names over torch tensors: the namespace `backend.namespace(t)` returns for torch.

Only the functions minidp's engine, layers and optimizers call, each with NumPy's
signature and meaning (axis, keepdims, cut indices for split), on the tensor's own device.
New arrays (zeros, arange, a NumPy mask or index) go to the device `backend.use()` chose.
No graph is recorded: torch's autograd is off on this path (backend.py says why).

bfloat16 crosses between the libraries as its 16-bit words: NumPy has no bfloat16 of its
own, and `torch.from_numpy` / `.numpy()` refuse ml_dtypes' (the NumPy path's bfloat16), so
`host_view` and `from_host` reinterpret the same memory as int16 on one side and bfloat16
on the other: no copy, no widening, the bits as they are.
"""

import numpy as np
import torch

from minidp.engine import backend
from minidp.engine.precision import is_bfloat16, named_dtype

_DTYPES = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.bool_): torch.bool,
}


def torch_dtype(dtype):
    """A torch dtype for a NumPy dtype, ml_dtypes' bfloat16 too (or a torch dtype, returned
    as it is)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if is_bfloat16(dtype):
        return torch.bfloat16
    return _DTYPES[np.dtype(dtype)]


def host_view(t) -> np.ndarray:
    """A NumPy array over a CPU tensor's own memory (a bfloat16 one as ml_dtypes.bfloat16,
    the same 16-bit words): what MPI is handed. No copy."""
    t = t.detach()
    if t.dtype != torch.bfloat16:
        return t.numpy()
    import ml_dtypes

    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def from_host(a: np.ndarray):
    """A CPU tensor over a NumPy array's own memory (ml_dtypes' bfloat16 as torch.bfloat16,
    the same 16-bit words): host_view's inverse. No copy."""
    if is_bfloat16(a.dtype):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def asarray(a, dtype=None):
    """A tensor on the backend's device (no copy when `a` is one already, of that dtype)."""
    if isinstance(a, torch.Tensor):
        return a.to(dtype=torch_dtype(dtype) or a.dtype)
    if isinstance(a, int | float) and dtype is None:
        return torch.tensor(a, dtype=torch.get_default_dtype(), device=backend.device())
    host = from_host(np.ascontiguousarray(np.asarray(a)))
    return host.to(device=backend.device(), dtype=torch_dtype(dtype) or host.dtype)


def array(a, dtype=None):
    """A private copy (np.array's copy=True)."""
    return asarray(a, dtype).clone()


def _on(a, like):
    """`a` (a tensor, NumPy array or number) as a tensor beside `like`."""
    if isinstance(a, torch.Tensor):
        return a
    return from_host(np.ascontiguousarray(a).reshape(np.shape(a))).to(like.device)  # 0-d: 0-d


exp, log, sqrt, tanh, isfinite = torch.exp, torch.log, torch.sqrt, torch.tanh, torch.isfinite
zeros_like, ones_like, broadcast_to = torch.zeros_like, torch.ones_like, torch.broadcast_to


def maximum(a, b):
    return torch.clamp_min(a, b) if isinstance(b, int | float) else torch.maximum(a, b)


def where(condition, a, b):
    like = next(x for x in (a, b, condition) if isinstance(x, torch.Tensor))
    a = a if isinstance(a, torch.Tensor) else _on(np.asarray(a, like_dtype(like)), like)
    b = b if isinstance(b, torch.Tensor) else _on(np.asarray(b, like_dtype(like)), like)
    return torch.where(_on(condition, like), a, b)


def like_dtype(t) -> np.dtype:
    """The NumPy dtype of a tensor's dtype (torch.bfloat16: ml_dtypes')."""
    return named_dtype(str(t.dtype).removeprefix("torch."))


def zeros(shape, dtype=None):
    return torch.zeros(shape, dtype=torch_dtype(dtype), device=backend.device())


def arange(n):
    return torch.arange(n, device=backend.device())


def expand_dims(a, axis):
    for ax in sorted(axis if isinstance(axis, tuple | list) else (axis,)):
        a = a.unsqueeze(ax if ax >= 0 else a.ndim + 1 + ax)
    return a


def max(a, axis=None, keepdims=False):  # noqa: A001  (NumPy's name)
    if axis is None:
        out = a.max()
        return out.reshape((1,) * a.ndim) if keepdims else out
    return torch.amax(a, dim=axis, keepdim=keepdims)


def transpose(a, axes):
    return a.permute(axes)


def concatenate(arrays, axis=0):
    return torch.cat(list(arrays), dim=axis)


def stack(arrays, axis=0):
    return torch.stack(list(arrays), dim=axis)


def split(a, cuts, axis=0):
    """np.split with cut indices: the pieces between consecutive cuts."""
    edges = [0, *(int(c) for c in cuts), a.shape[axis]]
    return [a.narrow(axis, lo, hi - lo) for lo, hi in zip(edges[:-1], edges[1:])]


def take(a, i, axis=0):
    return a.select(axis, i)


def vdot(a, b):
    return torch.dot(a.reshape(-1), b.reshape(-1))


def index(i):
    """A NumPy index array (or a tuple of them) as tensors on the device; the rest as is."""
    if isinstance(i, tuple):
        return tuple(index(j) for j in i)
    if isinstance(i, np.ndarray | list):
        return torch.as_tensor(np.asarray(i), device=backend.device())
    return i


class _Add:
    """np.add.at(full, index, g): repeated indices add up."""

    @staticmethod
    def at(full, idx, g):
        idx = index(idx)
        full.index_put_(idx if isinstance(idx, tuple) else (idx,), g, accumulate=True)


add = _Add()


def astype(a, dtype):
    return asarray(a).to(torch_dtype(dtype))


def scalar(value, like):
    """A Python number as a 0-d tensor beside `like`: of like's dtype when like is a float
    tensor (x * 2.0 stays float32), else torch's own promotion."""
    dtype = like.dtype if like.is_floating_point() else None
    return torch.tensor(value, dtype=dtype, device=like.device)
