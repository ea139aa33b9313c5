# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 09 · Pipeline parallelism: split the layers, stream the micro-batches
#
# Launch line:
#
# mpiexec -n 4 python tutorials/09_pipeline.py
#
# Data parallelism copies the model, tensor parallelism splits each layer; pipeline
# parallelism (GPipe, Huang et al. 2019) cuts the model between layers: rank s runs stage s,
# sends its activations to stage s + 1, and receives their gradient back. One batch at a
# time, every rank but one would wait, so the batch is cut into m micro-batches that stream
# through the stages; the order of who computes what, when, is the *schedule*. On a model
# of our own (eight layers in a list), we build a two-stage pipeline by hand, then with
# `split_model` and `PipelineStage`; write 1F1B's loop and its messages by hand and check
# it bit for bit against the library's; then run GPipe, 1F1B, interleaved 1F1B and zero
# bubble H1 as minidp writes them: per rank, a list of actions, simulated for the bubble
# and the memory (a picture each), then executed on real stages. Every run is checked
# against one process in float64.

# %%
import os
import tempfile

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.comm import p2p
from minidp.parallel import PipelineStage, run_schedule, split_batch
from minidp.parallel.pipeline.diagram import grid, time_diagram
from minidp.parallel.pipeline.schedules import build_schedule
from minidp.parallel.pipeline.simulate import (
    formula_bubble,
    formula_peak_first_rank,
    simulate,
    summary,
)
from minidp.parallel.pipeline.split import split_model
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # 4 ranks on a few cores: one BLAS thread each, or they fight
world = comm.world()
rank, P = world.rank, world.size  # 4 ranks: a pipeline of up to 4 stages
HIDDEN = 24  # the width between layers: every message is (micro-batch rows, HIDDEN)
SIZES = [32] + [HIDDEN] * 7 + [10]  # 8 layers: 2 a stage on 4 stages, 1 a stage on 8
BATCH = 16  # examples a step; m micro-batches of BATCH / m
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
X, Y = x_all[:BATCH], y_all[:BATCH]


class Layer(nn.Module):
    """One layer of our model: relu(x W + b), the last without the ReLU (its class scores)."""

    def __init__(self, n_in: int, n_out: int, last: bool, rng):
        self.fc, self.last = nn.Linear(n_in, n_out, rng=rng, dtype=np.float64), last

    def forward(self, x) -> Tensor:
        return self.fc(x, relu=not self.last)


def new_model() -> list[Layer]:
    """Our model: 8 layers run in order (a sequential model, as torch.nn.Sequential holds
    one); the same float64 weights on every rank (the same seed)."""
    rng, n = np.random.default_rng(0), len(SIZES) - 1
    return [Layer(SIZES[i], SIZES[i + 1], i == n - 1, rng) for i in range(n)]


def one_process(x, y):
    """The reference: the whole model (split_model's one part), the whole batch."""
    whole = split_model(new_model(), 1)[0]  # runs the 8 layers in order
    cross_entropy(whole(Tensor(x)), y).backward()
    return whole


def assert_grads_equal(named, ref) -> None:
    """Each (name, parameter) of a part has the whole model's gradient of that name."""
    want = dict(ref.named_parameters())
    for name, p in named:
        np.testing.assert_allclose(p.grad, want[name].grad, rtol=1e-10, atol=1e-13)


ref = one_process(X, Y)
ref_loss = cross_entropy(ref(Tensor(X)), Y).item()

# %% [markdown]
# ## 1. Two stages by hand
# Rank 0 holds the first four layers, rank 1 the last four. Forward: rank 0 computes h and
# sends it; rank 1 receives it as a leaf x, finishes the model and the loss. Backward: rank 1
# backpropagates down to x and sends dL/dx back; rank 0 starts its own backward from h with
# that gradient as the seed, `h.backward(dL/dh)`. Ranks 2 and 3 sit this one out.

