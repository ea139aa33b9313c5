"""Sparsification: send k = ceil(density·n) of a bucket's n values, keep the rest for later.

    top-k     (Aji & Heafield 2017; Lin et al. 2018, "Deep Gradient Compression")
              rank w sends the k entries of Δ_w of largest magnitude, as (index, value)
              pairs. Ranks choose different indices, so the pairs cannot be allreduced:
              they are allgathered and every rank adds up the p sparse vectors, in rank
              order. Ties in magnitude go to the lower index, so the choice depends on the
              values alone (np.argpartition promises no order among equal values).
              Bytes per rank: (p-1)·k·(4 + itemsize) — an int32 index and a value each.
              Against the allreduce's 2(p-1)/p·n·itemsize, the ratio is n/(p·k) at float32:
              1000x less data per rank at density 0.001 becomes 500x at p = 2, 250x at 4.

    random-k  (Stich et al. 2018, "Sparsified SGD with Memory")
              every rank draws the same k indices from a seed shared per step and bucket,
              so the k values *can* be allreduced: 2(p-1)/p·k·itemsize bytes, the ratio
              1/density at any p. But a random k carries far less of the gradient's mass
              than the top k: error feedback has much more to carry over.

Both keep error feedback (base.py): the unsent entries stay in the residual, the
sent ones leave it exactly zero, so C(Δ) + e is Δ bit for bit.
"""

import math

import numpy as np

from minidp import comm
from minidp.parallel.compression.base import Compressor, gather_sum, invalid


def kept(n: int, density: float) -> int:
    """k: how many of n values a density keeps (at least one of a non-empty bucket)."""
    return min(n, max(1, math.ceil(density * n))) if n else 0


def top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k largest |x|, ascending; ties go to the lower index (NaN counts
    as the largest, so a diverging gradient is sent, not hidden)."""
    n = x.size
    if k >= n:
        return np.arange(n)
    magnitude = np.nan_to_num(np.abs(x), nan=np.inf)
    threshold = np.partition(magnitude, n - k)[n - k]  # the k-th largest magnitude
    above = np.flatnonzero(magnitude > threshold)
    ties = np.flatnonzero(magnitude == threshold)[: k - above.size]  # the lowest indices
    return np.sort(np.concatenate([above, ties]))


def sparse(indices: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """The dense vector of n values with `values` at `indices`, zeros elsewhere."""
    dense = np.zeros(n, values.dtype)
    dense[indices] = values
    return dense


class Sparsifier(Compressor):
    """What top-k and random-k share: `density`, the fraction of each bucket sent."""

    param = "density"
    error_feedback = True

    def __init__(self, *, density: float = 0.01, algo="auto", seed=0, warmup=0):
        number = isinstance(density, (int, float, np.floating, np.integer))
        if not number or isinstance(density, (bool, np.bool_)) or not 0 < density <= 1:
            raise invalid(self, "density", density, "the density must be in (0, 1]")
        self.density = float(density)
        super().__init__(algo=algo, seed=seed, warmup=warmup)


class TopK(Sparsifier):
    """Top-k by magnitude with error feedback; indices and values allgathered."""

    name = "topk"

    def exchange(self, delta, out, key, group, shapes) -> np.ndarray:
        n = delta.size
        indices = top_k_indices(delta, kept(n, self.density)).astype(np.int32)
        values, self.sent[key] = delta[indices], indices
        gather_sum([indices, values], lambda i, v: sparse(i, v, n), out, group)
        return sparse(indices, values, n)


class RandomK(Sparsifier):
    """k indices drawn from a seed shared by every rank; their values allreduced."""

    name = "randomk"

    def exchange(self, delta, out, key, group, shapes) -> np.ndarray:
        n = delta.size
        rng = np.random.default_rng([self.seed, key, self.round(key)])  # alike everywhere
        indices = self.sent[key] = np.sort(rng.choice(n, kept(n, self.density), replace=False))
        values = comm.allreduce(delta[indices], algo=self.allreduce_algo, group=group)
        out[...] = sparse(indices, values, n)
        return sparse(indices, delta[indices], n)
