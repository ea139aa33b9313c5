"""Which array library holds the data: NumPy (the default) or torch tensors (`--backend torch`).

    xp = namespace(x.data)      # numpy itself, or the torch shim below (backend_torch.py)
    out = xp.exp(x.data)        # the same NumPy name on either library
    host = to_numpy(t)          # a NumPy array (on the host) of any array
    dev = to_backend(host)      # a host array moved to the backend use() chose

Why a small explicit shim and not `array-api-compat`: (1) it is not installed here and minidp
adds no dependency for an optional path; (2) the Array API renames NumPy's functions
(`concat`, `permute_dims`, no `add.at`, `max` without `keepdims` methods), so writing against
it would change every NumPy call of the engine, the one path whose float bits and speed must
not move; (3) the subset minidp uses is about twenty functions. So the engine keeps its NumPy
calls; an op resolves `xp = namespace(data)` once (one `type(...) is` test, little against
the microseconds of any NumPy call: docs/torch.md) and calls `xp.<numpy name>`. For NumPy
data `xp` *is* the numpy module: the same calls as before, so the same bits. For torch data,
`xp` is the module backend_torch, which gives torch those NumPy names. Array methods that
torch shares with NumPy (`+`, `@`, `.sum(axis=, keepdims=)`, `.reshape`, `.swapaxes`,
indexing) are left as they are. Torch is only an array library here: its autograd stays off
(`requires_grad` is never set on these tensors, so torch records no graph).
"""

import sys

import numpy as np

BACKENDS = ("numpy", "torch")
DEVICES = ("cpu", "cuda")

_state = {"name": "numpy", "device": "cpu"}


class BackendUnavailable(RuntimeError):
    """--backend torch without torch, or --device cuda without a CUDA device: one line."""


def namespace(a):
    """numpy for NumPy arrays and scalars; the torch shim (backend_torch) for torch tensors."""
    if type(a) is np.ndarray or isinstance(a, np.ndarray | np.generic):
        return np
    from minidp.engine import backend_torch

    return backend_torch


def is_torch(a) -> bool:
    """Whether `a` is a torch tensor (False without even importing torch, when it is not)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor)


def is_half(a) -> bool:
    """Whether `a` holds 16-bit floats (float16, or bfloat16 from ml_dtypes or torch): how
    mixed precision stores weights and gradients (parallel/amp.py)."""
    return str(getattr(a, "dtype", "")).removeprefix("torch.") in ("float16", "bfloat16")


def widened(a):
    """A float32 copy of `a`, in a's own library: where mixed precision computes and steps."""
    return namespace(a).astype(a, np.float32)


def is_torch_dtype(dtype) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(dtype, torch.dtype)


def backend_torch():
    """The torch shim module (imports torch: call it only on the torch path)."""
    from minidp.engine import backend_torch

    return backend_torch


def check(name: str, device: str = "cpu") -> None:
    """Raise BackendUnavailable (one line) unless `name` on `device` can run here."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"--backend {name!r}: choose from {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise BackendUnavailable(f"--device {device!r}: choose from {', '.join(DEVICES)}")
    if name == "numpy":
        if device != "cpu":
            raise BackendUnavailable("--device cuda needs --backend torch (NumPy runs on the CPU)")
        return
    try:
        import torch
    except ImportError:
        raise BackendUnavailable(
            "--backend torch: torch is not installed; a CPU build: pip install torch "
            "--index-url https://download.pytorch.org/whl/cpu"
        ) from None
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable(
            f"--device cuda: no CUDA device visible to torch {torch.__version__} "
            f"(CUDA build: {torch.version.cuda or 'none, a CPU build'}); use --device cpu"
        )


def use(name: str = "numpy", device: str = "cpu", threads: int = 0) -> None:
    """Make `name` on `device` the backend that to_backend() and the torch shim create on;
    `threads` > 0 caps torch's own intra-op threads (BLAS limits do not reach them)."""
    check(name, device)
    _state["name"] = name
    if name == "torch":  # the torch device stays for torch runs built before a NumPy one
        _state["device"] = device
    if name == "torch" and threads:
        import torch

        torch.set_num_threads(threads)


def device() -> str:
    """The device the torch shim creates new tensors on (the last use("torch", device)).

    One torch device per process: a NumPy run built in between (a comparison) leaves it."""
    return _state["device"]


def to_numpy(a) -> np.ndarray:
    """A host NumPy array of `a`: NumPy data itself (no copy), a torch tensor copied off (a
    CPU one viewed; bfloat16 as ml_dtypes.bfloat16: backend_torch.host_view)."""
    if isinstance(a, np.ndarray | np.generic):
        return np.asarray(a)
    if is_torch(a):
        return backend_torch().host_view(a.cpu())
    return np.asarray(a)


def to_backend(a, name: str | None = None, dtype=None):
    """`a` (host data) as an array of backend `name` (default: what use() chose): NumPy, or
    a torch tensor on use()'s device (integer and bool arrays keep their kind, floats their
    width)."""
    if (name or _state["name"]) == "numpy":
        return np.asarray(a, dtype=dtype)
    from minidp.engine import backend_torch

    return backend_torch.asarray(a, dtype=dtype)


def dtype_name(dtype) -> str:
    """'float32' for np.float32 and torch.float32 alike."""
    return str(dtype).removeprefix("torch.")


def base_of(a):
    """The array `a` is a view of (itself when it owns its memory, or its base is no array):
    NumPy's .base, torch's ._base."""
    if isinstance(a, np.ndarray):
        return a.base if isinstance(a.base, np.ndarray) else a
    base = getattr(a, "_base", None)
    return a if base is None else base


def copy(a):
    """A private copy of `a`, on its own library and device."""
    return a.copy() if isinstance(a, np.ndarray) else a.clone()


def move_model(model) -> None:
    """Move every parameter of a minidp Module to the backend use() chose (in place)."""
    if _state["name"] == "numpy":
        return
    for _, p in model.named_parameters():
        p.data = to_backend(p.data)
        p.grad = None
