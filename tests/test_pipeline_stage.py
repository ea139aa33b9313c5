"""PipelineStage against one process: a tiny float64 GPT (and an MLP) cut into stages,
trained a few steps by loops written here (GPipe; 1F1B by hand; forwards received out of
order; B then W), equals the whole model trained on the whole batch in one process: every
step's loss and the final parameters, to 1e-10. Frozen parameters never move. Bad
arguments raise errors that name them."""

from types import SimpleNamespace

import numpy as np
import pytest

from minidp import comm, cross_entropy, nn, optim
from minidp.parallel.pipeline.split import split_model
from minidp.parallel.pipeline.stage import PipelineStage

F64 = np.float64
STEPS, MICRO, BATCH = 3, 4, 8  # 8 examples a step, 4 micro-batches of 2


def tiny_gpt(n_layer: int) -> nn.GPT:
    cfg = nn.GPTConfig(vocab_size=11, block_size=6, n_layer=n_layer, n_head=2, n_embd=8)
    return nn.GPT(cfg, seed=3, dtype=F64)


def tiny_mlp(n_layers: int) -> nn.MLP:
    sizes = [5] + [7] * (n_layers - 1) + [3]
    return nn.MLP(sizes, rng=np.random.default_rng(3), dtype=F64)


def batches(model):
    """STEPS (inputs, targets) pairs of BATCH examples, the same on every rank."""
    rng = np.random.default_rng(11)
    if isinstance(model, nn.GPT):
        shape, classes = (BATCH, 6), 11
        return [(rng.integers(0, 11, shape), rng.integers(0, 11, shape)) for _ in range(STEPS)]
    classes = 3
    return [
        (rng.standard_normal((BATCH, 5)), rng.integers(0, classes, BATCH)) for _ in range(STEPS)
    ]


def freeze(model) -> list:
    """Freeze two parameters (one early, one late); return copies of them."""
    first, last = model.parameters()[0], model.parameters()[-1]
    for p in (first, last):
        p.requires_grad = False
    return [first.data.copy(), last.data.copy()]


