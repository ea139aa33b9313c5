"""Routing tokens to experts: the router's top-k choice, the gates, each expert's capacity,
and the auxiliary load-balancing loss.

GShard (Lepikhin et al. 2020) and Switch Transformer (Fedus, Zoph & Shazeer 2021) replace a
transformer's MLP by E experts (E MLPs) and a router that sends each token to k of them. For
N tokens x_n the router is one Linear to E logits and a softmax:

    p[n, e] = softmax(x_n W_r)[e]              token n's probability of expert e, (N, E)
    e_1(n), ..., e_k(n)                        the k most probable experts, best first
    k = 1 (Switch):  g_1 = p[n, e_1]            not renormalized: renormalized it would be 1
                                                and the router would learn nothing
    k = 2 (GShard):  g_i = p[n, e_i] / (p[n, e_1] + p[n, e_2])
                                                (Mixtral's softmax over the two top logits is
                                                the same numbers)
    y_n = sum_i g_i(n) * expert_{e_i}(x_n)     the gates carry dL/dy back to the router

Capacity. The tokens are cut into G capacity groups of N/G consecutive tokens (GShard's
groups; under data parallelism each rank's batch slice is one group). From each group an
expert takes at most

    capacity = ceil(capacity_factor * (N / G) * k / E)

assignments (token n -> expert e), served in this order: every token's first choice, in
token order, then every second choice (a token's best expert before anyone's runner-up, as
GShard). An assignment past capacity is dropped: it adds nothing to y_n, and the block's
residual carries the token on unchanged. capacity_factor = 0 means dropless: no limit. The
gates are renormalized before dropping, so a dropped second choice leaves g_1 < 1.

The auxiliary loss (Switch, eq. 4), which pushes the router toward an even load:

    aux = E * sum_e f_e * P_e
    f_e = (assignments the router made to e) / (N k)    its choices, before capacity: a
                                                         count, constant to backward
    P_e = (1/N) sum_n p[n, e]                            differentiable: the router learns
                                                         from it

Both are fractions that sum to 1 over e; at an even load f_e = P_e = 1/E and aux = 1.
"""

import math
from dataclasses import dataclass

import numpy as np

from minidp.engine.tensor import Tensor

__all__ = ["Routing", "capacity", "choose_experts", "gates", "route", "served_before"]


@dataclass
class Routing:
    """The assignments that survive capacity, M of them in the order served, and the counts.

    token, expert, group, position: (M,) arrays; `position` is the assignment's place among
    the kept assignments of its (group, expert): 0, 1, ... (its slot in the buffer).
    gate: (M,) Tensor, each kept assignment's gate (its gradient flows to the router).
    routed, dropped: (E,) int64, the assignments the router made to each expert and those
    dropped past capacity. width: the most kept by one (group, expert), the slots a group
    needs in each expert's buffer."""

    token: np.ndarray
    expert: np.ndarray
    group: np.ndarray
    position: np.ndarray
    gate: Tensor
    routed: np.ndarray
    dropped: np.ndarray
    width: int


def choose_experts(p: np.ndarray, k: int) -> np.ndarray:
    """(N, E) probabilities -> (N, k): each token's k most probable experts, best first
    (of equal ones, the lower index)."""
    return np.argsort(-p, axis=1, kind="stable")[:, :k]


def gates(probs: Tensor, chosen: np.ndarray) -> Tensor:
    """(N, k) gates: p[n, e_i(n)], renormalized over the k chosen when k > 1."""
    N, k = chosen.shape
    g = probs[np.arange(N)[:, None], chosen]  # indexing: dL/dg reaches p, then the router
    return g if k == 1 else g / g.sum(axis=1, keepdims=True)


def capacity(capacity_factor: float, tokens: int, k: int, n_experts: int) -> int | None:
    """ceil(capacity_factor * tokens * k / E), the assignments an expert takes from a group
    of `tokens` tokens; None when capacity_factor is 0 (dropless)."""
    if capacity_factor < 0:
        raise ValueError(f"capacity_factor must be >= 0 (0: dropless), got {capacity_factor}")
    if capacity_factor == 0:
        return None
    return math.ceil(capacity_factor * tokens * k / n_experts)


def served_before(key: np.ndarray) -> np.ndarray:
    """For each entry, how many entries before it have the same key (0, 1, ... per key)."""
    order = np.argsort(key, kind="stable")  # stable: equal keys keep their serving order
    first = np.searchsorted(key[order], key[order], side="left")
    position = np.empty_like(order)
    position[order] = np.arange(len(key)) - first
    return position


def route(probs: Tensor, k: int, capacity_factor: float = 0.0, groups: int = 1) -> Routing:
    """Choose k experts per token from `probs` (N, E), apply each group's capacity, and say
    where every kept assignment goes (see the module docstring)."""
    N, E = probs.shape
    if not 1 <= k <= E:
        raise ValueError(f"top_k must be in [1, {E}] (the experts), got {k}")
    if groups < 1 or N % groups:
        raise ValueError(f"{N} tokens do not cut into {groups} capacity groups")
    chosen = choose_experts(probs.data, k)
    g = gates(probs, chosen)
    # every assignment, in the order served: all first choices by token, then all second ones
    token = np.tile(np.arange(N), k)
    expert = chosen.T.ravel()
    group = token // (N // groups)
    position = served_before(group * E + expert)
    limit = capacity(capacity_factor, N // groups, k, E)
    kept = np.flatnonzero(position < limit) if limit is not None else np.arange(N * k)
    routed = np.bincount(expert, minlength=E).astype(np.int64)
    dropped = routed - np.bincount(expert[kept], minlength=E)
    return Routing(
        token=token[kept],
        expert=expert[kept],
        group=group[kept],
        position=position[kept],
        gate=g.transpose(1, 0).reshape(N * k)[kept],  # (k, N) flattened: the serving order
        routed=routed,
        dropped=dropped,
        width=int(position[kept].max()) + 1 if len(kept) else 0,
    )
