"""Quantization: every value sent, each in a few bits.

    sign      (Bernstein et al. 2018, signSGD; Karimireddy et al. 2019, EF-SignSGD)
              C(Δ) = (||Δ||₁ / n)·sign(Δ): one bit per value, packed eight to a byte with
              np.packbits, and one scale per bucket (the mean magnitude, so C(Δ) has Δ's
              L1 norm). `sign` keeps error feedback; `sign-noef` is the same compressor
              without it, whose bias Karimireddy et al. show can stop convergence.
              Bytes per rank, allgathered: (p-1)·(n/8 + itemsize); ratio ≈ 64/p at float32.

    qsgd:S    (Alistarh et al. 2017, "QSGD")
              with u_i = S·|Δ_i| / ||Δ||₂ in [0, S] and l = floor(u_i):
                  ξ_i = (l + 1)/S with probability u_i - l, else l/S
                  C(Δ)_i = ||Δ||₂ · sign(Δ_i) · ξ_i
              E[ξ_i] = u_i / S, so E[C(Δ)] = Δ: unbiased, no error feedback needed. Each
              value is one of 2S + 1 levels, b = bit_length(2S) bits (S = 4: 9 levels, 4
              bits); the paper's Elias coding of the levels would send fewer.
              Bytes per rank, allgathered: (p-1)·(n·b/8 + itemsize); ratio ≈ 64/(b·p).

Every rank's bits go to every other (base.gather_sum): a sum of signs or of levels
is not a sign or a level, so no allreduce can add them on the way.
"""

import numpy as np

from minidp.parallel.compression.base import Compressor, gather_sum, invalid, is_integer


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes (each < 2**bits <= 256) into ceil(n·bits/8) bytes, each code's
    bits most significant first."""
    as_bits = np.unpackbits(codes.astype(np.uint8)[:, None], axis=1)[:, 8 - bits :]
    return np.packbits(as_bits)


def unpack_codes(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The n codes pack_codes(codes, bits) packed, as uint8."""
    as_bits = np.unpackbits(packed, count=n * bits).reshape(n, bits)
    return np.packbits(np.pad(as_bits, ((0, 0), (8 - bits, 0))), axis=1).ravel()


def signs(packed: np.ndarray, n: int, dtype) -> np.ndarray:
    """±1 from packed sign bits (bit 1: Δ >= 0)."""
    return np.unpackbits(packed, count=n).astype(dtype) * 2 - 1


class Sign(Compressor):
    """Scaled sign, one bit per value, with error feedback; `SignNoEF` without."""

    name = "sign"
    error_feedback = True

    def exchange(self, delta, out, key, group, shapes) -> np.ndarray:
        n = delta.size
        scale = np.array([np.abs(delta).sum() / max(n, 1)], delta.dtype)
        packed = np.packbits(delta >= 0)

        def decode(bits, s):
            return s[0] * signs(bits, n, delta.dtype)

        gather_sum([packed, scale], decode, out, group)
        return decode(packed, scale)


class SignNoEF(Sign):
    name = "sign-noef"
    error_feedback = False


class QSGD(Compressor):
    """Stochastic quantization to S levels per sign, unbiased (see the docstring)."""

    name = "qsgd"
    param = "levels"

    def __init__(self, *, levels: int = 4, algo="auto", seed=0, warmup=0):
        if not is_integer(levels) or not 1 <= levels <= 127:  # codes 0..2S fit a byte
            raise invalid(
                self, "levels", levels, "the number of levels S must be an integer in [1, 127]"
            )
        self.levels = int(levels)
        self.bits = (2 * self.levels).bit_length()  # codes 0 .. 2S: level + S
        super().__init__(algo=algo, seed=seed, warmup=warmup)

    def quantize(self, delta: np.ndarray, rng: np.random.Generator) -> tuple:
        """(codes in 0..2S, ||Δ||₂): code - S is sign(Δ_i)·(the level drawn for Δ_i)."""
        S, norm = self.levels, float(np.sqrt(np.dot(delta, delta)))
        u = S * np.abs(delta) / norm if norm > 0 else np.zeros_like(delta)
        low = np.floor(u)
        level = low + (rng.random(delta.size) < u - low)  # up with probability u - l
        return (np.sign(delta) * level + S).astype(np.uint8), norm

    def dequantize(self, codes: np.ndarray, norm) -> np.ndarray:
        return (codes.astype(np.float64) - self.levels) * (float(norm) / self.levels)

    def exchange(self, delta, out, key, group, shapes) -> np.ndarray:
        n, dtype = delta.size, delta.dtype
        # this rank's own draw: no other rank needs to repeat it, only to decode it
        rng = np.random.default_rng([self.seed, key, self.round(key), group.rank])
        codes, norm = self.quantize(delta, rng)
        packed, scale = pack_codes(codes, self.bits), np.array([norm], dtype)

        def decode(p, s):
            return self.dequantize(unpack_codes(p, self.bits, n), s[0]).astype(dtype)

        gather_sum([packed, scale], decode, out, group)
        return decode(packed, scale)
