"""Time of each collective algorithm in the α-β-γ model (Thakur, Rabenseifner & Gropp 2005).

    α  seconds per message (latency)        β  seconds per byte sent
    γ  seconds per byte reduced (the op)    δ  seconds per byte copied in memory

The time is the critical path: a step costs α plus β for the largest message sent in it,
plus γ for what is reduced after it, and steps follow one another. With

    N = n·itemsize        the whole vector, in bytes
    C = ceil(n/p)·s       the largest chunk of chunk_bounds(n, p), in bytes (N/p when p | n)
    M = N/p               one row (gather, scatter, alltoall)
    L = ceil(lg p)        rounds of a binomial tree or of the dissemination barrier
    l = floor(lg p)       rounds of a butterfly over p' = 2^l ranks; f = 1 when p != p'
    C' = ceil(n/p')·s     the largest chunk over the p' virtual ranks (N/p' when p' | n)
    V                     the largest chunk a virtual rank answers for (two real ones at most)

every algorithm's time is the formula in its function's docstring. δ is not in them:
cost.time adds δ per byte a call copies in memory beside its messages (cost.copied). "mpi"
(inside MPI) and "shm" (no messages: loads from shared memory, bounded by memory bandwidth,
not by α and β) have no formula here: their time is None.
"""

from minidp.tools.chunks import chunk_bounds


class Terms:
    """The sizes the formulas are written in, for p ranks and n elements of s bytes."""

    def __init__(self, p: int, n: int, s: int) -> None:
        self.p, self.N = p, n * s
        self.C = -(-n // p) * s
        self.M = self.N / p
        self.L = (p - 1).bit_length()
        pof2 = 1 << (p.bit_length() - 1)
        self.l, self.pof2, self.f = pof2.bit_length() - 1, pof2, int(p != pof2)
        self.Cv = -(-n // pof2) * s
        rem, b = p - pof2, chunk_bounds(n, p)
        first = [2 * v if v < rem else v + rem for v in range(pof2 + 1)]
        self.V = max(b[first[v + 1]] - b[first[v]] for v in range(pof2)) * s


def ring_allreduce(t: Terms, a: float, b: float, g: float) -> float:
    """2(p-1)(α + Cβ) + (p-1)Cγ  =  2(p-1)α + 2(p-1)/p·Nβ + (p-1)/p·Nγ when p | n."""
    return 2 * (t.p - 1) * (a + t.C * b) + (t.p - 1) * t.C * g


def ring_reduce_scatter(t: Terms, a: float, b: float, g: float) -> float:
    """(p-1)(α + Cβ + Cγ)."""
    return (t.p - 1) * (a + t.C * b + t.C * g)


def ring_allgather(t: Terms, a: float, b: float, g: float) -> float:
    """(p-1)(α + Cβ)."""
    return (t.p - 1) * (a + t.C * b)


def _fold(t: Terms, a: float, b: float, g: float, back: float) -> float:
    """The fold: α + Nβ + Nγ in, α + back·β out, when p is not a power of two."""
    return t.f * (2 * a + (t.N + back) * b + t.N * g)


def recursive_doubling_allreduce(t: Terms, a: float, b: float, g: float) -> float:
    """l(α + Nβ + Nγ), plus the fold."""
    return t.l * (a + t.N * b + t.N * g) + _fold(t, a, b, g, t.N)


def rabenseifner_allreduce(t: Terms, a: float, b: float, g: float) -> float:
    """2lα + 2(p'-1)C'β + (p'-1)C'γ (halving, then doubling), plus the fold."""
    k = t.pof2 - 1
    return 2 * t.l * a + 2 * k * t.Cv * b + k * t.Cv * g + _fold(t, a, b, g, t.N)


def recursive_halving_reduce_scatter(t: Terms, a: float, b: float, g: float) -> float:
    """lα + (p'-1)V(β + γ), plus the fold (a chunk goes back)."""
    fold = t.f * (2 * a + (t.N + t.C) * b + t.N * g)
    return t.l * a + (t.pof2 - 1) * t.V * (b + g) + fold


def recursive_doubling_allgather(t: Terms, a: float, b: float, g: float) -> float:
    """lα + (p'-1)Vβ, plus the fold (a chunk in, the whole result back)."""
    return t.l * a + (t.pof2 - 1) * t.V * b + t.f * (2 * a + (t.C + t.N) * b)


def tree_broadcast(t: Terms, a: float, b: float, g: float) -> float:
    """L(α + Nβ)."""
    return t.L * (a + t.N * b)


def tree_reduce(t: Terms, a: float, b: float, g: float) -> float:
    """L(α + Nβ + Nγ)."""
    return t.L * (a + t.N * b + t.N * g)


def tree_allreduce(t: Terms, a: float, b: float, g: float) -> float:
    """2L(α + Nβ) + LNγ: a tree reduce, then a tree broadcast."""
    return tree_reduce(t, a, b, g) + tree_broadcast(t, a, b, g)


def tree_scatter(t: Terms, a: float, b: float, g: float) -> float:
    """Lα + (p-1)Mβ (and gather, its reverse)."""
    return t.L * a + (t.p - 1) * t.M * b


def ring_broadcast(t: Terms, a: float, b: float, g: float) -> float:
    """Lα + (p-1)Cβ (binomial scatter of chunks) + (p-1)(α + Cβ) (ring allgather)."""
    return t.L * a + (t.p - 1) * t.C * b + ring_allgather(t, a, b, g)


def ring_reduce(t: Terms, a: float, b: float, g: float) -> float:
    """(p-1)(α + Cβ + Cγ) (ring reduce-scatter) + (p-1)α + (p-1)Cβ (linear gather)."""
    return ring_reduce_scatter(t, a, b, g) + (t.p - 1) * (a + t.C * b)


def naive_broadcast(t: Terms, a: float, b: float, g: float) -> float:
    """(p-1)(α + Nβ): the root sends the vector p - 1 times."""
    return (t.p - 1) * (a + t.N * b)


def naive_reduce(t: Terms, a: float, b: float, g: float) -> float:
    """(p-1)(α + Nβ + Nγ): the root receives and adds p - 1 vectors."""
    return (t.p - 1) * (a + t.N * b + t.N * g)


def naive_allreduce(t: Terms, a: float, b: float, g: float) -> float:
    """2(p-1)(α + Nβ) + (p-1)Nγ."""
    return naive_reduce(t, a, b, g) + naive_broadcast(t, a, b, g)


def naive_rows(t: Terms, a: float, b: float, g: float) -> float:
    """(p-1)(α + Cβ): p - 1 chunks or rows through one rank (gather, scatter, alltoall)."""
    return (t.p - 1) * (a + t.C * b)


def naive_reduce_scatter(t: Terms, a: float, b: float, g: float) -> float:
    """(p-1)(α + Nβ + Nγ) + (p-1)(α + Cβ): reduce to rank 0, which scatters."""
    return naive_reduce(t, a, b, g) + naive_rows(t, a, b, g)


def naive_allgather(t: Terms, a: float, b: float, g: float) -> float:
    """(p-1)(α + Cβ) + (p-1)(α + Nβ): gather to rank 0, which broadcasts."""
    return naive_rows(t, a, b, g) + naive_broadcast(t, a, b, g)


def barrier(t: Terms, a: float, b: float, g: float) -> float:
    """Lα: empty messages."""
    return t.L * a


def unknown(t: Terms, a: float, b: float, g: float) -> None:
    """Not an α-β-γ algorithm of minidp's ("mpi": MPI's own; "shm": memory loads)."""
    return None
