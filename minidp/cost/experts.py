"""The MoE step's collectives: what a run with `--experts E --ep N` sends, as step.py's Calls.

A MoE GPT trains under ExpertParallel (parallel/experts/plain.py, docs/experts.md): its
experts spread over EP groups of N consecutive DP ranks, each rank holding E/N of them.
Per MoE layer and micro-batch of N_r = b·T tokens on a rank (b its examples):

    ep   dispatch and combine: an all-to-all of the (E, S, C) buffer each, forward, and
         their reverses in backward: 4 alltoall of E·S·C elements, of which a rank sends
         (N - 1)/N: alltoall_bytes(N, E, S, C, itemsize); the agreement on S, an
         allreduce(max) of 1 int64, forward
    dp   the router's counts over the DP group (Switch's f_e, the load record): an
         allreduce of 2E + 1 int64, forward

and per step, after backward (finish_gradient_sync: one blocking call a tensor, nothing
overlapped):

    dp   the global loss (1 float64); each non-expert parameter allreduced (avg) over the DP
         group of dp ranks; each of this rank's experts' tensors over its expert-DP group
         (dp/N ranks, this rank its d // N-th: `Call.ranks`)
    ep   the clip's sum of the experts' squares (1 float64), with --grad-clip

S, the slots an expert, is what a run agrees on in each forward: the largest load of any
expert on any rank of the EP group. A prediction cannot know the routing, so it assumes

    capacity factor F > 0   S = capacity = ceil(F N_r k / E), the most S can be: exact when
                            some expert of the EP group fills its capacity in every forward
                            (a drop anywhere in the group), else an upper bound
    dropless (F = 0)        S = ceil(N_r k / E), an even load, the least S can be: the ep
                            bytes are then a lower bound (at most S = N_r: every token of a
                            rank to one expert, E / k times as many bytes)
"""

import math
from typing import NamedTuple

from minidp.cost.calls import LOSS, Call, Shapes
from minidp.tools.chunks import chunk_bounds

COUNTS = 8  # the router's counts and S travel as int64


class Experts(NamedTuple):
    """The MoE flags: --experts, --moe-top-k, --capacity-factor, --moe-every."""

    n_experts: int
    top_k: int = 1
    capacity_factor: float = 0.0
    every: int = 1  # a MoE in every block (1), or in blocks 1, 3, ... (2)


def slots(experts: Experts, tokens: int) -> int:
    """S assumed for a forward of `tokens` tokens on a rank (the module docstring): the
    capacity with a capacity factor, an even load without."""
    E, k, F = experts.n_experts, experts.top_k, experts.capacity_factor
    return math.ceil((F or 1.0) * tokens * k / E)


def moe_blocks(n_layer: int, experts: Experts) -> list[int]:
    """The blocks that hold a MoE (models/gpt.py's uses_moe)."""
    return [i for i in range(n_layer) if (i + 1) % experts.every == 0]


def parameters(n_layer, n_embd, vocab, block_size, experts: Experts, ep: int):
    """(the replicated tensors' shapes, this rank's experts' shapes) of the MoE GPT: a
    MoE block's MLP is a router (C, E) and E/ep experts, each the MLP (fc, fc_proj)."""
    C, V, T, E = n_embd, vocab, block_size, experts.n_experts
    mlp = [(C, 4 * C), (4 * C,), (4 * C, C), (C,)]
    attention = [(C,), (C,), (C, 3 * C), (3 * C,), (C, C), (C,), (C,), (C,)]  # + ln2
    moe = set(moe_blocks(n_layer, experts))
    shared = [(V, C), (T, C)]
    for i in range(n_layer):
        shared += attention + ([(C, E)] if i in moe else mlp)
    shared += [(C,), (C,), (C, V)]
    return shared, mlp * (E // ep) * len(moe)


def moe_shapes(n_layer, n_embd, vocab, block_size, experts: Experts, ep: int) -> Shapes:
    """Shapes of one rank's MoE GPT (its E/ep experts a MoE block), for step.py's memory
    and optimizer terms."""
    shared, mine = parameters(n_layer, n_embd, vocab, block_size, experts, ep)
    dims = shared + mine
    return Shapes([math.prod(d) for d in dims], [], (), n_layer, n_embd, block_size, vocab,
                  tuple(dims))  # fmt: skip


def expert_parallel(layout, shapes: Shapes, itemsize: int, examples: int) -> list[Call]:
    """The calls of one step of ExpertParallel on a rank with `examples` examples in
    layout.grad_accum micro-batches (the module docstring)."""
    moe, ep, dp = layout.experts, layout.ep, layout.dp
    E, C = moe.n_experts, shapes.n_embd
    layers = len(moe_blocks(shapes.n_layer, moe))
    calls = [LOSS]
    bounds = chunk_bounds(examples, layout.grad_accum)
    for b in (hi - lo for lo, hi in zip(bounds, bounds[1:])):
        S = slots(moe, b * shapes.block_size)
        a2a = Call("ep", "alltoall", "auto", E * S * C, itemsize, "forward")
        agree = Call("ep", "allreduce", "auto", 1, COUNTS, "forward")
        counts = Call("dp", "allreduce", "auto", 2 * E + 1, COUNTS, "forward")
        back = a2a._replace(phase="backward")
        calls += [a2a, agree, a2a, counts, back, back] * layers
    shared, mine = parameters(shapes.n_layer, C, shapes.vocab, shapes.block_size, moe, ep)
    calls += [Call("dp", "allreduce", "auto", math.prod(d), itemsize, "after") for d in shared]
    calls += [
        Call("dp", "allreduce", "auto", math.prod(d), itemsize, "after", ranks=dp // ep)
        for d in mine
    ]
    if layout.clip:
        calls.append(Call("ep", "allreduce", "auto", 1, 8, "after"))
    return calls
