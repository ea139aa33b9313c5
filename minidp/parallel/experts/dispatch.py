"""The MoE layer's dispatcher under expert parallelism: it answers the three calls of
models/moe/layer.py over ranks (the plain one, LocalExperts, answers them in one process).

    sum_over_batch(counts)   allreduce(sum) over the DP group: the router's histogram and
                             the token count of the whole batch, for Switch's f_e and the
                             record (E + E + 1 numbers a layer)
    slots(width)             allreduce(max) over the EP group: every rank's buffer needs the
                             same S for the all-to-all's equal rows (DeepSpeed's dropless
                             capacity); with a capacity factor S <= capacity
    dispatcher(buf, experts) all-to-all the (E, S, C) buffer, run this rank's E/ep experts
                             on every rank's slots for them, all-to-all the outputs back

On this rank, after the first all-to-all, the rows are (source rank i, my expert e, slot s);
each expert runs once over the slots of every source (ep S rows):

    (ep, E/ep, S, C) --transpose--> (E/ep, ep, S, C) --reshape--> (E/ep, ep S, C)
"""

import numpy as np

from minidp import comm
from minidp.engine.tensor import Tensor
from minidp.models.moe.layer import run_experts
from minidp.parallel.experts.communications import all_to_all

__all__ = ["AllToAllExperts"]


class AllToAllExperts:
    """Experts spread over `ep_group` (this rank holds `experts`, E/ep of them), the batch
    over `dp_group`."""

    def __init__(self, ep_group: comm.Group, dp_group: comm.Group, algo: str = "auto"):
        self.ep_group, self.dp_group, self.algo = ep_group, dp_group, algo

    def sum_over_batch(self, counts: np.ndarray) -> np.ndarray:
        return comm.allreduce(counts, group=self.dp_group)

    def slots(self, width: int) -> int:
        return int(comm.allreduce(np.array([width]), op="max", group=self.ep_group)[0])

    def __call__(self, buf: Tensor, experts: list) -> Tensor:
        E, S, C = buf.shape
        ep, mine = self.ep_group.size, len(experts)
        if mine * ep != E:
            raise ValueError(f"{E} experts over {ep} ranks, but this rank holds {mine}")
        rows = all_to_all(buf.reshape(ep, mine, S, C), self.ep_group, self.algo)  # dispatch
        tokens = rows.transpose(1, 0, 2, 3).reshape(mine, ep * S, C)  # my experts' slots
        out = run_experts(experts, tokens)
        out = out.reshape(mine, ep, S, C).transpose(1, 0, 2, 3)  # back to (source, ...)
        back = all_to_all(out, self.ep_group, self.algo)  # combine: row j from rank j
        return back.reshape(E, S, C)
