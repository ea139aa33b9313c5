"""The pipeline's step in the step model (minidp/cost/step.py): `--strategy pp` and
`--strategy hybrid --dp D --pp P` (tp 1, no ZeRO), the schedule's simulated length with
F, B, W times from the measured compute.

    from minidp.parallel.pipeline.step_cost import predict_pipeline
    layout = Layout("pp", pp=2, schedule="1f1b", micro_batches=4)
    p = predict_pipeline(layout, gpt, compute, network, batch_size=16)  # gpt: (L, C, V, T)

One step on mesh rank `rank`, in the step model's terms:

    stages      split.py's cut: S = pp·V stages, the blocks by chunk_bounds, the embeddings
                on stage 0, ln_f and the head on the last; stage s on pp rank s % pp
    F, B, W     the measured forward and backward of the whole model (Compute, on
                `examples` examples) scaled to micro-batch j's b_j examples as step.py
                scales to a rank's (the fixed part whole, the rest times b_j / examples),
                times the stage's share of the model's matmul weights (12C² a block, C·V
                the head; the embeddings' lookups and the attention's T² products counted
                as nothing). A split backward (zb-h1): B = W = half of it (simulate.py's)
    messages    across a cut, per micro-batch: forward a 64-byte header and the activation
                (2α + (64 + n)β), backward the gradient (α + nβ), n = b_j·T·C·itemsize;
                the receiver's action starts that long after the sender's ended
    length      simulate.simulate with those durations and delays: the schedule's makespan,
                bubble included
    after       the step's collectives after the schedule: over pp the bubble's three
                1-float64 allreduces, the loss broadcast from the last stage, the clip's
                norm (with --grad-clip); over dp calls.data_parallel's on this rank's stages
                (DDP reduces once, after the last micro-batch: nothing hidden); the
                optimizer's measured time scaled to this rank's parameters

    step = (length + after) · stretch          stretch: ranks / cores, as step.py's
    exposed communication = step - rank's compute (the bubble's waits are in it, as the
                run's clock counts a receive's wait: communications.py)

Bytes by axis are exact, as the run's `bytes_sent_by_axis` counts them (tests/
test_cost_step.py): the messages this rank's stages send, the pp and dp collectives.
Memory: this rank's parameters, gradients and AdamW moments, and the schedule's peak
(simulate.peak_activations_per_rank) times one stage's activations of one micro-batch.
"""

from minidp import cost
from minidp.chunks import chunk_bounds
from minidp.cost.calls import Call, Shapes, data_parallel
from minidp.cost.step import Compute, Layout, Network, Prediction, call_time
from minidp.parallel.pipeline.actions import B, F, W
from minidp.parallel.pipeline.schedules import build_schedule
from minidp.parallel.pipeline.simulate import peak_activations_per_rank, simulate

HEADER_BYTES = 64  # communications._HEADER int64s, before each activation


def stage_params(gpt, num_stages: int, stage: int) -> list[int]:
    """Sizes of stage `stage`'s parameter tensors in the part's order (split.GPTPart's):
    wte, wpe on the first, its blocks, ln_f and head on the last. gpt = (L, C, V, T)."""
    L, C, V, T = gpt
    bounds = chunk_bounds(L, num_stages)
    block = [C, C, C * 3 * C, 3 * C, C * C, C, C, C, C * 4 * C, 4 * C, 4 * C * C, C]
    sizes = [V * C, T * C] if stage == 0 else []
    sizes += block * (bounds[stage + 1] - bounds[stage])
    return sizes + ([C, C, C * V] if stage == num_stages - 1 else [])


def stage_weight(gpt, num_stages: int, stage: int) -> int:
    """The stage's matmul weights (what its compute is taken to scale with)."""
    L, C, V, _ = gpt
    bounds = chunk_bounds(L, num_stages)
    head = C * V if stage == num_stages - 1 else 0
    return 12 * C * C * (bounds[stage + 1] - bounds[stage]) + head


def _mesh(layout: Layout, rank: int):
    """(schedule, d, p) of mesh rank `rank` = d·pp + p (tp 1)."""
    schedule = build_schedule(layout.schedule, layout.pp, layout.micro_batches, layout.virtual)
    d, p = divmod(rank, layout.pp)
    return schedule, d, p