# %%
pair = world.subgroup([0, 1])  # None on ranks 2 and 3
model = new_model()
half = len(model) // 2
if pair is not None:
    if pair.rank == 0:
        h = Tensor(X)
        for layer in model[:half]:
            h = layer(h)
        p2p.send(pair, h.data, 1)  # activations forward
        dh = np.empty_like(h.data)
        p2p.recv(pair, dh, 1)  # their gradient back
        h.backward(dh)
    else:
        buf = np.empty((BATCH, SIZES[half]))
        p2p.recv(pair, buf, 0)
        x = Tensor(buf, requires_grad=True)  # a leaf: backward stops here
        out = x
        for layer in model[half:]:
            out = layer(out)
        loss = cross_entropy(out, Y)
        loss.backward()
        p2p.send(pair, np.ascontiguousarray(x.grad), 0)
        assert np.isclose(loss.item(), ref_loss, rtol=1e-12)
    whole = split_model(model, 1)[0]  # the whole list, its parameters named
    mine = [(name, p) for name, p in whole.named_parameters() if p.grad is not None]
    assert len(mine) == 2 * half  # this rank's half only: a weight and a bias a layer
    assert_grads_equal(mine, ref)
    print0(f"by hand: rank 0 sent h {(BATCH, SIZES[half])}, got dL/dh back; equal to one process")

# %% [markdown]
# The same with the pieces. `split_model` cuts our own model (a list of modules run in
# order, as torch.nn.Sequential holds them; or an nn.MLP, or a GPT) into parts: its own
# modules, not copies, named by their place in the whole list ("4.fc.weight"). A
# `PipelineStage` runs one part and does the sends and receives itself, as autograd ops
# (communications.py): the backward of "receive the activations" is "send their gradient".
# `forward(micro_batch, ...)` takes the inputs on the first stage and the targets on the
# last; `backward(micro_batch)` is the whole backward of that micro-batch.

# %%
if pair is not None:
    for layer in model:
        layer.zero_grad()
    part = split_model(model, 2)[pair.rank]
    stage = PipelineStage(part, pair.rank, 2, pair)
    stage.forward(0, inputs=X if stage.is_first else None, targets=Y if stage.is_last else None)
    stage.backward(0)
    stage.wait_sends()
    assert_grads_equal(part.named_parameters(), ref)
    names = [name for name, _ in part.named_parameters()]
    print0(f"split_model + PipelineStage: stage 0 holds {names[0]} .. {names[-1]}; equal")
    pair.free()

# %% [markdown]
# ## 2. Micro-batches and the bubble: GPipe
# A schedule is data: per rank, the list of what it computes. `sFj` is stage s's forward of
# micro-batch j, `sBj` its backward. GPipe runs every forward, then every backward. The
# simulator (simulate.py) times the lists in unit time (F = B = 1, messages free); the grid
# prints a `.` where a rank idles. That idle time is the *bubble*: with p stages and m
# micro-batches, (p−1)/(m+p−1) of the run. More micro-batches shrink it. Each schedule below
# also gets its picture: a PNG of the same timeline, titled with these assumptions, drawn by
# rank 0 at the end (section 6), when the other ranks are done and leave it the cores.


# %%
def timeline(schedule):
    """The schedule's compute lists, timed by the simulator."""
    return simulate(
        schedule.compute_actions(), schedule.pp, schedule.num_stages, schedule.split_backward
    )


pictures = []  # (name, schedule, units): drawn in section 6


def picture(name: str, schedule, units: str = "F = B = 1") -> None:
    pictures.append((name, schedule, units))


gpipe = build_schedule("gpipe", P, 4)
print0(f"{gpipe}\n{grid(timeline(gpipe))}")
print0(" m  bubble (simulated)  (p-1)/(m+p-1)")
for m in (1, 2, 4, 8):
    row = summary(build_schedule("gpipe", P, m))
    print0(f"{m:2d}  {row['bubble_fraction']:.4f}              {(P - 1) / (m + P - 1):.4f}")
    assert np.isclose(row["bubble_fraction"], (P - 1) / (m + P - 1), rtol=0, atol=1e-12)
