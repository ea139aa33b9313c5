"""Mixed precision (parallel/amp.py, engine/optim.py's masters): 16-bit weights and
gradients, float32 masters and optimizer state, the loss scaler's skips agreed on every rank,
ZeRO-3's 2 + 2 + 12 bytes a parameter over N ranks, and bf16 / fp16 training that ends near
fp32's. fp32 stays the plain path, bit for bit (every other test runs it)."""

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.cli.commands import parse_train_args
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.cli.training.loop import train
from minidp.parallel import amp

BF16 = np.dtype(ml_dtypes.bfloat16)


def tiny_gpt(precision="fp32", seed=0):
    cfg = nn.GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16)
    return amp.to_half(nn.GPT(cfg, seed=seed), precision)


def loss_of(model, idx):
    logits = model(idx)
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))


IDX = np.random.default_rng(1).integers(0, 17, size=(4, 8))


# ---- the optimizer's masters -----------------------------------------------------------------
def test_a_16_bit_weight_steps_through_its_float32_master():
    model = tiny_gpt("bf16")
    assert {p.dtype for p in model.parameters()} == {BF16}
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    loss = loss_of(model, IDX)
    assert loss.dtype == np.float32  # the arithmetic: float32
    loss.backward()
    assert {p.grad.dtype for p in model.parameters()} == {BF16}  # the gradients: 16 bits
    opt.step()
    for p, state in zip(model.parameters(), opt.state):
        assert state["master"].dtype == state["m"].dtype == state["v"].dtype == np.float32
        np.testing.assert_array_equal(p.data, state["master"].astype(BF16))  # rounded back
    state = opt.state_dict()  # the masters are saved with the moments
    assert all("master" in s for s in state["state"])


def test_a_scaled_gradient_steps_as_the_unscaled_one_bit_for_bit():
    """grad_scale S (a power of 2, as the scaler's) is divided out exactly, in float32."""
    steps = []
    for scale in (1.0, 2.0**12):
        w = nn.Parameter(np.linspace(-1, 1, 12, dtype=np.float32))
        opt = optim.AdamW([w], lr=1e-2)
        opt.grad_scale = scale
        for k in range(3):
            w.grad = np.cos(w.data * (k + 1)) * np.float32(scale)
            opt.step()
        steps.append(w.data.copy())
    np.testing.assert_array_equal(*steps)


def test_init_state_makes_the_master_too():
    model = tiny_gpt("fp16")
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    opt.init_state()
    assert all(s["master"].dtype == s["m"].dtype == np.float32 for s in opt.state)


# ---- the scaler --------------------------------------------------------------------------------
def test_the_scaler_backs_off_on_an_overflow_and_grows_after_good_steps():
    w = nn.Parameter(np.ones(3, np.float16))
    opt = optim.SGD([w], lr=0.5)
    scaler = amp.GradScaler(init_scale=8.0, growth_interval=2)
    w.grad = np.array([1.0, np.inf, 2.0], np.float16)
    assert scaler.unscale_(opt) and not scaler.step(opt)
    scaler.update()
    np.testing.assert_array_equal(w.data, 1.0)  # skipped
    assert scaler.get_scale() == 4.0 and scaler.skipped == 1
    for _ in range(2):
        w.grad = np.full(3, 4.0, np.float16)  # 4 x the true gradient 1.0
        assert scaler.step(opt)
        scaler.update()
    np.testing.assert_array_equal(w.data, 0.0)  # two steps of 0.5 x 1.0
    assert scaler.get_scale() == 8.0  # grown after growth_interval good steps
    again = amp.GradScaler()
    again.load_state_dict(scaler.state_dict())
    assert again.get_scale() == 8.0 and again.skipped == 1