def train_whole(model) -> list[float]:
    """The reference: one process, the whole batch, AdamW."""
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for inputs, targets in batches(model):
        model.zero_grad()
        loss = cross_entropy(model(inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def gpipe(stage, M):
    return [("F", mb) for mb in range(M)] + [("B", mb) for mb in reversed(range(M))]


def one_f_one_b(stage, M):
    """1F1B: S - s - 1 warm-up forwards, then one forward and one backward in turn."""
    warmup = min(stage.num_stages - stage.stage_index - 1, M)
    order = [("F", mb) for mb in range(warmup)]
    for i in range(M - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", mb) for mb in range(M - warmup, M)]


def scrambled(stage, M):
    """Forwards in reverse on every stage but the first, backwards in order: every message
    arrives in an order other than the one it is received in."""
    forwards = range(M) if stage.is_first else reversed(range(M))
    return [("F", mb) for mb in forwards] + [("B", mb) for mb in range(M)]


def split_b_w(stage, M):
    """Every forward, then every B (input gradients, sent at once), then every W."""
    return (
        gpipe(stage, M)[:M]
        + [("I", mb) for mb in reversed(range(M))]
        + [("W", mb) for mb in range(M)]
    )


def train_pipelined(model, num_stages: int, schedule, recompute=False) -> tuple[list, list]:
    """model cut into num_stages stages over the world (stage s on rank s % P), trained by
    running `schedule(stage, M)`'s actions."""
    group = comm.world()
    parts = split_model(model, num_stages, recompute=recompute)
    stages = [
        PipelineStage(parts[s], s, num_stages, group)
        for s in range(group.rank, num_stages, group.size)
    ]
    opt = optim.AdamW([p for st in stages for p in st.parameters()], lr=1e-2)
    losses = []
    for inputs, targets in batches(model):
        model.zero_grad()
        for stage in stages:
            stage.reset_peaks()
        micro_in, micro_t = np.split(inputs, MICRO), np.split(targets, MICRO)
        if len(stages) == 1:
            run(stages[0], schedule(stages[0], MICRO), micro_in, micro_t)
        else:  # several stages a rank (all forwards, then all backwards, schedules only):
            for stage in stages:  # every stage's forwards in stage order, then
                run(stage, [a for a in schedule(stage, MICRO) if a[0] == "F"], micro_in, micro_t)
            for stage in reversed(stages):  # every stage's backwards, last stage first
                run(stage, [a for a in schedule(stage, MICRO) if a[0] != "F"], micro_in, micro_t)
        for stage in stages:
            assert stage.in_flight == stage.held_bytes == 0 and not stage._weight_grads
            stage.wait_sends()
        opt.step()
        last = [sum(st.losses.values()) for st in stages if st.is_last]
        root = (num_stages - 1) % group.size
        losses.append(comm.broadcast(np.array(last or [0.0]), root=root)[0])
    return stages, losses


def run(stage, actions, micro_in, micro_t) -> None:
    """Call the stage's action for each (action, micro-batch): F, B, I (B alone) or W."""
    for action, mb in actions:
        if action == "F":
            stage.forward(
                mb,
                inputs=micro_in[mb] if stage.is_first else None,
                targets=micro_t[mb] if stage.is_last else None,
                share=1 / MICRO,
            )
        elif action == "B":
            stage.backward(mb)
        elif action == "I":
            stage.backward_input(mb)
        else:
            stage.backward_weight(mb)


def check_equal(make, num_stages, schedule, frozen=False):
    ref = make()
    ref_frozen = freeze(ref) if frozen else None
    want = train_whole(ref)
    model = make()
    got_frozen = freeze(model) if frozen else None
    stages, got = train_pipelined(model, num_stages, schedule)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=0)
    ref_parts = split_model(ref, num_stages)
    for stage in stages:
        for p, q in zip(stage.parameters(), ref_parts[stage.stage_index].parameters()):
            np.testing.assert_allclose(p.data, q.data, rtol=1e-10, atol=1e-12)
    if frozen:
        np.testing.assert_array_equal(model.parameters()[0].data, got_frozen[0])
        np.testing.assert_array_equal(model.parameters()[-1].data, got_frozen[1])
        np.testing.assert_array_equal(ref.parameters()[0].data, ref_frozen[0])
    return stages


# ---- two ranks ----------------------------------------------------------------------------
@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b, scrambled, split_b_w])
def test_gpt_two_stages_equals_one_process(schedule):
    stages = check_equal(lambda: tiny_gpt(2), 2, schedule)
    expected = {gpipe: MICRO, one_f_one_b: 2 - stages[0].stage_index}.get(schedule)
    if expected is not None:  # GPipe holds every micro-batch, 1F1B at most S - s
        assert stages[0].peak_in_flight == expected


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_two_stages_per_rank_and_frozen_parameters():
    check_equal(lambda: tiny_gpt(4), 4, gpipe, frozen=True)
    check_equal(lambda: tiny_mlp(4), 4, split_b_w, frozen=True)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_b_then_w_equals_full_backward():
    """The same micro-batches through backward and through B then W: the same gradients;
    after B alone the parameters have none (W is the whole weight gradient)."""
    group = comm.world()
    model = tiny_gpt(2)
    stage = PipelineStage(split_model(model, 2)[group.rank], group.rank, 2, group)
    inputs, targets = batches(model)[0]

    def forwards():
        for mb in range(2):
            stage.forward(
                mb,
                inputs=inputs[2 * mb : 2 * mb + 2] if stage.is_first else None,
                targets=targets[2 * mb : 2 * mb + 2] if stage.is_last else None,
            )

    forwards()
    for mb in (1, 0):
        stage.backward(mb)
    full = [p.grad.copy() for p in stage.parameters()]
    model.zero_grad()
    forwards()
    for mb in (1, 0):
        stage.backward_input(mb)
    assert all(p.grad is None for p in stage.parameters())
    assert stage.held_bytes > 0  # the factors W will multiply
    comm.barrier()  # every B is over on every stage: B sent its gradients without W
    for mb in (0, 1):
        stage.backward_weight(mb)
    for p, g in zip(stage.parameters(), full):
        np.testing.assert_allclose(p.grad, g, rtol=1e-12, atol=1e-15)
    stage.wait_sends()


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_held_activations_gpipe_against_1f1b():
    """GPipe holds all M micro-batches' activations at its peak, 1F1B at most S - s of them
    (the same bytes each: every micro-batch has one shape); all freed after the step."""
    group = comm.world()
    model = tiny_gpt(2)
    stage = PipelineStage(split_model(model, 2)[group.rank], group.rank, 2, group)
    inputs, targets = batches(model)[0]
    micro_in, micro_t = np.split(inputs, MICRO), np.split(targets, MICRO)
    peaks = {}
    for schedule in (gpipe, one_f_one_b):
        stage.reset_peaks()
        run(stage, schedule(stage, MICRO), micro_in, micro_t)
        stage.wait_sends()
        assert stage.in_flight == stage.held_bytes == 0
        peaks[schedule] = stage.peak_in_flight, stage.peak_bytes
    per_micro_batch = peaks[gpipe][1] // MICRO
    assert per_micro_batch > 0
    assert peaks[gpipe] == (MICRO, MICRO * per_micro_batch)
    s = stage.stage_index
    assert peaks[one_f_one_b] == (2 - s, (2 - s) * per_micro_batch)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_a_receive_nothing_matches_times_out_naming_the_peer():
    """Stage 1 waits for micro-batch 0, which stage 0 never sends: CollectiveTimeout within
    the group's timeout, naming rank 0, instead of a hang."""
    group = comm.world().dup()
    group.timeout = 0.5
    stage = PipelineStage(split_model(tiny_gpt(2), 2)[group.rank], group.rank, 2, group)
    error = None
    if stage.is_last:
        with pytest.raises(
            comm.CollectiveTimeout, match="heard nothing from rank\\(s\\) 0"
        ) as error:
            stage.forward(0, targets=np.zeros((2, 6), int))
        for request, _ in group.receiving.values():
            request.Cancel()  # what a collective's exit does after an error (group.py)
    assert comm.allreduce(np.array([error is not None], np.int64))[0] == 1


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_recomputation_gives_the_same_bits_and_holds_less():
    """Blocks recomputed in backward: the same losses and parameters, bit for bit, as the
    stages that keep everything; fewer bytes held at the peak. Split into B and W too."""
    plain, plain_losses = train_pipelined(tiny_gpt(2), 2, one_f_one_b)
    again, again_losses = train_pipelined(tiny_gpt(2), 2, one_f_one_b, recompute=True)
    assert again_losses == plain_losses
    for p, q in zip(plain[0].parameters(), again[0].parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    assert again[0].peak_in_flight == plain[0].peak_in_flight
    assert again[0].peak_bytes < plain[0].peak_bytes / 2
    split, split_losses = train_pipelined(tiny_gpt(2), 2, split_b_w, recompute=True)
    np.testing.assert_allclose(split_losses, plain_losses, rtol=1e-12)  # B and W too
    for p, q in zip(plain[0].parameters(), split[0].parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-10, atol=1e-12)


# ---- four ranks ---------------------------------------------------------------------------
@pytest.mark.parallel(nprocs=[4])
@pytest.mark.timeout(180)
def test_four_stages_equal_one_process():
    check_equal(lambda: tiny_gpt(4), 4, gpipe)
    check_equal(lambda: tiny_mlp(4), 4, one_f_one_b)


# ---- errors (one process) -----------------------------------------------------------------
def test_split_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_stages \\(3\\) exceeds the model's 2 blocks"):
        split_model(tiny_gpt(2), 3)
    with pytest.raises(ValueError, match="num_stages \\(5\\) exceeds the model's 4 layers"):
        split_model(tiny_mlp(4), 5)
    with pytest.raises(ValueError, match="recompute=True: for an nn.GPT"):
        split_model(tiny_mlp(4), 2, recompute=True)
    with pytest.raises(TypeError, match=r"model must be a GPT \(an nn.GPT or a Tensor"):
        split_model(nn.Linear(2, 2, rng=np.random.default_rng(0)), 1)
    with pytest.raises(TypeError, match="a sequential model is a non-empty list of Modules"):
        split_model([nn.Linear(2, 2, rng=np.random.default_rng(0)), np.tanh], 1)
    with pytest.raises(ValueError, match="num_stages \\(4\\) exceeds the model's 3 modules"):
        split_model(tiny_mlp(3).layers, 4)


class Block(nn.Module):
    """A user's layer: relu(x W + b)."""

    def __init__(self, rng):
        self.fc = nn.Linear(5, 5, rng=rng, dtype=F64)

    def forward(self, x):
        return self.fc(x).relu()


def test_a_list_of_modules_is_cut_in_order_named_as_torch_sequential():
    rng = np.random.default_rng(0)
    layers = [Block(rng) for _ in range(5)]  # the user's sequential model: 2 + 2 + 1
    x = rng.standard_normal((3, 5))
    whole = split_model(layers, 1)[0]
    parts = split_model(layers, 3)
    assert [len(part.layers) for part in parts] == [2, 2, 1]
    assert [name for name, _ in parts[1].named_parameters()] == [
        "2.fc.weight", "2.fc.bias", "3.fc.weight", "3.fc.bias"
    ]  # fmt: skip
    assert all(p is q for (_, p), (_, q) in zip(whole.named_parameters(), (
        item for part in parts for item in part.named_parameters())))  # fmt: skip
    y = x
    for part in parts:
        y = part(y)
    (y * y).sum().backward()
    grads = [p.grad.copy() for p in whole.parameters()]
    whole.zero_grad()
    (whole(x) ** 2).sum().backward()  # the parts chained are the whole model
    assert all(np.array_equal(g, p.grad) for g, p in zip(grads, whole.parameters()))


def test_stage_errors_name_the_argument():
    part = split_model(tiny_gpt(2), 2)[0]
    group = SimpleNamespace(size=2, rank=0)
    with pytest.raises(ValueError, match="stage_index must be in \\[0, 2\\)"):
        PipelineStage(part, 2, 2, group)
    with pytest.raises(ValueError, match="num_stages \\(3\\) must be the group's size \\(2\\)"):
        PipelineStage(part, 0, 3, group)
    with pytest.raises(ValueError, match="stage_index 1 belongs on group rank 1"):
        PipelineStage(part, 1, 2, group)
    with pytest.raises(TypeError, match="module_part"):
        PipelineStage(lambda x: x, 0, 2, group)
    stage = PipelineStage(part, 0, 2, group)
    with pytest.raises(ValueError, match="targets go to the last stage only"):
        stage.forward(0, inputs=np.zeros((1, 6), int), targets=np.zeros((1, 6), int))
    with pytest.raises(ValueError, match="W before its B"):
        stage.backward_weight(0)
    for p in part.parameters():  # a frozen first stage: refused, never a hang
        p.requires_grad = False
    with pytest.raises(ValueError, match="stage 0 has no parameter that requires grad"):
        PipelineStage(part, 0, 2, group)


class TiedHead(nn.Module):
    """logits = X E^T with the embedding's own weight (GPT-2's tying)."""

    def __init__(self, wte):
        self.weight = wte.weight

    def forward(self, x):
        return x @ self.weight.transpose(1, 0)


@pytest.mark.parametrize("make", [lambda: tiny_gpt(4), lambda: tiny_mlp(4)])
def test_parts_hold_the_models_parameters_under_its_names(make):
    model = make()
    whole = {k: v.copy() for k, v in model.state_dict().items()}  # a snapshot: state_dict()
    group = SimpleNamespace(size=3, rank=0)  # holds the parameters' own arrays
    parts = split_model(model, 3)
    states = [part.state_dict() for part in parts]
    units = [len(getattr(part, "blocks", getattr(part, "layers", None))) for part in parts]
    assert units == [2, 1, 1]  # 4 blocks (layers) over 3 stages: the first takes one more
    assert sum(len(state) for state in states) == len(whole)
    for state in states:
        for name, value in state.items():
            np.testing.assert_array_equal(value, whole[name])
    stage = PipelineStage(parts[0], 0, 3, group)
    stage.load_state_dict({name: value + 1 for name, value in states[0].items()})
    for name, value in stage.state_dict().items():
        np.testing.assert_array_equal(value, whole[name] + 1)


def test_a_weight_tied_across_stages_is_refused():
    model = tiny_gpt(2)
    model.head = TiedHead(model.wte)
    assert len(split_model(model, 1)) == 1  # one stage: the tie stays on one rank
    with pytest.raises(ValueError, match="'wte.weight' of stage 0 is also 'head.weight'"):
        split_model(model, 2)