picture("GPipe", gpipe)

# %% [markdown]
# ## 3. 1F1B and its memory
# GPipe's stage s holds the activations of all m micro-batches before its first backward.
# 1F1B (PipeDream-Flush, Narayanan et al. 2021) runs p − 1 − s warm-up forwards, then one
# forward, one backward: the same bubble, but stage s holds at most p − s micro-batches.

# %%
M = 8
schedules = {name: build_schedule(name, P, M) for name in ("gpipe", "1f1b")}
print0(f"{schedules['1f1b']}\n{grid(timeline(schedules['1f1b']))}")
simulated_peaks = {name: timeline(s).peak_activations for name, s in schedules.items()}
assert simulated_peaks["gpipe"] == {s: M for s in range(P)}  # GPipe: m
assert simulated_peaks["1f1b"] == {s: P - s for s in range(P)}  # 1F1B: p − s
bubbles = {name: summary(s)["bubble_fraction"] for name, s in schedules.items()}
print0(f"bubble at m = {M}: GPipe {bubbles['gpipe']:.4f}, 1F1B {bubbles['1f1b']:.4f}")
assert bubbles["gpipe"] == bubbles["1f1b"] == (P - 1) / (M + P - 1)
picture("1F1B", schedules["1f1b"])

# %% [markdown]
# ### 1F1B by hand
# The loop each rank runs, written out as picotron's `train_step_pipeline_1f1b`: stage s
# (= this rank) runs p − 1 − s warm-up forwards, then one forward and one backward until
# every forward is done, then the backwards left (the cool-down). `held` keeps each
# micro-batch's input and output from its forward to its backward, oldest first.
#
# The messages' order is what keeps it from deadlocking. In the steady state stage s sends
# micro-batch j's activations to s + 1 and then needs its gradient back, while s + 1, done
# with a backward, sends a gradient to s and then needs the next activations. Two blocking
# sends facing each other wait forever (MPI may hold a large send until it is received), so
# each pair goes as one `sendrecv`: both halves posted at once. `exchange` is that call; a
# peer outside the pipeline (stage 0's upstream, the last stage's downstream) drops a half.
# Every message here is one micro-batch's (rows, HIDDEN) activations or their gradient.


