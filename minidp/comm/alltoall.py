"""All-to-all: rank i's row j goes to rank j's row i (a distributed transpose).

Pairwise exchange (Thakur, Rabenseifner & Gropp 2005, long messages), p = 4:

    step k   rank 0      rank 1      rank 2      rank 3       rank r sends row r+k to
      1      →1 ←3       →2 ←0       →3 ←1       →0 ←2        rank r+k and receives row
      2      →2 ←2       →3 ←3       →0 ←0       →1 ←1        r-k from rank r-k (mod p)
      3      →3 ←1       →0 ←2       →1 ←3       →2 ←0

    cost (p-1)(α + mβ), m bytes per row; one partner per step, so no link is oversubscribed.

"naive" posts all p-1 receives and sends at once and lets MPI sort them out: the same bytes,
(p-1)α of overhead that can overlap, but every rank hits every other at the same moment.
"""

import numpy as np

from minidp.comm.p2p import irecv, isend, sendrecv, waitall


def pairwise_alltoall(group, rows: np.ndarray, out: np.ndarray) -> None:
    """rows and out have shape (p, m); out must not be rows."""
    p, r = group.size, group.rank
    np.copyto(out[r], rows[r])
    for k in range(1, p):
        to, frm = (r + k) % p, (r - k) % p
        sendrecv(group, rows[to], to, out[frm], frm)


def naive_alltoall(group, rows: np.ndarray, out: np.ndarray) -> None:
    p, r = group.size, group.rank
    others = [i for i in range(p) if i != r]
    requests = [irecv(group, out[i], i) for i in others]
    requests += [isend(group, rows[i], i) for i in others]
    np.copyto(out[r], rows[r])
    waitall(group, requests, others + others)
