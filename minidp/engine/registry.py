"""Where speed tricks plug into the engine: a table of faster versions of a few ops.

The engine's code is the plain path, the one a reader meets. `minidp.fast` (fused ops,
deferred weight gradients) fills `FAST` in when minidp is imported; a layer or op looks its
entry up by name and, where the table has it (and, through `fast()`, the data are NumPy
arrays), calls it with the same arguments instead. `weight_gradient` is looked up directly:
its Product multiplies itself out where it cannot defer (torch data included). With the
table empty (inside `plain()`) every op runs as written in the engine. Each entry is tested
against the plain path: bit for bit, or within the reassociation its module states
(tests/test_fast_table.py lists them).

    name                 plain path (engine, models)            faster (minidp/fast/)
    row_sums             a.sum(axis=-1)  (cross_entropy)        fused.row_sums
    weight_gradient      x.T @ g  (nn.linear's backward)        weight_grads.weight_gradient
    layer_norm           nn.LayerNorm, composed                 fused.layer_norm
    embedding            weight[idx], its backward np.add.at    fused.embedding
    gelu                 functional.gelu                        fused.gelu
    layer_norm_linear    linear(norm(x))  (models/gpt.py)       fused.layer_norm_linear
    linear_residual      residual + linear(x)  (models/gpt.py)  fused.linear_residual
    attention            gpt.composed_attention                 fused_attention
"""

import contextlib
from collections.abc import Callable, Iterator

import numpy as np

FAST: dict[str, Callable] = {}


def fast(name: str, *tensors) -> Callable | None:
    """FAST[name] where the table has it and every tensor given holds a NumPy array (the
    fast ops are written for NumPy: on torch data the plain path runs); else None."""
    fn = FAST.get(name)
    if fn is None or not all(type(t.data) is np.ndarray for t in tensors):
        return None
    return fn


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """Inside this block the table is empty: every op of this process runs the plain path
    (the table is whole again on exit)."""
    saved = dict(FAST)
    FAST.clear()
    try:
        yield
    finally:
        FAST.clear()
        FAST.update(saved)