# %%
def exchange(data=None, send_to=None, receive_from=None):
    """Send `data` to rank send_to and receive from rank receive_from, as one sendrecv when
    both happen; a peer that is None or outside 0..P-1 drops its half. Returns what came."""
    got = None
    if receive_from is not None and 0 <= receive_from < P:
        got = np.empty((BATCH // M, HIDDEN))
    if data is not None and send_to is not None and 0 <= send_to < P:
        if got is None:
            p2p.send(world, np.ascontiguousarray(data), send_to)
        else:
            p2p.sendrecv(world, np.ascontiguousarray(data), send_to, got, receive_from)
    elif got is not None:
        p2p.recv(world, got, receive_from)
    return got


def one_f_one_b_by_hand(part, xs, ys, shares) -> int:
    """1F1B on this rank's stage s = rank; returns the most micro-batches it held at once."""
    s, m, held, peak = rank, len(xs), [], 0

    def forward(j, x):  # x: the received activations (None on stage 0: its inputs)
        nonlocal peak
        x = Tensor(xs[j]) if x is None else Tensor(x, requires_grad=True)
        y = part(x)
        y = cross_entropy(y, ys[j]) * shares[j] if s == P - 1 else y  # last: weighted loss
        held.append((x, y))
        peak = max(peak, len(held))
        return y

    def backward(dy):  # dy None on the last stage: start from its loss
        x, y = held.pop(0)  # the oldest micro-batch in flight
        y.backward(dy)
        return x.grad  # None on stage 0

    warmup = min(P - 1 - s, m)
    for j in range(warmup):  # warm-up: forwards only
        exchange(forward(j, exchange(receive_from=s - 1)).data, send_to=s + 1)
    x = exchange(receive_from=s - 1)
    for j in range(warmup, m):  # steady: forward j, then the oldest backward
        y = forward(j, x)
        dy = exchange(y.data, send_to=s + 1, receive_from=s + 1)  # out and in: one sendrecv
        x = exchange(backward(dy), send_to=s - 1, receive_from=s - 1 if j < m - 1 else None)
    for _ in range(warmup):  # cool-down: the backwards left
        exchange(backward(exchange(receive_from=s + 1)), send_to=s - 1)
    return peak


hand = new_model()
part = split_model(hand, P)[rank]  # this rank's stage: 2 of the 8 layers
hand_peak = one_f_one_b_by_hand(part, *split_batch(X, Y, M))
assert hand_peak == P - rank  # p − s: the warm-up's forwards and one more
assert_grads_equal(part.named_parameters(), ref)
print0(f"1F1B by hand: equal to one process; stage 0 held at most {hand_peak} micro-batches")

# %% [markdown]
# Now the library's. `schedule.actions()` gives each rank's list *lowered*: the sends and
# receives added, in an order that cannot deadlock, validated and dry-run (its sends never
# block, so it needs no sendrecv). The executor, `run_schedule`
# (minidp/parallel/pipeline/executor.py), walks this rank's list in order, and nothing else
# decides what runs when:
#
#     action   the stage's call                  with schedule.split_backward
#     sFj      stages[s].forward(j, ...)         the same
#     sBj      stages[s].backward(j)             stages[s].backward_input(j): dL/d(input) only
#     sWj      -                                 stages[s].backward_weight(j): what B left
#     SEND_*   nothing: forward and backward send themselves
#     RECV_*   wait until the message is here (idle time, between the compute spans)
#
# It takes the step's micro-batches as lists (`split_batch` cuts them) and returns the last
# stage's losses on its rank, [] elsewhere. Its 1F1B gives our loop's gradients bit for bit.


# %%
def pipeline_step(schedule, model, x, y):
    """One step of `schedule` on `model` over the world: this rank's stages, its actions in
    order. Returns the stages (stage index -> PipelineStage), the step's loss and what
    run_schedule returned (the losses, with the rank's peaks)."""
    S = schedule.num_stages
    parts = split_model(model, S)
    stages = {s: PipelineStage(parts[s], s, S, world) for s in schedule.stages_of(rank)}
    xs, ys, shares = split_batch(x, y, schedule.micro_batches)
    result = run_schedule(schedule, stages, xs, ys, shares)
    loss = comm.broadcast(np.array([sum(result, 0.0)]), root=schedule.stage_rank(S - 1))[0]
    return stages, loss, result


def measured_peaks(stages, num_stages) -> dict[int, int]:
    """stage -> the most micro-batches it held at once, gathered from every rank."""
    peaks = np.zeros(num_stages, np.int64)
    for s, stage in stages.items():
        peaks[s] = stage.peak_in_flight
    return dict(enumerate(comm.allreduce(peaks).tolist()))


for name, schedule in schedules.items():
    stages, loss, _ = pipeline_step(schedule, new_model(), X, Y)
    for stage in stages.values():
        assert_grads_equal(stage.module.named_parameters(), ref)
    peaks = measured_peaks(stages, schedule.num_stages)
    print0(f"{name} on real stages: loss {loss:.12f}, micro-batches held per stage {peaks}")
    assert peaks == simulated_peaks[name]
    assert np.isclose(loss, ref_loss, rtol=1e-10)
library = stages[rank].module.parameters()  # the last loop's: 1F1B
assert all(np.array_equal(p.grad, q.grad) for p, q in zip(part.parameters(), library))
print0("1F1B by hand == the library's 1F1B, bit for bit")

# %% [markdown]
# ## 4. Interleaving: V stages per rank
# Cut the model into V·p stages and give rank r the stages r, r + p, ... (Megatron-LM's
# interleaved 1F1B): each stage is 1/V of a rank's work, so the pipeline fills and drains V
# times faster and the bubble shrinks to (p−1)/(V·m+p−1), for V times more messages and a
# longer warm-up (the first ranks hold more micro-batches, each of half their layers). Here
# V = 2: 8 stages of one Linear each, rank 0 holding stages 0 and 4; the same executor runs
# them. A rank's stages may peak at different times, so the rank holds at most the sum of its
# stages' peaks: `run_schedule`'s result carries the rank's own peak, what its memory must
# hold. At p = 2, m = 4 (simulated below), rank 0's stages 0 and 2 peak at 4 and 2, the rank
# at 5. At p = 4, m = 4 (run below) the warm-up is the whole forward: rank 0 runs all four
# micro-batches through both its stages before its first backward, so it holds V·m = 8,
# Megatron's min(V·m, V·p + p − 1).

# %%
V = 2
interleaved = build_schedule("interleaved", P, 4, virtual=V)
print0(f"{interleaved}\n{grid(timeline(interleaved))}")
picture("Interleaved", interleaved, units="F = B = 1 a stage, each 1/V of a rank's layers")
print0(" m  1F1B    interleaved  (p-1)/(V*m+p-1)")
for m in (4, 8):
    row = summary(build_schedule("interleaved", P, m, virtual=V))
    plain = summary(build_schedule("1f1b", P, m))["bubble_fraction"]
    want = formula_bubble("interleaved", P, m, V)
    print0(f"{m:2d}  {plain:.4f}  {row['bubble_fraction']:.4f}       {want:.4f}")
    assert np.isclose(row["bubble_fraction"], (P - 1) / (V * m + P - 1), rtol=0, atol=1e-12)
    assert row["bubble_fraction"] < plain
small = build_schedule("interleaved", 2, 4, virtual=V)  # p = 2, m = 4: simulated only
small_stages = timeline(small).peak_activations
small_rank0 = summary(small)["peak_activations_per_rank"][0]
assert (small_stages[0], small_stages[2], small_rank0) == (4, 2, 5)
print0(f"p = 2, m = 4: rank 0's stages 0 and 2 peak at {small_stages[0]} and "
       f"{small_stages[2]} micro-batches, not at once: the rank at {small_rank0}")  # fmt: skip
stages, loss, result = pipeline_step(interleaved, new_model(), X, Y)  # 2 stages a rank
for stage in stages.values():
    assert_grads_equal(stage.module.named_parameters(), ref)
peaks = measured_peaks(stages, interleaved.num_stages)
assert peaks == timeline(interleaved).peak_activations
rank_peak = summary(interleaved)["peak_activations_per_rank"][rank]
assert result.peak_in_flight == rank_peak <= sum(peaks[s] for s in stages)
if rank == 0:
    assert rank_peak == V * 4 == formula_peak_first_rank("interleaved", P, 4, V)
print0(f"p = {P}, m = 4: rank 0 holds at most {rank_peak} micro-batches (its stages: "
       f"{sorted(stages)}, V·m); equal to one process")  # fmt: skip
print0(f"micro-batches held per stage (simulated = measured): {peaks}")

# %% [markdown]
# ## 5. Zero bubble H1: backward as B and W
# A layer y = x W has two gradients, and only one is on the critical path: B, dL/dx =
# dL/dy Wᵀ, which the previous stage waits for, and W, dL/dW = xᵀ dL/dy, which nobody
# waits for (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024). ZB-H1 runs 1F1B with
# B alone, and slips the deferred W's into what were bubbles. With F = 1, B = W = 1/2 the
# bubble is (p−1)/(2m+p−1) instead of (p−1)/(m+p−1); each column of the grid is half a unit.

# %%
zb = build_schedule("zb-h1", P, 4)
print0(f"{zb}\n{grid(timeline(zb))}")
print0(" m  1F1B    ZB-H1   (p-1)/(2m+p-1)")
for m in (4, 8):
    row = summary(build_schedule("zb-h1", P, m))
    plain = summary(build_schedule("1f1b", P, m))["bubble_fraction"]
    print0(f"{m:2d}  {plain:.4f}  {row['bubble_fraction']:.4f}  {(P - 1) / (2 * m + P - 1):.4f}")
    assert np.isclose(row["bubble_fraction"], (P - 1) / (2 * m + P - 1), rtol=0, atol=1e-12)
picture("ZB-H1", zb, units="F = 1, B = W = 1/2")

# %% [markdown]
# B then W is the whole backward: `stage.backward_input` leaves each Linear's weight gradient
# uncomputed (its two factors, x and dL/dy), `stage.backward_weight` multiplies them into
# .grad. Run by the same executor, ZB-H1's gradients equal 1F1B's full backward's and one
# process's. Memory: a micro-batch counts as held until its W, by the simulator and by the
# stage's `peak_in_flight` alike: p on every stage, 1F1B's stage 0 peak. What it holds shrinks
# at B, though: the graph is freed, and only the factors B kept for W stay (`held_bytes`).

# %%
zb = build_schedule("zb-h1", P, M)
zb_stages, _, _ = pipeline_step(zb, new_model(), X, Y)
full_stages, _, _ = pipeline_step(schedules["1f1b"], new_model(), X, Y)
for s, stage in zb_stages.items():
    assert_grads_equal(stage.module.named_parameters(), ref)
    for p, q in zip(stage.parameters(), full_stages[s].parameters()):
        np.testing.assert_allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15)
assert timeline(zb).peak_activations == {s: P for s in range(P)}
held = measured_peaks(zb_stages, P)
assert held == timeline(zb).peak_activations  # measured = simulated: p on every stage
print0(f"ZB-H1: gradients equal 1F1B's and one process's; micro-batches held per stage {held}")

# %% [markdown]
# Training with it: a few AdamW steps of ZB-H1 on the 4 ranks, each rank stepping only its
# stage's parameters, against the whole model trained in one process.

# %%
model, whole = new_model(), split_model(new_model(), 1)[0]
mine = split_model(model, P)[rank].parameters()  # this rank's stage's
opt, whole_opt = optim.AdamW(mine, lr=1e-2), optim.AdamW(whole.parameters(), lr=1e-2)
for step in range(4):
    batch = slice(step * BATCH, (step + 1) * BATCH)
    for p in mine:
        p.grad = None
    _, loss, _ = pipeline_step(zb, model, x_all[batch], y_all[batch])
    opt.step()
    whole.zero_grad()
    want = cross_entropy(whole(Tensor(x_all[batch])), y_all[batch])
    want.backward()
    whole_opt.step()
    print0(f"step {step}: one process {want.item():.12f}, ZB-H1 pipeline {loss:.12f}")
    assert np.isclose(loss, want.item(), rtol=1e-10)
want = dict(whole.named_parameters())
for name, p in split_model(model, P)[rank].named_parameters():
    np.testing.assert_allclose(p.data, want[name].data, rtol=1e-10, atol=1e-13)
print0("all checks passed")

# %% [markdown]
# ## 6. The pictures
# One time diagram per schedule, from the simulator's timeline (the grids above, drawn):
# the idle gaps are the bubble, and the title says what the times assume.

# %%
if rank == 0:
    for name, schedule, units in pictures:
        t, v = timeline(schedule), getattr(schedule, "virtual", 1)
        shape = f"p = {schedule.pp}, m = {schedule.micro_batches}" + (f", V = {v}" if v > 1 else "")
        title = f"{name}, {shape}: bubble {t.bubble_fraction:.3f}\n({units}, messages take no time)"
        path = os.path.join(tempfile.gettempdir(), f"minidp_09_{name.lower()}.png")
        time_diagram(t, path, title=title)
