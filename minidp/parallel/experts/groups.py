"""Expert parallelism carved out of data parallelism (Megatron-LM's and DeepSpeed-MoE's
arrangement): two groups per rank from the data-parallel group.

With dp data-parallel ranks and ep dividing dp, the EP groups are consecutive blocks of ep
DP ranks; inside a block, EP rank j holds experts [j E/ep, (j+1) E/ep). So each expert has
dp/ep replicas, one per block, and those replicas form its expert-data-parallel group, the
ranks with the same place in their blocks. dp = 4, ep = 2, E = 4:

    DP rank            0        1        2        3
    EP group         [ 0        1 ]    [ 2        3 ]     all-to-all of tokens inside
    experts held      e0 e1    e2 e3    e0 e1    e2 e3
    expert-DP group   {0, 2} holds e0 e1;  {1, 3} holds e2 e3    (their gradients)

Every rank reads its own slice of the batch, as in data parallelism. The non-expert
parameters (attention, router, embeddings) are replicated on all dp ranks and reduced over
the DP group; an expert's gradient is reduced over its dp/ep replicas only.
"""

from minidp import comm

__all__ = ["expert_groups"]


def expert_groups(dp_group: comm.Group, ep: int) -> tuple[comm.Group, comm.Group]:
    """(ep_group, expert_dp_group) of this rank: DP ranks [b ep, (b+1) ep) with
    b = rank // ep, and the DP ranks with the same rank % ep. Collective over dp_group."""
    dp = dp_group.size
    if not isinstance(ep, int) or ep < 1 or dp % ep:
        raise ValueError(f"ep must be a positive divisor of the {dp} data-parallel ranks, got {ep}")
    r = dp_group.rank
    ep_group = dp_group.split(r // ep, key=r % ep)
    expert_dp_group = dp_group.split(r % ep, key=r // ep)
    return ep_group, expert_dp_group
