"""Attention one key block at a time: the online softmax, forward and backward.

A query's attention over keys split into blocks b = 1, 2, ... (s_j = q k_j / sqrt(hs)):

    y = sum_j exp(s_j) v_j / sum_j exp(s_j)

needs no block twice if three numbers per query run along (Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"; FlashAttention, Dao et al. 2022): the running max m, the
running sum l of exp(s_j - m) and the running unnormalized output a = sum_j exp(s_j - m) v_j.
A new block with scores S_b and values V_b is folded in as

    m' = max(m, max_j S_b)                  the new max
    c  = exp(m - m')                        what the old terms shrink by under the new max
    l' = c l + sum_j exp(S_b - m')
    a' = c a + exp(S_b - m') V_b

and after the last block y = a / l, with the log-sum-exp L = m + log l kept for backward.
Every exp is of a number <= 0: nothing overflows, whatever the order of the blocks.

Backward recomputes each block's probabilities from L instead of keeping them
(FlashAttention-2, Dao 2023): P_b = exp(S_b - L) exactly, since L is the log of the whole
row's sum. With dy the gradient of y and D = rowsum(dy * y):

    dV_b = P_b^T dy      dP_b = dy V_b^T      dS_b = P_b (dP_b - D)
    dq  += dS_b K_b s    dK_b = dS_b^T q s                  (s = 1 / sqrt(hs))

D = rowsum(dP P) over all blocks = dy . y: one number per query, known before any block.
Masked scores are -inf, so their P is 0 and they add nothing, forward or backward.

Shapes: q, k, v blocks (B, H, n, hs); the state holds (B, H, T) and (B, H, T, hs) for the
rank's T query rows; `rows` picks the queries of one block.
"""

import numpy as np


def scores(qs: np.ndarray, k: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """S = (q s) k^T for one block, -inf where mask (queries x keys) is True."""
    S = qs @ k.swapaxes(-1, -2)
    return S if mask is None else np.where(mask, -np.inf, S)


def future_mask(query_positions: np.ndarray, key_positions: np.ndarray) -> np.ndarray:
    """True where the key's global position comes after the query's (causal)."""
    return key_positions[None, :] > query_positions[:, None]


class OnlineSoftmax:
    """The running max m, sum l and unnormalized output a of T queries (B, H heads)."""

    def __init__(self, B: int, H: int, T: int, hs: int, dtype):
        self.m = np.full((B, H, T), -np.inf, dtype)
        self.l = np.zeros((B, H, T), dtype)
        self.a = np.zeros((B, H, T, hs), dtype)

    def add(self, rows: slice, S: np.ndarray, v: np.ndarray) -> None:
        """Fold the block with scores S (B, H, rows, keys) and values v (B, H, keys, hs)
        into the queries `rows`."""
        m = self.m[..., rows]
        m_new = np.maximum(m, S.max(axis=-1))
        shift = np.where(np.isfinite(m_new), m_new, 0.0)  # a row that has seen no key yet
        P = np.exp(S - shift[..., None])
        c = np.exp(m - shift)  # 0 for a row's first block (m = -inf)
        self.l[..., rows] = c * self.l[..., rows] + P.sum(axis=-1)
        self.a[..., rows, :] = c[..., None] * self.a[..., rows, :] + P @ v
        self.m[..., rows] = m_new

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(y = a / l, the log-sum-exp L = m + log l), for every query."""
        return self.a / self.l[..., None], self.m + np.log(self.l)


def block_backward(S, lse, dy, D, qs, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dS K, dK_b, dV_b) of one block (see the module docstring), its P recomputed from the
    log-sum-exp; dq's scale s is left to the caller. S (B, H, n, m) the block's scores;
    lse, D (B, H, n); dy, qs (B, H, n, hs); k, v (B, H, m, hs)."""
    P = np.exp(S - lse[..., None])
    dv = P.swapaxes(-1, -2) @ dy
    dS = P * (dy @ v.swapaxes(-1, -2) - D[..., None])
    return dS @ k, dS.swapaxes(-1, -2) @ qs, dv
