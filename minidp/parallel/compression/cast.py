"""Half-precision casts: fp16 and bf16 on the wire, the sum taken in full precision.

    float32   s eeeeeeee mmmmmmmmmmmmmmmmmmmmmmm     1 + 8 + 23 bits
    bf16      s eeeeeeee mmmmmmm                     1 + 8 + 7: float32's top half
    fp16      s eeeee    mmmmmmmmmm                  1 + 5 + 10: finer, but overflows past
                                                     65504 and loses gradients below 6e-8

NumPy has float16 but no bfloat16, so bf16 is done by hand on the bits: keep the top 16 of
float32's 32, rounding to nearest, ties to even (the rule IEEE 754 and every accelerator
use). With t the top 16 bits, the bottom 16 `low`, round up when low > 0x8000, or when
low == 0x8000 and t is odd; adding 0x7FFF + (t & 1) and shifting does exactly that, and a
carry out of the mantissa bumps the exponent, as it should (the largest finite values round
up to infinity). NaNs are kept NaN (quiet, sign kept), which the carry would not promise.
float64 gradients are cast to float32 first, so a tie may round twice.

The exchange, one 16-bit message each way, as a reduce-scatter then an allgather:

    alltoall   rank w sends chunk j of its encoded Δ_w to rank j         (p-1)/p·n·2 bytes
    rank j     decodes the p pieces of its chunk, adds them in rank order in the
               gradient's dtype, rounds the sum to 16 bits once
    allgather  every rank gets every rounded chunk                       (p-1)/p·n·2 bytes

2(p-1)/p·n·2 bytes in all: half of the float32 allreduce's, at any p. No error feedback:
the rounding error is ~2^-8 (bf16) or 2^-11 (fp16) of each value, not a bias to repay.
"""

import numpy as np

from minidp import comm
from minidp.parallel.compression.base import Compressor


def to_bf16(x: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns (uint16) of x, rounded to nearest, ties to even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    top = bits >> 16
    rounded = ((bits + (0x7FFF + (top & 1))) >> 16).astype(np.uint16)  # NaN may wrap: below
    quiet_nan = (top | 0x0040).astype(np.uint16)  # keep sign and payload, set the quiet bit
    return np.where(np.isnan(x), quiet_nan, rounded)


def from_bf16(u: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bit patterns (exact: bf16 is float32 with 16 zero bits)."""
    return (u.astype(np.uint32) << 16).view(np.float32)


def to_fp16(x: np.ndarray) -> np.ndarray:
    """fp16 bit patterns (NumPy rounds to nearest even; past 65504 is infinity)."""
    with np.errstate(over="ignore"):
        return x.astype(np.float16).view(np.uint16)


def from_fp16(u: np.ndarray) -> np.ndarray:
    return u.view(np.float16).astype(np.float32)


class Cast(Compressor):
    """Send 16-bit values both ways; add them in the gradient's dtype (see the docstring)."""

    encode = staticmethod(to_bf16)
    decode = staticmethod(from_bf16)

    def exchange(self, delta, out, key, group, shapes) -> np.ndarray:
        p, n = group.size, delta.size
        width = -(-n // p)  # ceil: every rank's chunk padded to the same width
        rows = np.zeros((p, width), np.uint16)
        rows.reshape(-1)[:n] = self.encode(delta)
        pieces = comm.alltoall(rows, group=group)  # row r: rank r's piece of my chunk
        total = np.zeros(width, delta.dtype)
        for r in range(p):  # rank order: the same bits wherever this chunk is summed
            total += self.decode(pieces[r])
        gathered = comm.allgather(self.encode(total), group=group)  # (p, width)
        out[...] = self.decode(gathered.reshape(-1)[:n])
        return self.decode(rows.reshape(-1)[:n]).astype(delta.dtype)


class BF16(Cast):
    name = "bf16"


class FP16(Cast):
    name = "fp16"
    encode = staticmethod(to_fp16)
    decode = staticmethod(from_fp16)
