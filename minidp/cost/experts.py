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
    tp   on a dp x tp mesh (MeshGPT: each MoE layer whole on every TP rank, attention
         split), per micro-batch TP's g and f (calls.tensor_parallel's) in the embedding,
         each block's attention and a dense block's MLP, none in a MoE layer, and the
         vocab-parallel loss's max and sums (`tensor_parallel` here)

and per step, after backward (finish_gradient_sync: one blocking call a tensor, nothing
overlapped):

    dp   the global loss (1 float64); each non-expert parameter allreduced (avg) over the DP
         group of dp ranks; each of this rank's experts' tensors over its expert-DP group
         (dp/N ranks, this rank its d // N-th: `Call.ranks`), on its TP shard
    ep   the clip's sum of the experts' squares (1 float64), with --grad-clip
    tp   the clip's sum of the shards' squares (1 float64), and when dp > 2 TP rank 0's
         replicated gradients (the experts' included) broadcast over TP (make_alike)

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


def parameters(n_layer, n_embd, vocab, block_size, experts: Experts, ep: int, tp=1, t=0):
    """(the non-expert tensors' shapes, this rank's experts' shapes, the elements every TP
    rank holds whole) of the MoE GPT on TP rank t of tp (tp 1: the whole model): a MoE
    block's MLP is a router (C, E) and E/ep experts, each the MLP (fc, fc_proj), held whole
    on every TP rank (parallel/tensor_parallel/gpt.py); attention, the dense blocks' MLP,
    the vocabulary split as gpt_shapes splits them. The order is the one-process GPT's."""
    C, V, T, E = n_embd, vocab, block_size, experts.n_experts
    v = chunk_bounds(V, tp)[t + 1] - chunk_bounds(V, tp)[t]
    mlp = [(C, 4 * C), (4 * C,), (4 * C, C), (C,)]
    split_mlp = [(C, 4 * C // tp), (4 * C // tp,), (4 * C // tp, C), (C,)]
    attention = [(C,), (C,), (C, 3 * C // tp), (3 * C // tp,), (C // tp, C), (C,), (C,), (C,)]
    moe = set(moe_blocks(n_layer, experts))
    shared, mine = [(v, C), (T, C)], mlp * (E // ep) * len(moe)
    for i in range(n_layer):
        shared += attention + ([(C, E)] if i in moe else split_mlp)
    shared += [(C,), (C,), (C, v)]
    # wpe; a block's ln1, proj's bias, ln2, and its router or fc_proj's bias; ln_f; experts
    whole = T * C + sum(5 * C + (C * E if i in moe else C) for i in range(n_layer)) + 2 * C
    return shared, mine, whole + sum(map(math.prod, mine))


def moe_shapes(n_layer, n_embd, vocab, block_size, experts: Experts, ep: int, tp=1, t=0):
    """Shapes of one rank's MoE GPT (its TP shard, its E/ep experts a MoE block last):
    `replicated` the elements whole on every TP rank (make_alike's broadcast)."""
    shared, mine, whole = parameters(n_layer, n_embd, vocab, block_size, experts, ep, tp, t)
    dims = shared + mine
    return Shapes([math.prod(d) for d in dims], [], (whole,) * (tp > 1), n_layer, n_embd,
                  block_size, vocab, tuple(dims))  # fmt: skip


def tensor_parallel(layout, shapes: Shapes, itemsize: int, tokens: int) -> list[Call]:
    """The TP calls of one micro-batch of `tokens` N = b·T tokens (calls.tensor_parallel's
    without the MoE blocks' MLP: their layer is whole on every TP rank): g forward in the
    embedding and in each block's attention (and a dense block's MLP), f backward in as
    many, the head's included; the vocab-parallel loss's max (N) and sums (2N)."""
    if layout.tp == 1:
        return []
    regions = 1 + 2 * shapes.n_layer - len(moe_blocks(shapes.n_layer, layout.experts))
    g = Call("tp", "allreduce", "auto", tokens * shapes.n_embd, itemsize, "forward")
    loss = [g._replace(n=tokens), g._replace(n=2 * tokens)]
    return [g] * regions + loss + [g._replace(phase="backward")] * regions


def expert_parallel(layout, shapes: Shapes, itemsize: int, examples: int) -> list[Call]:
    """The calls of one step of ExpertParallel on a rank with `examples` examples in
    layout.grad_accum micro-batches (the module docstring), on its TP shard of a dp x tp
    mesh (MeshGPT: the TP calls; after the sync, the replicated gradients, experts
    included, broadcast from TP rank 0 when dp > 2)."""
    moe, ep, dp = layout.experts, layout.ep, layout.dp
    E, C = moe.n_experts, shapes.n_embd
    layers = moe_blocks(shapes.n_layer, moe)
    calls = [LOSS]
    bounds = chunk_bounds(examples, layout.grad_accum)
    for b in (hi - lo for lo, hi in zip(bounds, bounds[1:])):
        S = slots(moe, b * shapes.block_size)
        a2a = Call("ep", "alltoall", "auto", E * S * C, itemsize, "forward")
        agree = Call("ep", "allreduce", "auto", 1, COUNTS, "forward")
        counts = Call("dp", "allreduce", "auto", 2 * E + 1, COUNTS, "forward")
        back = a2a._replace(phase="backward")
        calls += [a2a, agree, a2a, counts, back, back] * len(layers)
        calls += tensor_parallel(layout, shapes, itemsize, b * shapes.block_size)
    mine = 4 * (E // ep) * len(layers)  # the experts' tensors, last in shapes.params
    shared, experts = shapes.params[:-mine], shapes.params[-mine:]
    calls += [Call("dp", "allreduce", "auto", n, itemsize, "after") for n in shared]
    expert_dp = Call("dp", "allreduce", "auto", 0, itemsize, "after", ranks=dp // ep)
    calls += [expert_dp._replace(n=n) for n in experts]
    if layout.clip:  # the norm: TP's shards' squares (1 float64), the experts' over EP
        calls += [Call("tp", "allreduce", "auto", 1, 8, "after")] * (layout.tp > 1)
        calls.append(Call("ep", "allreduce", "auto", 1, 8, "after"))
    if layout.tp > 1 and dp > 2:  # make_alike: TP rank 0's replicated gradients
        calls.append(Call("tp", "broadcast", "auto", shapes.replicated[0], itemsize, "after"))
    return calls
