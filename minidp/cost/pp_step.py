"""The pipeline's step in the step model (minidp/cost/step.py): `--strategy pp` and
`--strategy hybrid --dp D --tp T --pp P [--cp C] [--zero-stage 1]`, the schedule's simulated
length with F, B, W times from the measured compute.

    from minidp.cost.pp_step import predict_pipeline
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
                as nothing), the rest divided by tp·cp. A split backward (zb-h1): B = W =
                half of it (simulate.py's)
    TP          with tp > 1 each action also runs its stage's TP allreduces of b_j·t·C
                (calls.tensor_parallel's, cut by stage): g in F, f in B; t = T/cp positions
    CP          with cp > 1 (StagesOverCP, mesh rank ((d·pp + p)·cp + c)·tp + t) each
                action also runs its stage's blocks' ring hops or Ulysses all-to-alls on
                b_j·t rows of C/tp channels (calls.cp_attention: forward in F, backward in B,
                the forward's again in B with --recompute), the last stage's F the loss's
                sum over CP (1 number)
    recompute   B also runs the blocks' share of F again (with tp, their g allreduces too);
                with zb-h1 B and W stay halves of the backward (the recomputed blocks' weight
                gradients are in fact computed in B: an approximation)
    messages    across a cut, per micro-batch: forward a 64-byte header and the activation
                (2α + (64 + n)β), backward the gradient (α + nβ), n = b_j·t·C·itemsize;
                the receiver's action starts that long after the sender's ended
    length      simulate.simulate with those durations and delays: the schedule's makespan,
                bubble included
    after       the step's collectives after the schedule: over pp the bubble's three
                1-float64 allreduces, the loss broadcast from the last stage, the clip's
                norm (with --grad-clip; over tp first when tp > 1), TP rank 0's replicated
                gradients broadcast when dp > 2; with cp > 1 each of its stages' gradients
                summed over CP; over dp calls.data_parallel's on this rank's stages
                (DDP's, or ZeRO-1's reduce-scatters, norm and allgathers)
                (DDP reduces once, after the last micro-batch: nothing hidden); the
                optimizer's measured time scaled to this rank's parameters

    step = (length + after) · stretch          stretch: ranks / cores, as step.py's
    exposed communication = step - rank's compute (the bubble's waits are in it, as the
                run's clock counts a receive's wait: communications.py)

Bytes by axis are exact, as the run's `bytes_sent_by_axis` counts them (tests/
test_cost_pipeline.py; with CP tests/test_cp_cli.py): the messages this rank's stages send,
the pp, tp, cp and dp collectives.
Memory: this rank's parameters, gradients and AdamW moments (ZeRO-1: about 1/dp of
them, chunk sizes rounded), and the schedule's peak
(simulate.peak_activations_per_rank) times one stage's activations of one micro-batch.
"""

from minidp import cost
from minidp.cost.calls import Call, Shapes, cp_attention, data_parallel
from minidp.cost.step import Compute, Layout, Network, Prediction, call_time
from minidp.parallel.pipeline.actions import B, F, W
from minidp.parallel.pipeline.schedules import build_schedule
from minidp.parallel.pipeline.simulate import peak_activations_per_rank, simulate
from minidp.tools.chunks import chunk_bounds
from minidp.tools.meter import AXES

HEADER_BYTES = 64  # communications._HEADER int64s, before each activation


