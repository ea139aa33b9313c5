"""Adasum, Horovod's adaptive summation (Maleki et al., "Scaling Distributed Training with
Adaptive Summation", MLSys 2021), written out plainly.

Two ranks' gradients g1, g2 of one tensor combine as

    adasum(g1, g2) = (1 - g1·g2 / (2 |g1|²)) g1  +  (1 - g1·g2 / (2 |g2|²)) g2

    orthogonal (g1·g2 = 0)        g1 + g2: two directions of progress, both taken (a sum)
    equal (g1 = g2 = g)           g / 2 + g / 2 = g: the same step once (an average)
    in between                    the part of each gradient along the other counted once

Over N ranks it is applied recursively, as Horovod's vector-halving distance-doubling does:
ranks pair up (0, 1), (2, 3), ... and each pair's result pairs up with the next pair's,
log2(N) levels, a binary tree over the ranks in order (here every rank gathers all N
gradients and computes the same tree, which gives every rank the same bits; Horovod moves
halves of the vector at each level instead, log2(N) messages, the same arithmetic). A rank
count that is not a power of two leaves the last one unpaired at a level: it goes up as it
is. Each tensor (parameter) is combined on its own: the dot products are per layer.

Why it helps at a large batch: averaging N gradients divides the step by N where they point
different ways, so a larger global batch needs a larger learning rate, retuned; summing
overshoots where they agree. Adasum behaves like the sum for orthogonal gradients and like
the average for parallel ones, so the learning rate tuned for one rank's batch keeps working
as ranks are added (Horovod's advice: do not scale the learning rate by N under Adasum).
A zero gradient (a rank that ran out of data and joined) leaves the other as it is.
"""

import numpy as np


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The pairwise formula above, in float64 for the dot products."""
    a64, b64 = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
    dot = float(np.vdot(a64, b64))
    aa, bb = float(np.vdot(a64, a64)), float(np.vdot(b64, b64))
    if aa == 0.0:
        return b.copy()
    if bb == 0.0:
        return a.copy()
    return (1.0 - dot / (2.0 * aa)) * a + (1.0 - dot / (2.0 * bb)) * b


def adasum_tree(grads: list[np.ndarray]) -> np.ndarray:
    """The ranks' gradients of one tensor, combined level by level in rank order."""
    level = list(grads)
    while len(level) > 1:
        paired = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = paired + ([level[-1]] if len(level) % 2 else [])
    return level[0]
