"""Expert parallelism: a MoE layer's experts spread over ranks, tokens sent to them and
back in all-to-alls (GShard, DeepSpeed-MoE, Megatron-LM). Read in this order:

    communications.py   the all-to-all as an autograd op (its backward: the reverse one)
    groups.py           EP groups carved out of the data-parallel ranks, and the
                        expert-data-parallel groups of each expert's replicas
    dispatch.py         AllToAllExperts: the MoE layer's dispatcher over ranks
    plain.py            ExpertParallel(model, dp_group, ep): shards a user's model, reduces
                        each gradient over its group (one allreduce per parameter)

The MoE layer itself, its routing and its load record are the model side, minidp/models/moe/;
docs/experts.md has the picture, the groups and a measured table.
"""

from minidp.parallel.experts.communications import all_to_all, alltoall_bytes
from minidp.parallel.experts.dispatch import AllToAllExperts
from minidp.parallel.experts.groups import expert_groups
from minidp.parallel.experts.plain import ExpertParallel

__all__ = ["AllToAllExperts", "ExpertParallel", "all_to_all", "alltoall_bytes", "expert_groups"]
