"""The message of expert parallelism: the all-to-all, as an autograd op.

Each rank of an EP group of p ranks holds E/p of the E experts (rank j: experts
[j E/p, (j+1) E/p)) and has routed its own tokens into a buffer of E blocks of slots
(models/moe/layer.py). Cut into p rows, row j is the slots of rank j's experts; the
all-to-all sends row j to rank j, which receives one row from every rank:

    rank 0's buffer  [ r0→e0,e1 | r0→e2,e3 ]          rank 0 gets [ r0→e0,e1 | r1→e0,e1 ]
    rank 1's buffer  [ r1→e0,e1 | r1→e2,e3 ]   ==>    rank 1 gets [ r0→e2,e3 | r1→e2,e3 ]
                        row 0       row 1                           from 0      from 1

Its experts run over what they got, and the same all-to-all sends every output row back
where it came from (combine). An all-to-all transposes the (source, destination) blocks, so
it is its own inverse: its backward is the reverse all-to-all, the same call on the
gradient (dL/d row i of the result, on rank j, is dL/d row j of the input, on rank i).

    forward    out[i] on rank j  =  x[j] on rank i
    backward   dx[j] on rank i   =  g[i] on rank j         (the same all-to-all, on g)

Cost of one all-to-all (pairwise exchange, comm/alltoall.py): each rank sends p - 1 rows
of (E/p) S C elements, S slots an expert, C features:

    bytes sent per rank = (p - 1) (E/p) S C itemsize        (its own row stays: a copy)

A MoE layer's step runs four: dispatch and combine forward, their reverses in backward.
"""

import numpy as np

from minidp import comm
from minidp.engine.tensor import Tensor, op

__all__ = ["all_to_all", "alltoall_bytes"]


def _alltoall(x: np.ndarray, group: comm.Group, algo: str) -> np.ndarray:
    return comm.alltoall(np.ascontiguousarray(x), algo=algo, group=group)


def all_to_all(x: Tensor, group: comm.Group, algo: str = "auto") -> Tensor:
    """x of shape (p, ...): row j goes to rank j; row i of the result came from rank i.
    Backward: the same all-to-all of the gradient (see the module docstring)."""
    return op(_alltoall(x.data, group, algo), (x,), lambda g: (_alltoall(g, group, algo),))


def alltoall_bytes(ep: int, n_experts: int, slots: int, n_embd: int, itemsize: int) -> int:
    """Bytes one rank sends in one dispatch (or combine) all-to-all of an EP group of `ep`
    ranks: (ep - 1) rows of (E / ep) experts x `slots` slots x n_embd features."""
    return (ep - 1) * (n_experts // ep) * slots * n_embd * itemsize
