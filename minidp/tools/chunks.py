"""How a flat vector of n elements is cut into p contiguous chunks, one per rank.

Every algorithm that moves pieces of a vector (ring, recursive halving, scatter + allgather)
and every scheme that shards one (ZeRO) cuts it the same way, so that `reduce_scatter` and
`allgather` are each other's inverse:

    n = 10, p = 4     chunk_bounds(10, 4) == (0, 3, 6, 8, 10)

    element  0 1 2 | 3 4 5 | 6 7 | 8 9
    chunk       0  |   1   |  2  |  3        rank i owns x[bounds[i]:bounds[i + 1]]

The first n % p chunks get one element more than the rest (like `np.array_split`), so chunk
sizes differ by at most one; when n < p the last chunks are empty.
"""

import functools

Bounds = tuple[int, ...]  # chunk i of a vector is [bounds[i], bounds[i + 1])


@functools.lru_cache(maxsize=1024)
def chunk_bounds(n: int, p: int) -> Bounds:
    """The p + 1 boundaries of p contiguous chunks of n elements: chunk i is [b[i], b[i+1]).

    >>> chunk_bounds(7, 3)
    (0, 3, 5, 7)

    A tuple, cached: the same few sizes come back on every step of training.
    """
    if p < 1 or n < 0:
        raise ValueError(f"chunk_bounds needs n >= 0 and p >= 1, got n={n}, p={p}")
    base, extra = divmod(n, p)
    return tuple(i * base + min(i, extra) for i in range(p + 1))


def chunk_range(n: int, p: int, i: int) -> tuple[int, int]:
    """(start, stop) of chunk i in chunk_bounds(n, p), without building the whole list."""
    base, extra = divmod(n, p)
    return i * base + min(i, extra), (i + 1) * base + min(i + 1, extra)
