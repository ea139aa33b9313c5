"""Every collective one training step runs, per strategy, as the code runs it: a list of `Call`s.

A Call is one collective on one mesh axis: (axis, collective, algo, n elements, itemsize,
phase). The phase says where in the step it runs, which decides what can hide it:

    forward    inside the forward (TP's g, ZeRO-3's gathers): on the critical path
    backward   during backward (DDP's buckets, ZeRO's reduce-scatters, TP's f): hidden
               behind backward only when the strategy overlaps (a communication thread)
    after      after backward (the global loss, the clip's norm, ZeRO's allgather)

What each strategy runs in one step of K micro-batches (strategies/*.py, step.py):

    every      the global loss: allreduce of 1 float64 over DP (auto)
    DDP's      (dp, zero 1) the reached flags: max-allreduce of 1 int32 per parameter tensor
    dp         each DDP bucket allreduced once, after the last micro-batch (--allreduce;
               auto on one machine: the buckets lie in a shared arena, "shm" from
               comm/auto.py's SHM_MIN up, auto's choice below it); with
               --compress, each bucket's compressor's calls instead (`compressor_calls`)
    zero 1     each bucket reduce-scattered (DDP's hook); the clip's norm: allreduce of 1
               float64 over DP; each bucket's chunks allgathered after the optimizer
    zero 2     the same segments (the buckets' cut), reduce-scattered by ShardedGradients
    zero 3     per micro-batch, each layer (unit) allgathered before its forward and again
               before its backward, its gradients reduce-scattered; the clip's norm; no
               allgather after the step
    tp         per micro-batch of N = b·T tokens (b examples), on the TP group: g forward
               (allreduce N·C) in the embedding and twice per block; f backward (N·C)
               twice per block and in the head; the vocab-parallel loss: allreduce max of
               N, allreduce sum of 2N; the clip's norm over TP (1 float64); with DP > 2
               (or --compress) the replicated parameters' gradients broadcast from TP rank 0
    tp, SP     --sequence-parallel (Korthikanti et al. 2022): each g a reduce-scatter of
               N·C along T and each f an allgather, forward, and each one's conjugate in
               backward (the embedding's reduce-scatter too: an allgather back); the loss's
               two allreduces as without; the replicated parameters' gradients, partial
               sums of this rank's T/p positions, allreduced over TP after the DP sync
               (make_alike) in place of the broadcast; with ZeRO, in its grad-ready hooks
               one by one, before their segment is reduced (each micro-batch at stage 3)
    cp         per micro-batch of b examples, t = T/C positions a rank, C' = n_embd/tp
               channels of its TP heads, on the CP group (parallel/context_parallel/):
               ring attention's point-to-point hops ("p2p", one message each) of a K/V
               block, 2 b t C' numbers: C-1 a block forward, 2C-1 backward (C-1 K/V and
               C dK/dV); or Ulysses' all-to-alls, per block q, k, v (3 b t C') and y
               (b t C') forward, their conjugates backward (`cp_attention`; a pipeline's
               stages: pp_step.py, the forward's again in backward with --recompute); the
               loss's sum over the group (allreduce of 1); after the DP sync every gradient
               summed over the group
    hybrid     tp's calls, and dp's (or zero's) over the DP axis on this rank's TP shard;
               with ZeRO the clip's norm is two float64 sums, over DP then TP, and with
               DP > 2 and a vocabulary TP does not divide, the replicated parameters are
               broadcast from TP rank 0 after the step (parallel/zero/over_tp.py)

Sizes come from `Shapes`: this rank's parameter tensors in the model's order (a TP shard
for tp and hybrid), the ZeRO-3 units, the GPT's tokens and channels. `gpt_shapes` makes
them for minidp's GPT from its configuration, without building it (pure Python);
`model_shapes` for any model a user built, from its parameters.
"""

import math
from typing import NamedTuple

from minidp.engine.units import units_of
from minidp.tools.chunks import chunk_bounds


class Call(NamedTuple):
    axis: str  # "dp", "tp", "pp", "cp" or "ep"
    collective: str
    algo: str
    n: int  # elements (the gathered whole for allgather, the whole vector for reduce_scatter)
    itemsize: int
    phase: str  # "forward", "backward" or "after"
    in_place: bool = False  # an allgather into the array that holds this rank's chunk
    ranks: int = 0  # the group's size, where not the axis's: an expert-DP group (experts.py)
    # collective "p2p": one point-to-point message of n elements (the ring's hops)


