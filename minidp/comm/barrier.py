"""Barrier by dissemination (Hensgen, Finkel & Manber 1988): no rank leaves before all came.

In round k every rank sends an empty message to rank r + 2^k and waits for one from rank
r - 2^k (mod p). After round k, rank r has heard, directly or through a chain, from the 2^(k+1)
ranks just before it, so after ceil(lg p) rounds it has heard from everyone:

    p = 5     round 0: r → r+1     round 1: r → r+2     round 2: r → r+4

    cost ceil(lg p)·α, and it works for any p (no fold needed, unlike a butterfly).
"""

import numpy as np

from minidp.comm.p2p import sendrecv


def dissemination_barrier(group) -> None:
    p, r = group.size, group.rank
    empty = np.empty(0, np.uint8)
    distance = 1
    while distance < p:
        sendrecv(group, empty, (r + distance) % p, empty, (r - distance) % p)
        distance *= 2
