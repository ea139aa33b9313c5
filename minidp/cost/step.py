"""A training step's predicted cost: time, compute and communication, bytes by axis, memory.

    from minidp.cost.step import Layout, Compute, Network, predict
    from minidp.cost.calls import gpt_shapes
    layout = Layout("hybrid", dp=2, tp=2)
    shapes = gpt_shapes(n_layer=2, n_embd=64, vocab=96, block_size=64, tp=2)
    compute = Compute(forward_s=0.010, backward_s=0.020, optimizer_s=0.002, examples=16,
                      params=116_480)
    p = predict(layout, shapes, compute, Network(alpha=1.4e-6, beta=5.9e-10, gamma=6.8e-10),
                batch_size=16)
    p.step_s, p.compute_s, p.comm_s, p.exposed_comm_s, p.bytes_by_axis, p.memory_bytes

Pure Python: no MPI, no model built (algo "auto" is resolved by minidp.comm.auto's table).

The model of one step on one rank, term by term:

    compute     forward + backward: the measured one-process times of `examples` examples;
                their part `Compute.fixed` (the ops' own cost: Python, NumPy calls) stays
                whole, the rest (the FLOPs) scales to this rank's examples (B / dp) and is
                divided by tp (each TP rank computes 1/tp of every matmul); optimizer: its
                measured time scaled to the parameters this rank steps (a TP shard, a chunk)
    comm        every collective of calls.py priced by minidp.cost.time with α, β, γ and δ
                (what a call copies in memory, cost.copied); "shm"
                (DDP's buckets in shared memory) has no α-β formula: its loads priced at β
                and its three synchronizations as three 2-rank barriers' worth of α per round
    overlap     backward-phase calls hide behind backward only when the strategy overlaps
                (Layout.overlap, DDP's and ZeRO 1-2's communication thread); exposed =
                max(0, backward comm - backward) + every other call
    compress    a compressor's own work (encoding, error feedback, decoding): Compute.
                compress_s, measured on a group of one (one payload decoded); the
                gathering ones (calls.GATHERED) decode p payloads, each priced as two
                passes over the bucket at γ (the decoded vector, and its addition)
    per call    minidp's own cost of a collective beyond its messages (the Python layer, the
                checks' fingerprint exchange, a peer not yet scheduled on shared cores):
                Network.per_call, measured by the run (cost/predict.py), 0 by default
    cores       ranks that outnumber the machine's cores share them: compute and
                communication both stretched by ranks / cores (Network.cores; 0: no limit)

    step = compute + exposed communication

Bytes by axis are exact for dp, zero 1-3, tp and hybrid, with --compress and with
--sequence-parallel too (the pipeline's: cost/pp_step.py): minidp.cost.sent
of every call, summed per axis, as the run's `bytes_sent_by_axis` counts them for rank
`rank` (tests/test_cost_step.py checks against real runs). A MoE GPT (Layout.experts:
ExpertParallel's calls, on a dp x tp mesh, cost/experts.py): the dp and tp bytes exact, the
ep bytes exact where its slots S are the capacity, a lower bound when dropless (the
routing decides S). Memory per
rank: the parameters, gradients and AdamW moments this rank holds (zero.py's table on this
rank's TP shard) and the activations estimate of memory.py (sequence parallelism splits its
LayerNorms' part).
"""

from typing import NamedTuple

from minidp import cost
from minidp.cost.calls import (
    GATHERED,
    Shapes,
    buckets,
    context_parallel,
    data_parallel,
    tensor_parallel,
)
from minidp.cost.experts import Experts, expert_parallel
from minidp.tools.chunks import chunk_bounds
from minidp.tools.meter import AXES


class Layout(NamedTuple):
    """The strategy and the mesh, as the train flags say them."""

    strategy: str  # dp, zero, tp, hybrid
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    grad_accum: int = 1  # micro-batches per step (K)
    overlap: bool = False  # the DP axis reduces during backward (a communication thread)
    algo: str = "auto"  # --allreduce
    bucket_mb: float = 0.25
    shm: bool = True  # every rank on one machine: DDP's "auto" reduces buckets by loads
    compress: str = "none"  # --compress NAME[:PARAM]: the DP buckets' compressor (calls.py)
    schedule: str = "1f1b"  # pp > 1: the pipeline's (cost/pp_step.py)
    micro_batches: int = 1
    virtual: int = 1
    clip: bool = True  # --grad-clip > 0 (the pipeline's norm is an allreduce over pp)
    servers: int = 0  # ps: the last `servers` ranks (cost/ps_step.py); dp is then W
    consistency: str = "bsp"  # ps: --consistency (bsp, asp or ssp:K)
    recompute: bool = False  # pp: every block runs its forward again in backward
    sequence_parallel: bool = False  # tp > 1: f and g as allgathers and reduce-scatters along T
    cp: int = 1  # context-parallel ranks: T/cp positions each (mesh rank (d·cp + c)·tp + t)
    cp_algo: str = "ring"  # --cp-algo: ring attention's hops or Ulysses' all-to-alls
    ep: int = 1  # expert-parallel ranks, carved out of the DP ranks (cost/experts.py)
    experts: Experts | None = None  # a MoE GPT under ExpertParallel: its calls replace DDP's