def micro_rows(layout: Layout, batch_size: int, d: int) -> list[int]:
    """Examples of each micro-batch of DP replica d (np.array_split's: the first longer)."""
    bounds = chunk_bounds(batch_size, layout.dp)
    rows = bounds[d + 1] - bounds[d]
    m = layout.micro_batches
    return [rows // m + (j < rows % m) for j in range(m)]


def after_calls(layout: Layout, gpt, itemsize: int, rank: int) -> list[Call]:
    """The step's collectives after the schedule, on pp and on dp."""
    schedule, _, p = _mesh(layout, rank)
    params = [n for s in schedule.stages_of(p) for n in stage_params(gpt, schedule.num_stages, s)]
    float64 = Call("pp", "allreduce", "auto", 1, 8, "after")
    calls = [float64] * 3 + [float64._replace(collective="broadcast")]  # bubble's; the loss
    calls += [float64] if layout.clip else []
    dp = data_parallel(layout._replace(zero_stage=0), Shapes(params, []), itemsize)
    return calls + dp


def bytes_by_axis(layout: Layout, gpt, itemsize: int, batch_size: int, rank=0) -> dict:
    """{"dp", "tp", "pp": bytes} mesh rank `rank` sends in one step: exact."""
    schedule, d, p = _mesh(layout, rank)
    S, (_, C, _, T) = schedule.num_stages, gpt
    last = schedule.stage_rank(S - 1)
    sent = {"dp": 0, "tp": 0, "pp": 0}
    for rows in micro_rows(layout, batch_size, d):
        n = rows * T * C * itemsize
        for s in schedule.stages_of(p):
            sent["pp"] += (HEADER_BYTES + n if s < S - 1 else 0) + (n if s > 0 else 0)
    coordinate = {"dp": d, "pp": p}
    sizes = {"dp": layout.dp, "pp": layout.pp}
    for call in after_calls(layout, gpt, itemsize, rank):
        size, me = sizes[call.axis], coordinate[call.axis]
        if call.collective == "broadcast":  # root: the last stage's rank
            me = (me - last) % size
        if size > 1:
            c = cost.sent(call.collective, call.algo, size, me, call.n, call.itemsize)
            sent[call.axis] += c.bytes
    return sent


def predict_pipeline(
    layout: Layout,
    gpt,
    compute: Compute,
    net: Network,
    *,
    batch_size: int,
    itemsize: int = 4,
    activations: int = 0,
    rank: int = 0,
) -> Prediction:
    """The predicted step of mesh rank `rank` (the module docstring says each term);
    `activations`: one stage's activations of one micro-batch, in bytes."""
    schedule, d, p = _mesh(layout, rank)
    S, (_, C, _, T) = schedule.num_stages, gpt
    split = schedule.split_backward
    total = sum(stage_weight(gpt, S, s) for s in range(S))
    rows = micro_rows(layout, batch_size, d)

    def scale(action) -> float:  # the stage's share of micro-batch j's whole-model time
        b = rows[action.micro_batch] / compute.examples
        share = stage_weight(gpt, S, action.stage) / total
        return (compute.fixed + (1 - compute.fixed) * b) * share

    def duration(action) -> float:
        if action.kind == F:
            return compute.forward_s * scale(action)
        return compute.backward_s * scale(action) * (0.5 if split else 1.0)

    def delay(need, action) -> float:
        n = rows[action.micro_batch] * T * C * itemsize
        if action.kind == F:
            return 2 * net.alpha + (HEADER_BYTES + n) * net.beta
        return net.alpha + n * net.beta

    compute_actions = schedule.compute_actions()
    timeline = simulate(compute_actions, layout.pp, S, split, duration, delay)
    mine = [a for _, _, a in timeline.rows[p]]
    forward = sum(duration(a) for a in mine if a.kind == F)
    backward = sum(duration(a) for a in mine if a.kind in (B, W))
    params = sum(n for s in schedule.stages_of(p) for n in stage_params(gpt, S, s))
    optimizer = compute.optimizer_s * params / compute.params
    sizes = {"dp": layout.dp, "pp": layout.pp}
    after = sum(call_time(c, sizes[c.axis], net) for c in after_calls(layout, gpt, itemsize, rank))
    sends = sum(delay(None, a) for a in mine if a.kind == F and a.stage < S - 1)
    sends += sum(delay(None, a) for a in mine if a.kind == B and a.stage > 0)
    world = layout.dp * layout.pp
    stretch = max(1.0, world / net.cores) if net.cores else 1.0
    step = (timeline.length_ticks + optimizer + after) * stretch
    compute_s = (forward + backward + optimizer) * stretch
    peak = peak_activations_per_rank(compute_actions, split)[p]
    return Prediction(
        step_s=step,
        compute_s=compute_s,
        comm_s=(sends + after) * stretch,
        exposed_comm_s=step - compute_s,
        bytes_by_axis=bytes_by_axis(layout, gpt, itemsize, batch_size, rank),
        memory_bytes={
            "parameters": itemsize * params,
            "gradients": itemsize * params,
            "optimizer": 2 * itemsize * params,
            "activations_peak": peak * activations,
        },
        forward_s=forward * stretch,
        backward_s=backward * stretch,
        optimizer_s=optimizer * stretch,
    )
