"""Which positions of the sequence each rank of a context-parallel group holds.

Context parallelism cuts the sequence axis T over the C ranks of a group. Two layouts:

    contiguous (zigzag=False): rank i holds chunk i of C, positions [i T/C, (i+1) T/C)
    zig-zag    (zigzag=True):  2C chunks of T/(2C); rank i holds chunks i and 2C-1-i

Under a causal mask, query chunk a needs key chunk b only when b <= a. Contiguous, rank i
computes i+1 of the C x C blocks (rank 0 one, rank C-1 all C): the last rank works C times
as much as the first. Zig-zag pairs an early chunk with a late one, and every rank computes
(i+1) + (2C-i) = 2C+1 of the (2C)^2 small blocks: the same work everywhere. C = 4, T = 16:

    chunk     0  1  2  3  4  5  6  7        (2 positions each)
    rank      0  1  2  3  3  2  1  0        zig-zag
    rank      0  0  1  1  2  2  3  3        contiguous (4 positions each)

A rank's rows are its chunks one after the other (positions 0-1 then 14-15 on rank 0,
zig-zag). `positions(rank)` names each row's global position: what the position embedding
and the causal mask read.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SequenceLayout:
    """T positions over `ranks` ranks, contiguous or zig-zag (see the module docstring)."""

    T: int
    ranks: int
    zigzag: bool = False

    def __post_init__(self):
        pieces = 2 * self.ranks if self.zigzag else self.ranks
        if self.ranks < 1 or self.T % pieces:
            how = "2 x " if self.zigzag else ""
            raise ValueError(
                f"context parallelism: {self.T} positions do not split into {how}{self.ranks} "
                f"equal chunks (T must divide by {pieces})"
            )

    @property
    def local_T(self) -> int:
        """Positions per rank: T / C."""
        return self.T // self.ranks

    def chunks(self, rank: int) -> list[tuple[int, int]]:
        """Rank's chunks as global [lo, hi) ranges, in the order its rows hold them."""
        if not self.zigzag:
            n = self.local_T
            return [(rank * n, (rank + 1) * n)]
        n, last = self.T // (2 * self.ranks), 2 * self.ranks - 1
        return [(rank * n, (rank + 1) * n), ((last - rank) * n, (last - rank + 1) * n)]

    def positions(self, rank: int) -> np.ndarray:
        """The global position of each of rank's rows."""
        return np.concatenate([np.arange(lo, hi) for lo, hi in self.chunks(rank)])

    def shard(self, x: np.ndarray, rank: int, axis: int = 1) -> np.ndarray:
        """Rank's rows of a whole-sequence array x (T along `axis`), a copy."""
        return np.take(x, self.positions(rank), axis=axis)

    def causal_blocks(self, rank: int, source: int):
        """The (query chunk, key chunk) pairs rank computes when it holds source's keys:
        yields (rows of rank, rows of source, masked) for each pair not wholly in the
        future; masked when the key chunk is the query chunk (the diagonal, where a query
        sees only the keys up to its own position)."""
        offsets = _row_offsets(self.chunks(source))
        for q_lo_row, (q_lo, q_hi) in zip(_row_offsets(self.chunks(rank)), self.chunks(rank)):
            for k_lo_row, (k_lo, k_hi) in zip(offsets, self.chunks(source)):
                if k_lo >= q_hi:
                    continue  # every key after every query: skipped
                rows = slice(q_lo_row, q_lo_row + q_hi - q_lo)
                cols = slice(k_lo_row, k_lo_row + k_hi - k_lo)
                yield rows, cols, k_hi - 1 > q_lo  # some key after some query

    def causal_work(self, rank: int) -> int:
        """Score elements rank computes per (batch row, head) in one ring forward: the
        query x key sizes of every pair causal_blocks yields, over all C sources."""
        return sum(
            (rows.stop - rows.start) * (cols.stop - cols.start)
            for source in range(self.ranks)
            for rows, cols, _ in self.causal_blocks(rank, source)
        )


def _row_offsets(chunks: list[tuple[int, int]]) -> list[int]:
    """The first row of each chunk in a rank's rows (its chunks one after the other)."""
    return list(np.cumsum([0] + [hi - lo for lo, hi in chunks[:-1]]))