class Compute(NamedTuple):
    """Measured on one process: the whole model on `examples` examples, one step."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    examples: int  # the batch those times are for
    params: int  # parameters the optimizer stepped
    fixed: float = 0.0  # the part of forward and backward no split shortens (per-op cost)
    compress_s: float = 0.0  # --compress: its own work on every bucket, on a group of one


class Network(NamedTuple):
    alpha: float  # seconds per message
    beta: float  # seconds per byte sent
    gamma: float = 0.0  # seconds per byte reduced
    cores: int = 0  # cores the ranks share (0: each rank a core of its own)
    per_call: float = 0.0  # seconds each collective call adds beyond α β γ (measured)
    delta: float = 0.0  # seconds per byte copied in memory (an allgather's own chunk)

    def terms(self) -> dict:
        """α, β, γ, δ as minidp.cost.time takes them."""
        return {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma, "delta": self.delta}


class Prediction(NamedTuple):
    step_s: float
    compute_s: float
    comm_s: float  # every collective, hidden or not
    exposed_comm_s: float  # what adds to the step
    bytes_by_axis: dict  # {axis: bytes this rank sends per step}, every axis of meter.AXES
    memory_bytes: dict  # {"parameters", "gradients", "optimizer", "activations_peak"}
    forward_s: float
    backward_s: float
    optimizer_s: float
    compress_s: float = 0.0  # the compressor's own work, in compute_s


def fixed_part(whole: Compute, half: Compute) -> float:
    """The fraction of forward + backward that does not shrink with the work: with
    t(e) = fixed + e·w, two batches give fixed = (e·t(h) - h·t(e)) / (e - h), clamped to
    [0, 1] of t(e) (the two are noisy medians)."""
    e, h = whole.examples, half.examples
    t_e, t_h = whole.forward_s + whole.backward_s, half.forward_s + half.backward_s
    fixed = (e * t_h - h * t_e) / (e - h)
    return min(1.0, max(0.0, fixed / t_e))


def call_time(call, p: int, net: Network) -> float:
    """Seconds of one call on p ranks: its α-β-γ(-δ) time, and the per-call cost."""
    if p == 1:
        return 0.0
    if call.collective == "p2p":  # one message (a ring hop): no collective's per-call cost
        return net.alpha + call.n * call.itemsize * net.beta
    if call.algo == "shm":
        loaded = cost.sent("allreduce", "shm", p, 0, call.n, call.itemsize).bytes
        rounds = (p - 1).bit_length()
        t = 3 * 2 * rounds * net.alpha + loaded * net.beta + call.n * call.itemsize * net.gamma
    else:
        t = cost.time(
            call.collective, call.algo, p, call.n, call.itemsize, **net.terms(),
            in_place=call.in_place,
        ) or 0.0  # fmt: skip
    return t + net.per_call


def compressing(layout: Layout, shapes: Shapes, compute: Compute, net: Network, itemsize=4):
    """Seconds of the compressor's own work in one step: its measured work on a group of one,
    and for a gathering one the other p - 1 payloads decoded into each bucket."""
    name = layout.compress.partition(":")[0]
    if name not in GATHERED or layout.dp == 1:
        return compute.compress_s
    values = sum(shapes.params)  # every bucket's, once
    return compute.compress_s + (layout.dp - 1) * 2 * itemsize * values * net.gamma


def step_calls(layout: Layout, shapes: Shapes, itemsize: int, batch_size: int, dp_rank=0):
    """Every Call of one step on DP rank `dp_rank` (its examples: chunk_bounds of B)."""
    if layout.strategy not in ("dp", "zero", "tp", "hybrid") or layout.pp != 1:
        raise ValueError(
            f"the step model covers dp, zero, tp and hybrid without pp (the pipeline: "
            f"cost/pp_step.py); got "
            f"{layout.strategy} with pp {layout.pp}"
        )
    bounds = chunk_bounds(batch_size, layout.dp)
    examples = bounds[dp_rank + 1] - bounds[dp_rank]
    if layout.experts is not None:  # ExpertParallel (and TP's calls), not DDP: cp = 1
        return expert_parallel(layout, shapes, itemsize, examples)
    return (
        data_parallel(layout, shapes, itemsize)
        + tensor_parallel(layout, shapes, itemsize, examples)
        + context_parallel(layout, shapes, itemsize, examples)
    )


def bytes_by_axis(layout: Layout, shapes: Shapes, itemsize: int, batch_size: int, rank=0):
    """{axis: bytes} mesh rank `rank` ((d·cp + c)·tp + t) sends in one step: exact."""
    (d, c), t = divmod(rank // layout.tp, layout.cp), rank % layout.tp
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "ep": layout.ep}
    coordinate = {"dp": d, "tp": t, "pp": 0, "cp": c, "ep": d % layout.ep}
    sent = dict.fromkeys(AXES, 0)
    for call in step_calls(layout, shapes, itemsize, batch_size, d):
        p = call.ranks or sizes[call.axis]
        where = d // layout.ep if call.ranks else coordinate[call.axis]  # expert-DP: d // ep
        if call.collective == "p2p":
            sent[call.axis] += call.n * call.itemsize if p > 1 else 0
        elif p > 1:
            sent[call.axis] += cost.sent(
                call.collective, call.algo, p, where, call.n, call.itemsize
            ).bytes
    return sent


def memory(layout: Layout, shapes: Shapes, itemsize: int, activations: int, rank=0) -> dict:
    """Mesh rank `rank`'s model states (zero.py's table on its TP shard: a ZeRO rank's Ψ/N_d
    is its chunk of every segment) and activations, in bytes."""
    psi, n, stage = sum(shapes.params), layout.dp, layout.zero_stage
    d = rank // (layout.tp * layout.cp)
    if stage == 3:
        segments = shapes.units
    else:
        segments = buckets(shapes.params, max(1, int(layout.bucket_mb * 2**20)), itemsize)
    shard = sum(chunk_bounds(s, n)[d + 1] - chunk_bounds(s, n)[d] for s in segments)
    return {
        "parameters": itemsize * ((shard if stage == 3 else psi) + shapes.frozen),
        "gradients": itemsize * (shard if stage >= 2 else psi),
        "optimizer": 2 * itemsize * (shard if stage >= 1 else psi),  # AdamW: m and v
        "activations_peak": activations,
    }


def predict(
    layout: Layout,
    shapes: Shapes,
    compute: Compute,
    net: Network,
    *,
    batch_size: int,
    itemsize: int = 4,
    activations: int = 0,
    rank: int = 0,
) -> Prediction:
    """The predicted step of `layout` on mesh rank `rank` (`shapes`: its TP shard's): its
    calls timed, its bytes and memory, with rank 0's examples. The module docstring says each
    term."""
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "ep": layout.ep}
    world = layout.dp * layout.tp * layout.pp * layout.cp
    stretch = max(1.0, world / net.cores) if net.cores else 1.0
    examples = chunk_bounds(batch_size, layout.dp)[1]
    # of the FLOPs (CP: T/cp positions, and attention's causal half of T/cp x T: ~1/cp too);
    # the per-op part stays
    split = examples / compute.examples / (layout.tp * layout.cp)
    scale = compute.fixed + (1 - compute.fixed) * split
    forward, backward = compute.forward_s * scale, compute.backward_s * scale
    stepped = sum(shapes.params) / (layout.dp if layout.zero_stage else 1)
    optimizer = compute.optimizer_s * stepped / compute.params
    comm = hideable = 0.0  # hideable: the DP axis's reductions during backward
    for call in step_calls(layout, shapes, itemsize, batch_size):
        seconds = call_time(call, call.ranks or sizes[call.axis], net)
        comm += seconds
        if call.axis == "dp" and call.phase == "backward":
            hideable += seconds
    overlaps = layout.overlap and layout.zero_stage < 3  # stage 3 gathers inline
    hidden = min(hideable, backward) if overlaps else 0.0
    compress = compressing(layout, shapes, compute, net, itemsize)
    compute_s = (forward + backward + optimizer + compress) * stretch
    exposed = (comm - hidden) * stretch
    return Prediction(
        step_s=compute_s + exposed,
        compute_s=compute_s,
        comm_s=comm * stretch,
        exposed_comm_s=exposed,
        bytes_by_axis=bytes_by_axis(layout, shapes, itemsize, batch_size, rank),
        memory_bytes=memory(layout, shapes, itemsize, activations, rank),
        forward_s=forward * stretch,
        backward_s=backward * stretch,
        optimizer_s=optimizer * stretch,
        compress_s=compress * stretch,
    )
