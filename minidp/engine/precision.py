"""The 16-bit dtypes of mixed precision, and a model's weights put in them (no MPI here: the
loss scaler, which ranks agree on, is parallel/amp.py's, whose docstring tells the whole
story)."""

import sys

import numpy as np

from minidp.engine.deferred import astype

PRECISIONS = ("fp32", "bf16", "fp16")


def half_dtype(precision: str):
    """The NumPy dtype of `precision`'s weights: bfloat16 (ml_dtypes), float16, or None
    for fp32. A clear error when ml_dtypes is missing."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp16":
        return np.dtype(np.float16)
    if precision == "bf16":
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError("bf16 needs ml_dtypes: pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    return None


def to_half(model, precision: str):
    """Every floating-point parameter of `model` (frozen ones too) in `precision`'s 16 bits,
    in place (PyTorch's model.to(torch.bfloat16)); fp32: unchanged. Returns the model.
    Do it before wrapping the model in DDP or ZeRO: they size their buffers from it. A
    deferred parameter (deferred_init) gets the cast in its recipe."""
    dtype = half_dtype(precision)
    if dtype is not None:
        for p in model.parameters():
            if np.issubdtype(p.data.dtype, np.floating):
                astype(p, dtype)
    return model


def is_bfloat16(dtype) -> bool:
    """Whether `dtype` is ml_dtypes' bfloat16, without importing ml_dtypes (slow to import:
    an array of that dtype exists only once something has imported it)."""
    ml_dtypes = sys.modules.get("ml_dtypes")
    return ml_dtypes is not None and dtype == ml_dtypes.bfloat16


def dtype_name(dtype: np.dtype) -> str:
    """What named_dtype reads back: dtype.str ("<f4"), or "bfloat16" (whose .str, "<V2",
    NumPy would read as two raw bytes)."""
    return dtype.name if is_bfloat16(dtype) else dtype.str


def named_dtype(name: str) -> np.dtype:
    """np.dtype(name), "bfloat16" too (ml_dtypes imported for it)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
