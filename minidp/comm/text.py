"""Strings over collectives, for error messages and logs: the bytes of the UTF-8 text as a
uint8 array, with its length sent first so the receivers can size their buffers.

    broadcast_text(text, root, group)  -> root's string, on every rank
    gather_text(text, root, group)     -> every rank's string at root (None elsewhere)
"""

import numpy as np

from minidp.comm.collectives import allgather
from minidp.comm.group import Group
from minidp.comm.rooted import broadcast, gather


def broadcast_text(text: str, root: int, group: Group) -> str:
    """root's string on every rank: its length, then its bytes (two broadcasts)."""
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    length = broadcast(np.array([data.size], dtype=np.int64), root=root, group=group)
    buffer = data.copy() if group.rank == root else np.empty(int(length[0]), dtype=np.uint8)
    return broadcast(buffer, root=root, group=group).tobytes().decode()


def gather_text(text: str, root: int, group: Group) -> list[str] | None:
    """Every rank's string at root (None elsewhere): all lengths, then bytes padded to the
    longest (gather moves equal-sized rows)."""
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths = allgather(np.array([data.size], dtype=np.int64), group=group).ravel()
    padded = np.zeros(int(lengths.max()), dtype=np.uint8)
    padded[: data.size] = data
    gathered = gather(padded, root=root, group=group)
    if group.rank != root:
        return None
    return [row[: int(n)].tobytes().decode() for row, n in zip(gathered, lengths)]