def test_the_scaler_clips_by_the_unscaled_norm():
    w = nn.Parameter(np.zeros(2, np.float16))
    w.grad = np.array([3.0, 4.0], np.float16) * np.float16(64)  # norm 5, scaled by 64
    scaler = amp.GradScaler(init_scale=64.0)
    assert scaler.clip_grad_norm_([w], 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(w.grad.astype(np.float32) / 64, [0.6, 0.8], rtol=1e-3)


def test_bad_precisions_and_combinations_are_one_line():
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16"):
        amp.half_dtype("int8")
    with pytest.raises(ValueError, match="growth_factor > 1"):
        amp.GradScaler(growth_factor=1.0)
    base = TrainConfig(precision="bf16", steps=1)
    for change, words in (
        (dict(dtype="float64"), "keeps float32 master weights"),
        (dict(compress="fp16"), "sends 16-bit gradients already"),
    ):
        with pytest.raises(BadConfig, match=words):
            replace(base, **change).validate()
    with pytest.raises(SystemExit):  # a flag of the stepped strategies, not the servers'
        parse_train_args(["--strategy", "ps", "--precision", "bf16"])


# ---- training ----------------------------------------------------------------------------------
def test_bf16_and_fp16_train_the_gpt_near_fp32():
    config = TrainConfig(steps=40, eval_batches=2, sample_tokens=0, threads=1, log_every=100)
    finals = {p: train(replace(config, precision=p)) for p in ("fp32", "bf16", "fp16")}
    for p in ("bf16", "fp16"):
        assert abs(finals[p]["val_loss"] / finals["fp32"]["val_loss"] - 1) < 0.02, p
    memory = finals["bf16"]["memory_bytes"]
    params = memory["parameters"] // 2  # 2 bytes each
    assert memory["gradients"] == 2 * params and memory["optimizer"] >= 12 * params
    fp16 = finals["fp16"]  # a power of 2, halved once per step skipped
    assert fp16["loss_scale"] == 2.0**16 / 2 ** fp16["overflow_steps"]
    assert fp16["overflow_steps"] == len(fp16["overflow_at"]) and "loss_scale" not in finals["bf16"]


@pytest.mark.parallel(nprocs=[4])
@pytest.mark.timeout(180)
def test_zero_3_in_bf16_holds_16_bytes_a_parameter_over_n_and_skips_are_agreed():
    group = comm.world()
    config = TrainConfig(
        strategy="zero", zero_stage=3, precision="bf16", steps=3, eval_batches=1,
        sample_tokens=0, log_every=100, n_layer=2, n_embd=32,
    )  # fmt: skip
    final = train(config, group)
    memory, psi = final["memory_bytes"], final["shard_elements"]
    held = memory["parameters"] + memory["gradients"] + memory["optimizer"]
    assert memory["parameters"] == memory["gradients"] == 2 * psi
    assert abs(held / (16 * psi) - 1) < 0.01, (held, 16 * psi)  # Adam's step counters aside
    # one rank's gradient overflows: every rank skips
    w = nn.Parameter(np.ones(4, np.float16))
    w.grad = np.array([1, 2, np.inf if group.rank == 2 else 3, 4], np.float16)
    assert amp.GradScaler(group=group).unscale_(optim.SGD([w], lr=1.0))
    # bfloat16 crosses the collectives: an allreduce sums in it
    x = np.full(5, group.rank + 1, BF16)
    np.testing.assert_array_equal(comm.allreduce(x, group=group), np.full(5, 10, BF16))
    # ZeRO-3 in fp16 with a scale that overflows: every rank skips the step, halves the scale
    from minidp.cli.strategies import ZeRO
    from minidp.models.tasks import Task

    fp16 = replace(config, precision="fp16").resolved()
    with ZeRO(Task(fp16, np.float32), fp16, group) as zero:
        zero.run.scaler._scale = 2.0**40  # the gradients times 2^40: inf in float16
        before = [p.data.copy() for p in zero.pieces]
        result = zero.step(np.arange(group.rank * 2, group.rank * 2 + 2), 1e-3)
        assert result.overflow and not result.stepped and np.isfinite(result.loss)
        assert zero.run.scaler.get_scale() == 2.0**39 and zero.run.scaler.skipped == 1
        for p, was in zip(zero.pieces, before):
            np.testing.assert_array_equal(p.data, was)  # nothing moved


def test_a_16_bit_table_gives_float32_rows():
    table = nn.Embedding(5, 3, rng=np.random.default_rng(0))
    amp.to_half(table, "fp16")
    rows = table(np.array([[0, 4]]))
    assert rows.dtype == np.float32 and isinstance(rows, Tensor)
    (rows * rows).sum().backward()
    assert table.weight.grad.dtype == np.float16


def test_a_checkpoint_keeps_bfloat16_and_reshards_it(tmp_path):
    from minidp.parallel import checkpoint

    alone = comm.world().split(comm.world().rank)
    w = (np.arange(6, dtype=np.float32) / 7).astype(BF16)
    layout = {"w": "replicated", "m": "replicated"}
    checkpoint.save({"w": w, "m": w.astype(np.float32)}, str(tmp_path), alone, layout=layout)
    back = checkpoint.read(str(tmp_path), alone)
    assert back["w"].dtype == BF16 and back["m"].dtype == np.float32
    np.testing.assert_array_equal(back["w"], w)
    cut = checkpoint.read(str(tmp_path), alone, layout=layout)  # through reshard.py
    np.testing.assert_array_equal(cut["w"], w)
