"""The messages each rank sends in every collective algorithm, exactly as minidp sends them.

Each function below walks the same steps as the algorithm in minidp/comm/ (the step tables of
ring.py, recursive.py, tree.py, naive.py, rooted.py, alltoall.py, barrier.py) and returns
the sizes, in elements, of the messages rank r of p sends: one entry per message, empty ones
included (a ring step with an empty chunk is still a message). `group.counters` counts the
same thing: messages_sent = len(sizes), bytes_sent = sum(sizes) * itemsize.

n is the whole vector, in elements: x.size for allreduce, reduce_scatter, broadcast and
reduce; the gathered result for allgather, gather, alltoall and scatter (p rows of n/p; for
allgather rank i's piece is chunk i of chunk_bounds(n, p), so pieces may differ by one).
Chunks are chunk_bounds(n, p) (minidp/tools/chunks.py): the first n % p get one element more.

Pure Python, no MPI: only the names and the chunking are imported.
"""

from minidp.tools.chunks import chunk_bounds


def _sizes(bounds) -> list[int]:
    return [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]


# ---- the ring (ring.py): p - 1 steps, one chunk to the right neighbour each ----------------
def ring_reduce_scatter(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Step k sends chunk (r - k - 1) mod p: every chunk but r's own."""
    c = _sizes(chunk_bounds(n, p))
    return [c[(r - k - 1) % p] for k in range(p - 1)]


def ring_allgather(p: int, r: int, n: int, root: int = 0, shift: int = 0) -> list[int]:
    """Step k sends chunk (r - shift - k) mod p: every chunk but (r - shift + 1) mod p.
    (shift: rooted.py's broadcast starts rank r with chunk r - root; allgather has none.)"""
    c = _sizes(chunk_bounds(n, p))
    return [c[(r - shift - k) % p] for k in range(p - 1)]


def ring_allreduce(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Reduce-scatter, then allgather: 2(p - 1) messages."""
    return ring_reduce_scatter(p, r, n) + ring_allgather(p, r, n)


# ---- butterflies (recursive.py), with the fold for p not a power of two --------------------
class Fold:
    """p' = 2^floor(lg p) virtual ranks; the first 2·rem ranks pair up (rem = p - p')."""

    def __init__(self, p: int, r: int) -> None:
        self.pof2 = 1 << (p.bit_length() - 1)
        self.rem = p - self.pof2
        self.sits_out = r < 2 * self.rem and r % 2 == 0  # sends its vector to r + 1
        self.takes_in = r < 2 * self.rem and r % 2 == 1  # receives r - 1's, answers it
        self.virtual = r // 2 if r < 2 * self.rem else r - self.rem

    def first_chunk(self, v: int) -> int:
        return 2 * v if v < self.rem else v + self.rem


def _halving(fold: Fold, vbounds) -> list[int]:
    """Recursive halving: each step sends the half of the range that is not kept."""
    v, lo, hi, mask, sent = fold.virtual, 0, fold.pof2, fold.pof2 // 2, []
    while mask:
        keep, give = ((lo, lo + mask), (lo + mask, hi))
        if v >= v ^ mask:
            keep, give = give, keep
        sent.append(vbounds[give[1]] - vbounds[give[0]])
        (lo, hi), mask = keep, mask // 2
    return sent


def _doubling(fold: Fold, vbounds) -> list[int]:
    """Recursive doubling: step with distance `mask` sends the aligned block of mask chunks."""
    v, mask, sent = fold.virtual, 1, []
    while mask < fold.pof2:
        mine = v // mask * mask
        sent.append(vbounds[mine + mask] - vbounds[mine])
        mask *= 2
    return sent


def recursive_doubling_allreduce(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """lg p' whole-vector exchanges; folded ranks: one send each way around them."""
    fold = Fold(p, r)
    if fold.sits_out:
        return [n]
    return [n] * (fold.pof2.bit_length() - 1) + ([n] if fold.takes_in else [])


def rabenseifner_allreduce(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Fold, halving and doubling over chunk_bounds(n, p'), unfold."""
    fold = Fold(p, r)
    if fold.sits_out:
        return [n]
    vbounds = chunk_bounds(n, fold.pof2)
    butterfly = _halving(fold, vbounds) + _doubling(fold, vbounds)
    return butterfly + ([n] if fold.takes_in else [])


def _real_vbounds(fold: Fold, bounds) -> list[int]:
    """Virtual rank v answers for the real chunks [first_chunk(v), first_chunk(v + 1))."""
    return [bounds[fold.first_chunk(v)] for v in range(fold.pof2 + 1)]


def recursive_halving_reduce_scatter(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Folded ranks send their vector; odd ranks below 2rem send the partner's chunk back."""
    fold, bounds = Fold(p, r), chunk_bounds(n, p)
    if fold.sits_out:
        return [n]
    back = [bounds[r] - bounds[r - 1]] if fold.takes_in else []
    return _halving(fold, _real_vbounds(fold, bounds)) + back


def recursive_doubling_allgather(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Folded ranks send their chunk in; odd ranks below 2rem send the whole result back."""
    fold, bounds = Fold(p, r), chunk_bounds(n, p)
    if fold.sits_out:
        return [bounds[r + 1] - bounds[r]]
    return _doubling(fold, _real_vbounds(fold, bounds)) + ([n] if fold.takes_in else [])


# ---- binomial trees (tree.py), ranks relative to the root: v = (r - root) mod p ------------
def _lowbit(p: int, v: int) -> int:
    """lowbit(v) for v > 0; for the root, the first power of two >= p (tree._parent_mask)."""
    mask = 1
    while mask < p and not v & mask:
        mask <<= 1
    return mask


def _children(p: int, v: int) -> list[int]:
    """v + mask/2, v + mask/4, ..., v + 1, those below p."""
    mask, out = _lowbit(p, v) >> 1, []
    while mask:
        if v + mask < p:
            out.append(v + mask)
        mask >>= 1
    return out


def tree_broadcast(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Each rank sends the whole vector to each of its children."""
    return [n for _ in _children(p, (r - root) % p)]


def tree_reduce(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Each rank but the root sends its partial sum to its parent, once."""
    return [n] if (r - root) % p else []


def tree_allreduce(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Binomial reduce to rank 0, then binomial broadcast from rank 0."""
    return tree_reduce(p, r, n, 0) + tree_broadcast(p, r, n, 0)


def _scatter_tree(p: int, v: int, bounds) -> list[int]:
    """Binomial scatter: v sends child c the chunks of c's subtree, [c, c + lowbit(c))."""
    return [bounds[min(c + _lowbit(p, c), p)] - bounds[c] for c in _children(p, v)]


def _gather_tree(p: int, v: int, bounds) -> list[int]:
    """Binomial gather: v sends its parent its whole subtree, once."""
    return [bounds[min(v + _lowbit(p, v), p)] - bounds[v]] if v else []


def _rows(n: int, p: int) -> list[int]:
    if n % p:
        raise ValueError(f"n = {n} elements are not p = {p} rows of the same size")
    return [i * (n // p) for i in range(p + 1)]


def tree_gather(p: int, r: int, n: int, root: int = 0) -> list[int]:
    return _gather_tree(p, (r - root) % p, _rows(n, p))


def tree_scatter(p: int, r: int, n: int, root: int = 0) -> list[int]:
    return _scatter_tree(p, (r - root) % p, _rows(n, p))


def ring_broadcast(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """van de Geijn: binomial scatter of p chunks, then a ring allgather (shifted by root)."""
    bounds = chunk_bounds(n, p)
    return _scatter_tree(p, (r - root) % p, bounds) + ring_allgather(p, r, n, shift=root)


def ring_reduce(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Ring reduce-scatter, then every rank but the root sends its chunk to the root."""
    c = _sizes(chunk_bounds(n, p))
    return ring_reduce_scatter(p, r, n) + ([c[r]] if r != root else [])


# ---- linear (naive.py): one rank talks to every other -------------------------------------
def naive_broadcast(p: int, r: int, n: int, root: int = 0) -> list[int]:
    return [n] * (p - 1) if r == root else []


def naive_reduce(p: int, r: int, n: int, root: int = 0) -> list[int]:
    return [] if r == root else [n]


def naive_gather(p: int, r: int, n: int, root: int = 0) -> list[int]:
    _rows(n, p)
    return [] if r == root else [n // p]


def naive_scatter(p: int, r: int, n: int, root: int = 0) -> list[int]:
    _rows(n, p)
    return [n // p] * (p - 1) if r == root else []


def naive_allreduce(p: int, r: int, n: int, root: int = 0) -> list[int]:
    return naive_reduce(p, r, n, 0) + naive_broadcast(p, r, n, 0)


def naive_reduce_scatter(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Reduce to rank 0, which sends every other rank its chunk."""
    c = _sizes(chunk_bounds(n, p))
    return naive_reduce(p, r, n, 0) + ([c[i] for i in range(1, p)] if r == 0 else [])


def naive_allgather(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Every chunk to rank 0, which sends the whole result to every other rank."""
    c = _sizes(chunk_bounds(n, p))
    return ([c[r]] if r else []) + naive_broadcast(p, r, n, 0)


# ---- all-to-all (alltoall.py) and the barrier (barrier.py) ---------------------------------
def alltoall(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """Pairwise (one partner per step) or naive (all at once): p - 1 rows either way."""
    _rows(n, p)
    return [n // p] * (p - 1)


def dissemination_barrier(p: int, r: int, n: int = 0, root: int = 0) -> list[int]:
    """Round k: an empty message to r + 2^k, ceil(lg p) rounds."""
    return [0] * (p - 1).bit_length()


def none(p: int, r: int, n: int, root: int = 0) -> list[int]:
    """MPI's own collectives ("mpi") and shared memory ("shm") send no minidp message.
    (What MPI sends inside its own collectives is not visible to minidp's counters.)"""
    return []


def shm_loaded(p: int, r: int, n: int) -> int:
    """shm.py counts as sent what the others load from rank r's array: chunk q by each rank
    q != r while reducing (n - c_r), then chunk r by the p - 1 others: n + (p - 2)·c_r."""
    c = _sizes(chunk_bounds(n, p))
    return n + (p - 2) * c[r]
