"""The MoE layer in one process: routing by hand (top-k, the serving order, capacity and its
groups), Switch's auxiliary loss against its formula, every gradient against central
differences (float64, with drops and without), and the GPT with experts in its blocks."""

from dataclasses import replace

import numpy as np
import pytest
from gradcheck import numerical_gradients

from minidp import Tensor, cross_entropy, nn, optim
from minidp.models.moe import (
    MoE,
    capacity,
    expert_load,
    load_balancing_loss,
    moe_layers,
    plot_expert_load,
    route,
)

F64 = np.float64


def test_top1_keeps_the_first_tokens_up_to_capacity():
    p = np.array([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.5, 0.1, 0.4], [0.1, 0.1, 0.8]])
    # capacity = ceil(1.0 * 4 tokens * 1 / 3 experts) = 2: token 2's choice (expert 0) drops
    r = route(Tensor(p), k=1, capacity_factor=1.0)
    assert r.token.tolist() == [0, 1, 3] and r.expert.tolist() == [0, 0, 2]
    assert r.position.tolist() == [0, 1, 0] and r.width == 2
    assert r.routed.tolist() == [3, 0, 1] and r.dropped.tolist() == [1, 0, 0]
    np.testing.assert_array_equal(r.gate.data, [0.7, 0.6, 0.8])  # Switch: not renormalized
    dropless = route(Tensor(p), k=1)
    assert dropless.token.tolist() == [0, 1, 2, 3] and dropless.width == 3


def test_top2_serves_every_first_choice_before_any_second():
    p = np.array([[0.5, 0.4, 0.1], [0.1, 0.5, 0.4], [0.6, 0.3, 0.1]])
    # first choices 0, 1, 0; second choices 1, 2, 1. capacity ceil(0.5 * 3 * 2 / 3) = 1
    r = route(Tensor(p), k=2, capacity_factor=0.5)
    assert list(zip(r.token, r.expert)) == [(0, 0), (1, 1), (1, 2)]
    assert r.dropped.tolist() == [1, 2, 0]  # token 2's first choice; tokens 0, 2: second
    np.testing.assert_allclose(r.gate.data, [0.5 / 0.9, 0.5 / 0.9, 0.4 / 0.9])


def test_each_capacity_group_has_its_own_capacity():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(4), size=12)
    whole = route(Tensor(p), k=2, capacity_factor=1.0, groups=3)
    for g in range(3):  # group g's tokens routed alone keep the same assignments
        alone = route(Tensor(p[4 * g : 4 * g + 4]), k=2, capacity_factor=1.0)
        mine = whole.group == g
        assert (whole.token[mine] - 4 * g).tolist() == alone.token.tolist()
        assert whole.expert[mine].tolist() == alone.expert.tolist()
        assert whole.position[mine].tolist() == alone.position.tolist()
    assert capacity(1.25, 4, 2, 4) == 3 and capacity(0.0, 4, 2, 4) is None
    with pytest.raises(ValueError, match="capacity groups"):
        route(Tensor(p), k=1, groups=5)


def make_moe(top_k=1, capacity_factor=0.0, E=4, C=6, seed=0):
    rng = np.random.default_rng(seed)
    moe = MoE(C, E, top_k, capacity_factor, rng=rng, dtype=F64, hidden=5)
    moe.router.weight.data *= 50  # confident routing: central differences cross no boundary
    return moe


def test_the_aux_loss_is_switchs_formula():
    moe = make_moe(top_k=2)
    x = np.random.default_rng(1).standard_normal((3, 5, 6))
    moe(Tensor(x))
    logits = x.reshape(-1, 6) @ moe.router.weight.data
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top2 = np.argsort(-p, axis=1)[:, :2]
    f = np.bincount(top2.ravel(), minlength=4) / (15 * 2)
    np.testing.assert_allclose(moe.aux_loss.item(), 4 * (f * p.mean(0)).sum(), rtol=1e-13)
    assert moe.load.routed.sum() == 30 and moe.load.tokens == 15


@pytest.mark.parametrize("top_k,capacity_factor", [(1, 0.0), (2, 0.0), (1, 0.75), (2, 0.5)])
def test_every_gradient_against_central_differences(top_k, capacity_factor):
    """L = sum(moe(x) * w) + 3 aux: the input's, the router's and every expert's gradient."""
    moe = make_moe(top_k, capacity_factor)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 6))
    w = rng.standard_normal(x.shape)
    params = moe.parameters()

    def loss(xt):
        return (moe(xt) * Tensor(w)).sum() + moe.aux_loss * 3.0

    xt = Tensor(x.copy(), requires_grad=True)
    loss(xt).backward()
    if capacity_factor:
        assert moe.load.dropped.sum() > 0  # the case drops something

    def value():
        return loss(Tensor(x)).item()

    arrays = [x, *(p.data for p in params)]
    numeric = numerical_gradients(value, arrays)
    for got, want in zip([xt.grad, *(p.grad for p in params)], numeric):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


def tiny_gpt(**moe):
    cfg = nn.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16, **moe)
    return nn.GPT(cfg, seed=0, dtype=F64)


def test_the_gpt_puts_experts_where_asked_and_learns():
    assert [b.moe is not None for b in tiny_gpt(n_experts=4).blocks] == [True, True]
    every_other = tiny_gpt(n_experts=4, moe_every=2)
    assert [b.moe is not None for b in every_other.blocks] == [False, True]
    assert [n for n, _ in moe_layers(every_other)] == ["blocks.1.moe."]
    assert not hasattr(every_other.blocks[1], "fc") and load_balancing_loss(tiny_gpt()) == 0.0

    model = tiny_gpt(n_experts=4, top_k=2, capacity_factor=1.25)
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 16, (4, 8))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = cross_entropy(model(x), np.roll(x, -1, axis=1)) + load_balancing_loss(model)
        loss.backward()
        assert model.blocks[0].moe.router.weight.grad is not None
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    record = expert_load(model)
    assert record["layers"] == ["blocks.0.moe", "blocks.1.moe"]
    assert [sum(h) for h in record["tokens_per_expert"]] == [4 * 8 * 2] * 2
    dropped = sum(sum(d) for d in record["dropped_per_expert"])
    assert record["dropped"] == dropped


def test_the_picture_of_the_load(tmp_path):
    pytest.importorskip("matplotlib")
    model = tiny_gpt(n_experts=4, capacity_factor=1.0)
    model(np.zeros((2, 8), dtype=int))  # every token alike: one expert takes them all
    record = expert_load(model)
    assert record["dropped"] > 0
    assert plot_expert_load(record, str(tmp_path / "load.png")).endswith("load.png")


def test_the_config_without_experts_is_the_plain_gpt():
    plain, zero = tiny_gpt(), tiny_gpt(n_experts=0, top_k=2, moe_every=2)
    assert replace(plain.config, top_k=2, moe_every=2) == zero.config
    for (n, p), (m, q) in zip(plain.named_parameters(), zero.named_parameters()):
        assert n == m and np.array_equal(p.data, q.data)