class Shapes(NamedTuple):
    """One rank's model as the collectives see it."""

    params: list[int]  # sizes of its parameter tensors, in model.parameters() order
    units: list[int]  # ZeRO-3: elements of each unit (layer), in forward order
    replicated: tuple = ()  # TP: sizes of the parameters every TP rank holds whole
    n_layer: int = 0  # TP: blocks (each block: 2 g forward, 2 f backward)
    n_embd: int = 0  # TP: channels C of the activations g and f reduce
    block_size: int = 0  # TP: tokens T per example
    vocab: int = 0  # TP: the vocabulary (hybrid ZeRO broadcasts when tp does not divide it)
    dims: tuple = ()  # the parameters' shapes, as params (PowerSGD factors each matrix)
    frozen: int = 0  # elements of frozen parameters: whole on every rank, never sent


def gpt_shapes(n_layer: int, n_embd: int, vocab: int, block_size: int, tp: int = 1, rank=0):
    """Shapes of minidp's GPT (nn.GPT, untied head) on TP rank `rank` of `tp` (tp 1: whole).

    Order as the model lists them: the one-process GPT wte, wpe, blocks, ln_f, head; the TP
    GPT wpe first, then wte's rows (parallel/tensor_parallel/gpt.py). Columns of qkv, fc and
    rows of proj, fc_proj are split evenly (tp divides heads and 4C), the vocabulary by
    chunk_bounds (it may not divide)."""
    C, V, T = n_embd, vocab, block_size
    bounds = chunk_bounds(V, tp)
    v = bounds[rank + 1] - bounds[rank]
    block = [(C,), (C,), (C, 3 * C // tp), (3 * C // tp,), (C // tp, C), (C,)]  # ln1, qkv, proj
    block += [(C,), (C,), (C, 4 * C // tp), (4 * C // tp,), (4 * C // tp, C), (C,)]  # ln2, MLP
    embeddings = [(v, C), (T, C)] if tp == 1 else [(T, C), (v, C)]
    dims = (*embeddings, *block * n_layer, (C,), (C,), (C, v))  # Linear weights: (in, out)
    params = [math.prod(d) for d in dims]
    units = [v * C, T * C, *[sum(map(math.prod, block))] * n_layer, 2 * C, C * v]
    # wpe; per block ln1 (w, b), proj's bias, ln2 (w, b), fc_proj's bias; ln_f (w, b)
    replicated = (T * C, *[C] * (6 * n_layer), C, C) if tp > 1 else ()
    return Shapes(params, units, replicated, n_layer, C, T, V, dims)


def model_shapes(model) -> Shapes:
    """Shapes of a model a user built (any minidp.nn.Module, tied and frozen parameters
    included), as the data-parallel pieces take it: its trainable parameters, each once, in
    parameters() order (DDP's buckets, ZeRO's segments, PowerSGD's matrices), and ZeRO-3's
    and FSDP's units (minidp.engine.units.units_of); frozen ones are never sent, and every rank
    holds them whole (`frozen`, in memory's parameters). No TP terms: tensor parallelism is
    minidp's GPT's (`gpt_shapes`)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    units = [sum(p.size for p in params) for _, _, params in units_of(model)]
    frozen = sum(p.size for p in model.parameters() if not p.requires_grad)
    return Shapes([p.size for p in trainable], units, dims=tuple(p.shape for p in trainable),
                  frozen=frozen)  # fmt: skip


def bucket_members(params: list[int], cap_bytes: float, itemsize: int) -> list[list[int]]:
    """Indices into `params` of each DDP bucket (buckets.bucket_groups): parameters in
    reverse order, a new bucket when the next would pass the cap (never an empty one)."""
    members: list[list[int]] = []
    filled = 0
    for i in reversed(range(len(params))):
        if members and filled + params[i] * itemsize > cap_bytes:
            members.append([])
            filled = 0
        if not members:
            members.append([])
        members[-1].append(i)
        filled += params[i] * itemsize
    return members


def buckets(params: list[int], cap_bytes: float, itemsize: int) -> list[int]:
    """Elements of each DDP bucket (`bucket_members`)."""
    return [sum(params[i] for i in b) for b in bucket_members(params, cap_bytes, itemsize)]


LOSS = Call("dp", "allreduce", "auto", 1, 8, "after")  # the global loss, a float64 scalar
NORM = Call("dp", "allreduce", "auto", 1, 8, "after")  # ZeRO's clip: my chunks' squares


def data_parallel(layout, shapes: Shapes, itemsize: int) -> list[Call]:
    """The DP axis's calls (dp, zero 1-3; the hybrid's DP axis) for one step."""
    algo, stage, K = layout.algo, layout.zero_stage, layout.grad_accum
    cap = max(1, int(layout.bucket_mb * 2**20))
    segments = buckets(shapes.params, cap, itemsize)
    calls = [LOSS]
    if stage < 2:  # DDP's reached flags: one int32 per parameter, max-allreduced
        calls.append(Call("dp", "allreduce", "auto", len(shapes.params), 4, "after"))
    if stage == 0 and layout.compress != "none":  # the compressor's hook replaces the allreduce
        name, _, param = layout.compress.partition(":")
        chosen = algo if name in ("randomk", "powersgd") else "auto"  # theirs: --allreduce
        for members, n in zip(bucket_members(shapes.params, cap, itemsize), segments):
            if name == "powersgd":
                wire = powersgd_calls([shapes.dims[i] for i in members], param, itemsize)
            else:
                wire = compressor_calls(name, param, n, layout.dp, itemsize)
            calls += [Call("dp", c, chosen, m, size, "backward") for c, m, size in wire]
        return calls
    if stage == 0:  # on one machine auto's buckets lie in shared memory: comm/auto.py's rule
        from minidp.comm.auto import choose_shared  # the one copy of the rule (imports MPI)

        shared = algo == "auto" and layout.shm
        for n in segments:
            chosen = choose_shared(n * itemsize, layout.dp) if shared else algo
            calls.append(Call("dp", "allreduce", chosen, n, itemsize, "backward"))
        return calls
    hybrid = layout.strategy == "hybrid"  # ZeROOverTP: sharded and replicated squares
    calls.append(NORM._replace(n=2) if hybrid else NORM)
    if stage in (1, 2):
        calls += [Call("dp", "reduce_scatter", algo, n, itemsize, "backward") for n in segments]
        calls += [Call("dp", "allgather", algo, n, itemsize, "after", True) for n in segments]
        return calls
    for _ in range(K):  # stage 3: every micro-batch gathers and reduce-scatters every unit
        calls += [Call("dp", "allgather", algo, n, itemsize, "forward") for n in shapes.units]
        calls += [Call("dp", "allgather", algo, n, itemsize, "backward") for n in shapes.units]
        calls += [Call("dp", "reduce_scatter", algo, n, itemsize, "backward") for n in shapes.units]
    return calls


# ---- compression: the collectives each compressor calls (parallel/compression/*.py) ------------
GATHERED = ("topk", "sign", "sign-noef", "qsgd")
"""The compressors that allgather every rank's payload and decode each (base.gather_sum): their
decoding grows with p, where the others' (the casts' alltoall pieces, random-k's allreduce)
does not."""


def _number(name: str, param) -> float:
    """A compressor's PARAM (a number, or a spec's text); the caller fills in the default
    (compression/table.py's parse_compress does, from the class's keyword)."""
    if param in (None, ""):
        raise ValueError(f"{name} needs its PARAM here (parse_compress gives the default)")
    return float(param)


def compressor_calls(name: str, param, n: int, p: int, itemsize: int = 4) -> list:
    """[(collective, elements, itemsize)] of one round of compressor `name` (with its PARAM,
    if it takes one) on a bucket of n values on p ranks, exactly as the compressor sends
    them; allgathers' elements are the gathered whole (p payloads)."""
    if name == "none":
        return [("allreduce", n, itemsize)]
    if name in ("fp16", "bf16"):  # cast.py: alltoall of the 16-bit pieces, allgather of sums
        width = -(-n // p)
        return [("alltoall", p * width, 2), ("allgather", p * width, 2)]
    if name in ("topk", "randomk"):  # sparse.py: k = kept(n, density)
        k = min(n, max(1, math.ceil(_number(name, param) * n))) if n else 0
        if name == "randomk":  # shared random indices: only the values, allreduced
            return [("allreduce", k, itemsize)]
        return [("allgather", p * k, 4), ("allgather", p * k, itemsize)]  # int32 indices
    if name in ("sign", "sign-noef", "qsgd"):  # quant.py: packed bits, one scale, allgathered
        bits = (2 * int(_number(name, param))).bit_length() if name == "qsgd" else 1
        return [("allgather", p * -(-n * bits // 8), 1), ("allgather", p, itemsize)]
    raise ValueError(
        f"no wire model for compressor {name!r} (powersgd's factors depend on the shapes)"
    )


def powersgd_calls(dims: list[tuple], param, itemsize: int = 4) -> list:
    """[(collective, elements, itemsize)] of one PowerSGD round (lowrank.py) on a bucket of
    tensors of shapes `dims`: a tensor (n, ...) is the n x m matrix of its size, factored
    when (n + m)·r < n·m; the P factors (n·r each) in one allreduce, the Q factors (m·r) in
    a second, every other value in a third (each skipped when empty)."""
    r = int(_number("powersgd", param))
    p_side = q_side = plain = 0
    for shape in dims:
        size = math.prod(shape)
        n = shape[0] if len(shape) >= 2 else size
        m = size // n if n else 0
        if len(shape) >= 2 and (n + m) * r < n * m:
            p_side, q_side = p_side + n * r, q_side + m * r
        else:
            plain += size
    return [("allreduce", k, itemsize) for k in (p_side, q_side, plain) if k]


def tensor_parallel(layout, shapes: Shapes, itemsize: int, examples: int) -> list[Call]:
    """The TP axis's calls for one step: `examples` this rank computes on, in K micro-batches
    (each the chunk_range of its slice, so sizes may differ by one example)."""
    if layout.tp == 1:
        return []
    K, C = layout.grad_accum, shapes.n_embd
    T = shapes.block_size // layout.cp  # the positions this rank holds (all but with CP)
    regions = 1 + 2 * shapes.n_layer  # g: the embedding, two a block; f: two a block, the head
    calls = []
    bounds = chunk_bounds(examples, K)
    for k in range(K):
        N = (bounds[k + 1] - bounds[k]) * T
        if layout.sequence_parallel:  # each g a reduce-scatter along T, each f an allgather
            scatter = Call("tp", "reduce_scatter", "auto", N * C, itemsize, "forward")
            gather = scatter._replace(collective="allgather")
            calls += [scatter, gather] * regions
            backward = [c._replace(phase="backward") for c in (gather, scatter)]  # conjugates
            calls += backward * regions
        else:
            calls += [Call("tp", "allreduce", "auto", N * C, itemsize, "forward")] * regions
            calls += [Call("tp", "allreduce", "auto", N * C, itemsize, "backward")] * regions
        calls += [Call("tp", "allreduce", "auto", N, itemsize, "forward")]  # max over vocab
        calls += [Call("tp", "allreduce", "auto", 2 * N, itemsize, "forward")]  # sums, picked
    replicated = sum(shapes.replicated)
    if layout.zero_stage == 0:
        calls.append(Call("tp", "allreduce", "auto", 1, 8, "after"))  # the clip's norm
        if layout.sequence_parallel:  # make_alike: the partial sums of T/p positions, summed
            calls.append(Call("tp", "allreduce", "auto", replicated, itemsize, "after"))
        elif layout.dp > 2 or layout.compress != "none":  # make_alike: TP rank 0's
            calls.append(Call("tp", "broadcast", "auto", replicated, itemsize, "after"))
        return calls
    if layout.sequence_parallel:  # ZeROOverTP's hooks: each replicated gradient summed, on
        sums = K if layout.zero_stage == 3 else 1  # the last micro-batch (stage 3: on each)
        calls += [
            Call("tp", "allreduce", "auto", n, itemsize, "backward") for n in shapes.replicated
        ] * sums
    calls.append(Call("tp", "allreduce", "auto", 2, 8, "after"))  # the norm's two sums
    if layout.dp > 2 and shapes.vocab % layout.tp:  # the drift broadcast (check_drift)
        calls.append(Call("tp", "broadcast", "auto", replicated, itemsize, "after"))
    return calls


def cp_attention(layout, tokens: int, width: int, itemsize: int, recompute=False):
    """(forward, backward) CP calls of one block's attention on one micro-batch: `tokens`
    = b·t rows of this rank, `width` = C' channels of its TP heads (the module docstring);
    `recompute`: the forward's calls again in backward (a checkpointed block, --recompute)."""
    C = layout.cp
    if layout.cp_algo == "ring":  # a K/V block a hop
        hop = Call("cp", "p2p", "ring", 2 * tokens * width, itemsize, "forward")
        forward, backward = [hop] * (C - 1), [hop._replace(phase="backward")] * (2 * C - 1)
    else:  # q, k, v to the head split and y back; backward the conjugates
        qkv = Call("cp", "alltoall", "auto", 3 * tokens * width, itemsize, "forward")
        forward = [qkv, qkv._replace(n=tokens * width)]
        backward = [c._replace(phase="backward") for c in reversed(forward)]
    again = [c._replace(phase="backward") for c in forward] if recompute else []
    return forward, again + backward


def context_parallel(layout, shapes: Shapes, itemsize: int, examples: int) -> list[Call]:
    """The CP axis's calls for one step (see the module docstring): `examples` this rank's
    DP coordinate reads, in K micro-batches."""
    if layout.cp == 1:
        return []
    t, width = shapes.block_size // layout.cp, shapes.n_embd // layout.tp  # my rows, C'
    calls = []
    bounds = chunk_bounds(examples, layout.grad_accum)
    for k in range(layout.grad_accum):
        forward, backward = cp_attention(layout, (bounds[k + 1] - bounds[k]) * t, width, itemsize)
        calls += (forward + backward) * shapes.n_layer
        calls.append(Call("cp", "allreduce", "auto", 1, itemsize, "forward"))  # the loss
    calls += [Call("cp", "allreduce", "auto", n, itemsize, "after") for n in shapes.params]
    return calls
