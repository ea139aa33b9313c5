"""Reduction operators, applied in NumPy on the receiving side of each message.

MPI never reduces for us (except in the `"mpi"` comparison path): every hand-written
algorithm receives a piece into a scratch buffer and combines it with one ufunc call,
`combine(op, a, b, out=...)`, which allocates nothing. All five ops are commutative in value
but not always in bits: `max(-0.0, 0.0)` is 0.0 and `max(0.0, -0.0)` is -0.0, and the sign
of a NaN sum follows the operand order. So two partners that both compute `a ⊕ b` (recursive
doubling) put the lower rank's operand first, and end the step with identical bits.

`avg` is `sum` followed by one division by p at the end (`finish`). On integer dtypes that
division rounds toward minus infinity, as NumPy's `//` does.
"""

import numpy as np

from minidp.engine.precision import is_bfloat16
from minidp.tools.names import OPS

REDUCE_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int32, np.int64))
_REDUCIBLE = frozenset(REDUCE_DTYPES)  # for the membership test: a hash, not five compares
MOVE_KINDS = "biuf"  # dtypes that collectives without an op may carry (no objects); and
# bfloat16 (kind "V" to NumPy, a float to ml_dtypes), mixed precision's gradients, both ways

_UFUNC = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def check_op(op: str, dtype: np.dtype) -> None:
    """ValueError unless op is known and dtype is one we reduce."""
    if op not in _UFUNC:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    if dtype not in _REDUCIBLE and not is_bfloat16(dtype):
        names = ", ".join(sorted(d.name for d in REDUCE_DTYPES)) + ", bfloat16"
        raise ValueError(f"cannot reduce dtype {dtype}; supported: {names}")


def combine(op: str, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a ⊕ b, elementwise, without a temporary (out may be a or b)."""
    _UFUNC[op](a, b, out=out)


def finish(op: str, x: np.ndarray, p: int) -> None:
    """The last step of an op after the combining: `avg` divides the sum by p, in place."""
    if op != "avg" or p == 1:
        return
    if x.dtype.kind == "f" or is_bfloat16(x.dtype):
        np.divide(x, p, out=x)
    else:
        np.floor_divide(x, p, out=x)