def stage_params(gpt, num_stages: int, stage: int, tp: int = 1, t: int = 0) -> list[int]:
    """Sizes of stage `stage`'s parameter tensors on TP rank t of tp, in the part's order
    (split.GPTPart's): wte, wpe on the first, its blocks, ln_f and head on the last (the
    vocabulary cut by chunk_bounds, the blocks' columns and rows evenly, as gpt_shapes).
    gpt = (L, C, V, T)."""
    L, C, V, T = gpt
    bounds, vocab = chunk_bounds(L, num_stages), chunk_bounds(V, tp)
    v = vocab[t + 1] - vocab[t]
    block = [C, C, C * 3 * C // tp, 3 * C // tp, C * C // tp, C]
    block += [C, C, C * 4 * C // tp, 4 * C // tp, 4 * C * C // tp, C]
    sizes = [v * C, T * C] if stage == 0 else []
    sizes += block * (bounds[stage + 1] - bounds[stage])
    return sizes + ([C, C, C * v] if stage == num_stages - 1 else [])


def stage_replicated(gpt, num_stages: int, stage: int) -> int:
    """Elements of the stage's parameters every TP rank holds whole: wpe, the LayerNorms,
    the row-parallel biases (proj, fc_proj)."""
    L, C, _, T = gpt
    bounds = chunk_bounds(L, num_stages)
    first, last = stage == 0, stage == num_stages - 1
    return T * C * first + 6 * C * (bounds[stage + 1] - bounds[stage]) + 2 * C * last


def stage_tp_calls(layout: Layout, gpt, itemsize: int, stage: int, rows: int):
    """(forward, backward) TP calls of one stage on one micro-batch of `rows` examples
    (calls.tensor_parallel's, cut by stage): g in the embedding (first stage) and twice a
    block; the vocab-parallel loss's max and sums (last); f twice a block and in the head."""
    if layout.tp == 1:
        return [], []
    L, C, _, T = gpt
    S = layout.pp * layout.virtual
    bounds, N = chunk_bounds(L, S), rows * T // layout.cp  # the positions this rank holds
    blocks = bounds[stage + 1] - bounds[stage]
    first, last = stage == 0, stage == S - 1
    g = Call("tp", "allreduce", "auto", N * C, itemsize, "forward")
    forward = [g] * (first + 2 * blocks)
    if last:
        forward += [g._replace(n=N), g._replace(n=2 * N)]
    again = 2 * blocks if layout.recompute else 0  # a recomputed block's g, in backward
    backward = [g._replace(phase="backward")] * (2 * blocks + last + again)
    return forward, backward


def stage_cp_calls(layout: Layout, gpt, itemsize: int, stage: int, rows: int):
    """(forward, backward) CP calls of one stage on one micro-batch of `rows` examples
    (calls.context_parallel's, cut by stage: StagesOverCP's): each block's ring hops or
    Ulysses all-to-alls on its t = T/cp positions and C/tp channels (again in backward with
    --recompute); the last stage's loss summed over the group (1 number)."""
    if layout.cp == 1:
        return [], []
    L, C, _, T = gpt
    S = layout.pp * layout.virtual
    bounds = chunk_bounds(L, S)
    block = cp_attention(layout, rows * T // layout.cp, C // layout.tp, itemsize, layout.recompute)
    blocks = bounds[stage + 1] - bounds[stage]
    loss = [Call("cp", "allreduce", "auto", 1, itemsize, "forward")] * (stage == S - 1)
    return block[0] * blocks + loss, block[1] * blocks


def stage_calls(layout: Layout, gpt, itemsize: int, stage: int, rows: int):
    """(forward, backward) TP and CP calls of one stage on one micro-batch."""
    tp, cp = (f(layout, gpt, itemsize, stage, rows) for f in (stage_tp_calls, stage_cp_calls))
    return tp[0] + cp[0], tp[1] + cp[1]


def stage_weight(gpt, num_stages: int, stage: int) -> int:
    """The stage's matmul weights (what its compute is taken to scale with)."""
    L, C, V, _ = gpt
    bounds = chunk_bounds(L, num_stages)
    head = C * V if stage == num_stages - 1 else 0
    return 12 * C * C * (bounds[stage + 1] - bounds[stage]) + head


def _mesh(layout: Layout, rank: int):
    """(schedule, d, p, c, t) of mesh rank `rank` = ((d·pp + p)·cp + c)·tp + t (mesh.py's
    grid)."""
    schedule = build_schedule(layout.schedule, layout.pp, layout.micro_batches, layout.virtual)
    d, rest = divmod(rank // layout.tp, layout.pp * layout.cp)
    return schedule, d, *divmod(rest, layout.cp), rank % layout.tp


def micro_rows(layout: Layout, batch_size: int, d: int) -> list[int]:
    """Examples of each micro-batch of DP replica d (np.array_split's: the first longer)."""
    bounds = chunk_bounds(batch_size, layout.dp)
    rows = bounds[d + 1] - bounds[d]
    m = layout.micro_batches
    return [rows // m + (j < rows % m) for j in range(m)]


def after_calls(layout: Layout, gpt, itemsize: int, rank: int) -> list[Call]:
    """The step's collectives after the schedule, on pp, cp, tp and dp."""
    schedule, _, p, _, t = _mesh(layout, rank)
    S, tp = schedule.num_stages, layout.tp
    params = [n for s in schedule.stages_of(p) for n in stage_params(gpt, S, s, tp, t)]
    float64 = Call("pp", "allreduce", "auto", 1, 8, "after")
    calls = [float64] * 3 + [float64._replace(collective="broadcast")]  # bubble's; the loss
    zero = layout.zero_stage == 1  # ZeROOverTP: its norm is two sums, over dp then tp
    if layout.clip or zero:  # the norm: sharded squares over tp, then the stages' over pp
        calls += [float64._replace(axis="tp", n=1 + zero)] * (tp > 1) + [float64]
    replicated = sum(stage_replicated(gpt, S, s) for s in schedule.stages_of(p))
    if tp > 1 and layout.dp > 2 and (not zero or gpt[2] % tp):  # TP rank 0's replicated
        calls.append(Call("tp", "broadcast", "auto", replicated, itemsize, "after"))
    dp = data_parallel(layout._replace(strategy="hybrid"), Shapes(params, []), itemsize)
    if layout.cp > 1:  # before the DP sync: each gradient (a partial sum) summed over CP
        calls += [Call("cp", "allreduce", "auto", n, itemsize, "after") for n in params]
    return calls + dp


def bytes_by_axis(layout: Layout, gpt, itemsize: int, batch_size: int, rank=0) -> dict:
    """{axis: bytes} mesh rank `rank` sends in one step (every axis of AXES): exact."""
    schedule, d, p, c, t = _mesh(layout, rank)
    S, (_, C, _, T) = schedule.num_stages, gpt
    last = schedule.stage_rank(S - 1)
    sent = dict.fromkeys(AXES, 0)
    calls = after_calls(layout, gpt, itemsize, rank)
    for rows in micro_rows(layout, batch_size, d):
        n = rows * T // layout.cp * C * itemsize  # an activation: this rank's positions
        for s in schedule.stages_of(p):
            sent["pp"] += (HEADER_BYTES + n if s < S - 1 else 0) + (n if s > 0 else 0)
            calls += sum(stage_calls(layout, gpt, itemsize, s, rows), [])
    coordinate = {"dp": d, "pp": p, "cp": c, "tp": t}
    sizes = {"dp": layout.dp, "pp": layout.pp, "cp": layout.cp, "tp": layout.tp}
    for call in calls:
        size, me = sizes[call.axis], coordinate[call.axis]
        if call.collective == "broadcast" and call.axis == "pp":  # root: the last stage's
            me = (me - last) % size
        if call.collective == "p2p":  # a ring hop: one message
            sent[call.axis] += call.n * call.itemsize
        elif size > 1:
            sent[call.axis] += cost.sent(
                call.collective, call.algo, size, me, call.n, call.itemsize
            ).bytes
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
    schedule, d, p, _, t = _mesh(layout, rank)
    S, (_, C, _, T) = schedule.num_stages, gpt
    split, sizes = schedule.split_backward, {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp}
    sizes["cp"], T = layout.cp, T // layout.cp  # a rank's positions
    total = sum(stage_weight(gpt, S, s) for s in range(S))
    rows = micro_rows(layout, batch_size, d)

    def scale(action) -> float:  # the stage's share of micro-batch j's whole-model time
        b = rows[action.micro_batch] / compute.examples / (layout.tp * layout.cp)
        share = stage_weight(gpt, S, action.stage) / total
        return (compute.fixed + (1 - compute.fixed) * b) * share

    def tp_time(action) -> float:  # the stage's TP (g in F, f in B) and CP calls
        calls = stage_calls(layout, gpt, itemsize, action.stage, rows[action.micro_batch])
        mine = {F: calls[0], B: calls[1]}.get(action.kind, [])
        return sum(call_time(c, sizes[c.axis], net) for c in mine)

    def work(action) -> float:  # its computation alone
        if action.kind == F:
            return compute.forward_s * scale(action)
        seconds = compute.backward_s * scale(action) * (0.5 if split else 1.0)
        if layout.recompute and action.kind == B:  # the blocks' forward again
            blocks = stage_weight(gpt, S, action.stage) - (
                C * gpt[2] if action.stage == S - 1 else 0
            )
            seconds += (
                compute.forward_s * scale(action) * blocks / stage_weight(gpt, S, action.stage)
            )
        return seconds

    def duration(action) -> float:
        return work(action) + tp_time(action)

    def delay(need, action) -> float:
        n = rows[action.micro_batch] * T * C * itemsize
        if action.kind == F:
            return 2 * net.alpha + (HEADER_BYTES + n) * net.beta
        return net.alpha + n * net.beta

    compute_actions = schedule.compute_actions()
    timeline = simulate(compute_actions, layout.pp, S, split, duration, delay)
    mine = [a for _, _, a in timeline.rows[p]]
    forward = sum(work(a) for a in mine if a.kind == F)
    backward = sum(work(a) for a in mine if a.kind in (B, W))
    params = sum(n for s in schedule.stages_of(p) for n in stage_params(gpt, S, s, layout.tp, t))
    optimizer = compute.optimizer_s * params / compute.params
    after = sum(call_time(c, sizes[c.axis], net) for c in after_calls(layout, gpt, itemsize, rank))
    sends = sum(delay(None, a) for a in mine if a.kind == F and a.stage < S - 1)
    sends += sum(delay(None, a) for a in mine if a.kind == B and a.stage > 0)
    sends += sum(tp_time(a) for a in mine)
    world = layout.dp * layout.pp * layout.tp * layout.cp
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
            "optimizer": 2 * itemsize * params // (layout.dp if layout.zero_stage else 1),
            "activations_peak": peak * activations,
        },
        forward_s=forward * stretch,
        backward_s=backward * stretch,
        optimizer_s=optimizer * stretch,
    )
