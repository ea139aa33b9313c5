"""Checking a collective's local arguments, before any message is sent.

Every public collective validates what it was given on this rank alone and raises
ValueError for: something that is not a NumPy array, a non-contiguous array (the algorithms
send flat slices of it), a dtype that cannot be sent or reduced, an unknown op or algorithm,
a root outside the group, or an `out` of the wrong shape or dtype, read-only, or partly
overlapping the input. What must agree *across* ranks (shape, dtype, op, root, algorithm) is
the job of the fingerprint check (checks.py).
"""

import numpy as np

from minidp.comm.auto import choose
from minidp.comm.reduce_ops import MOVE_KINDS
from minidp.engine.precision import is_bfloat16
from minidp.tools.names import AUTO


def flat(x, name: str = "x") -> np.ndarray:
    """x as a 1-D view (no copy); ValueError unless it is a contiguous numeric ndarray."""
    if (
        isinstance(x, np.ndarray)
        and x.flags.c_contiguous
        and (x.dtype.kind in MOVE_KINDS or is_bfloat16(x.dtype))
    ):
        return x if x.ndim == 1 else x.reshape(-1)  # the common case, tested in one go
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{name} must be C-contiguous (got strides {x.strides}); "
            f"pass np.ascontiguousarray({name})"
        )
    raise ValueError(
        f"{name} has dtype {x.dtype}; collectives carry bool, int, uint, float (and bfloat16) "
        "arrays"
    )


def result(out, shape: tuple, dtype: np.dtype, name: str = "out") -> np.ndarray:
    """out checked against the expected shape and dtype, or a fresh array if out is None."""
    if out is None:
        return np.empty(shape, dtype)
    if isinstance(out, np.ndarray) and out.shape == shape and out.dtype == dtype:
        flags = out.flags
        if flags.c_contiguous and flags.writeable:
            return out  # the common case, tested in one go
        flat(out, name)  # raises if not contiguous
        raise ValueError(f"{name} is read-only")
    got = f"{out.shape} {out.dtype}" if isinstance(out, np.ndarray) else type(out).__name__
    raise ValueError(f"{name} must have shape {tuple(shape)} and dtype {dtype}, got {got}")


def writable(out: np.ndarray, name: str = "out") -> None:
    if not out.flags.writeable:
        raise ValueError(f"{name} is read-only")


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """True if a and b are the same memory (in place); ValueError if they partly overlap."""
    if a is b:
        return True
    if not np.may_share_memory(a, b):
        return False
    if a.ctypes.data == b.ctypes.data and a.nbytes == b.nbytes:
        return True
    raise ValueError(
        "out overlaps the input without being the same memory; pass out=x for "
        "in place, or a separate array"
    )


def root_in(root, size: int) -> int:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root must be a rank in [0, {size}), got {root!r}")
    return int(root)


def pick(algo: str, table: dict, collective: str, nbytes: int, p: int) -> str:
    """The algorithm to run: `algo` itself, or auto.choose() for "auto"; ValueError if unknown."""
    if algo == AUTO:
        return choose(collective, nbytes, p)
    if algo not in table:
        choices = (AUTO, *table)
        raise ValueError(
            f"unknown algo {algo!r} for {collective}; choose from {', '.join(choices)}"
        )
    return algo
