"""Mixed precision on torch tensors: the casts NumPy's promotion made for us, written out.

On NumPy, `x @ W` with float32 activations and a bfloat16 weight promotes W to float32:
the product runs in float32 and the activations stay float32 (parallel/amp.py). torch's
matmul refuses mixed dtypes ("expected m1 and m2 to have the same dtype"), so on
`--backend torch` the engine casts where torch needs it, by torch.autocast's rule: a
matrix product runs in the 16-bit dtype (what a GPU's tensor cores multiply, summing in
float32 inside the kernel); what loses digits or range in 16 bits runs in float32.

    op                               computes in        its output, so what follows reads
    Linear, Tensor @ (matmul_dtype)  the 16-bit dtype   16-bit activations (q, k, v, the MLP)
    elementwise: +, *, gelu, ...     torch's promotion  float32 + bfloat16 -> float32: the
                                                        residual stream stays float32
    Embedding lookup (computed)      float32            the table widened first: its rows'
                                                        gradient summed in float32
    LayerNorm, softmax,              float32            (in_float32) means, variances, exp
    log_softmax, cross_entropy                          and log-sum-exp want float32

Every cast is an op of its own (`Tensor.to`), whose backward casts the gradient back, and
a gradient arrives in its tensor's dtype (tensor.py's backward casts it as torch's autograd
does), so backward runs in the same dtypes as forward. On NumPy data every function here
but `computed` (the table's widening, the same on both backends) returns its input: the
NumPy path keeps its bits.
"""

import numpy as np

from minidp.engine.backend import is_half


def matmul_dtype(a, b):
    """The dtype torch multiplies arrays `a` and `b` in where they differ: the 16-bit one
    of a 16-bit and another float array (torch data only); None where nothing is cast."""
    if type(a) is np.ndarray or a.dtype == b.dtype:
        return None
    if not (a.is_floating_point() and b.is_floating_point()):
        return None
    for x in (a, b):
        if is_half(x):
            return x.dtype
    return None


def matmul_operands(a, b):
    """Tensors (a, b), the one not in matmul_dtype cast to it (a recorded op), or as given."""
    dtype = matmul_dtype(a.data, b.data)
    if dtype is None:
        return a, b
    return (a if a.dtype == dtype else a.to(dtype)), (b if b.dtype == dtype else b.to(dtype))


def in_float32(x):
    """Tensor x widened to float32 where it holds 16-bit floats on torch; else x itself."""
    if type(x.data) is np.ndarray or not is_half(x.data):
        return x
    return x.to(np.float32)


def computed(x):
    """Tensor x as the model computes: float32 when x holds 16 bits (mixed precision keeps
    weights in 16 bits; on NumPy the ops that read them with float32 activations widen them
    by NumPy's promotion, but a table's rows enter the model on their own: the table is
    widened before the lookup, so its gradient's rows are summed in float32 and cast once),
    else x. `nn.computed` names it too."""
    return x.to(np.float32) if is_half(x.data) else x
