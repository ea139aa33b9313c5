"""Optimizers, clipping and the schedule, step by step against torch.optim on the same gradients.

Each comparison feeds both sides an identical sequence of float64 gradients for a few steps and
checks the parameters after every step, so an error in the first step or in how state carries
over (momentum, Adam's moments and bias correction) both show.
"""

import copy
import math

import numpy as np
import pytest

from minidp import Tensor, optim

try:
    import torch
except Exception:
    torch = None


SHAPES = [(3, 4), (5,), (2, 1, 3)]
STEPS = 6

CONFIGS = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("SGD", {"lr": 0.05, "weight_decay": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.8, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.05}),
    ("Adam", {"lr": 0.01}),
    ("Adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("Adam", {"lr": 0.01, "weight_decay": 0.1}),
    ("AdamW", {"lr": 0.01}),
    ("AdamW", {"lr": 0.02, "weight_decay": 0.3, "betas": (0.85, 0.95)}),
]


def make_params(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [Tensor(rng.standard_normal(s).astype(dtype), requires_grad=True) for s in SHAPES]


def gradients(step, seed=1):
    rng = np.random.default_rng((seed, step))
    return [rng.standard_normal(s) for s in SHAPES]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.astype(p.dtype)


@pytest.mark.torch
@pytest.mark.parametrize(("name", "hyper"), CONFIGS, ids=lambda c: str(c))
def test_matches_torch_optim_step_by_step(name, hyper):
    ours = make_params()
    theirs = [torch.tensor(p.data.copy(), requires_grad=True) for p in ours]
    opt = getattr(optim, name)(ours, **hyper)
    torch_opt = getattr(torch.optim, name)(theirs, **hyper)
    for step in range(STEPS):
        grads = gradients(step)
        set_grads(ours, grads)
        for t, g in zip(theirs, grads):
            t.grad = torch.tensor(g)
        opt.step()
        torch_opt.step()
        for k, (p, t) in enumerate(zip(ours, theirs)):
            np.testing.assert_allclose(
                p.data,
                t.detach().numpy(),
                rtol=1e-12,
                atol=1e-14,
                err_msg=f"step {step}, parameter {k}",
            )


def test_plain_sgd_is_w_minus_lr_g():
    params = make_params()
    before = [p.data.copy() for p in params]
    grads = gradients(0)
    set_grads(params, grads)
    optim.SGD(params, lr=0.5).step()
    for p, w, g in zip(params, before, grads):
        np.testing.assert_array_equal(p.data, w - 0.5 * g)


def test_parameters_without_a_gradient_are_left_alone():
    params = make_params()
    before = params[1].data.copy()
    for name in ("SGD", "Adam", "AdamW"):
        opt = getattr(optim, name)(params, lr=0.1)
        set_grads(params, gradients(0))
        params[1].grad = None
        opt.step()
        np.testing.assert_array_equal(params[1].data, before)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_float32_parameters_stay_float32(name):
    params = make_params(dtype=np.float32)
    opt = getattr(optim, name)(params, lr=0.1, **({"momentum": 0.9} if name == "SGD" else {}))
    for step in range(2):
        set_grads(params, gradients(step))
        opt.step()
    assert all(p.dtype == np.float32 for p in params)


def test_zero_grad_clears_gradients():
    params = make_params()
    opt = optim.Adam(params)
    set_grads(params, gradients(0))
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="learning rate must be positive"):
        optim.Adam(make_params(), lr=0.0)
    with pytest.raises(ValueError, match="nesterov needs momentum"):
        optim.SGD(make_params(), lr=0.1, nesterov=True)


# ---- state_dict -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "hyper"),
    [
        ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        ("Adam", {"lr": 0.01, "weight_decay": 0.1}),
        ("AdamW", {"lr": 0.01}),
    ],
)
def test_state_dict_roundtrip_continues_identically(name, hyper):
    params = make_params()
    opt = getattr(optim, name)(params, **hyper)
    for step in range(3):
        set_grads(params, gradients(step))
        opt.step()
    saved_params = copy.deepcopy([p.data for p in params])
    saved = opt.state_dict()

    for step in range(3, 6):  # the original runs on, mutating its state in place
        set_grads(params, gradients(step))
        opt.step()

    resumed_params = [Tensor(w, requires_grad=True) for w in saved_params]
    resumed = getattr(optim, name)(resumed_params, lr=1.0)  # lr comes back from the state
    resumed.load_state_dict(saved)
    for step in range(3, 6):
        set_grads(resumed_params, gradients(step))
        resumed.step()
    for p, q in zip(params, resumed_params):
        np.testing.assert_array_equal(p.data, q.data)


def test_load_state_dict_rejects_another_parameter_count():
    opt = optim.Adam(make_params())
    state = opt.state_dict()
    with pytest.raises(ValueError, match="3 parameters.*1"):
        optim.Adam(make_params()[:1]).load_state_dict(state)


# ---- clipping ---------------------------------------------------------------------------------
def test_global_grad_norm_is_the_norm_of_all_gradients_together():
    params = make_params()
    grads = gradients(0)
    set_grads(params, grads)
    params[2].grad = None
    expected = math.sqrt(sum(float(np.sum(g * g)) for g in grads[:2]))
    assert optim.global_grad_norm(params) == pytest.approx(expected, rel=1e-14)


@pytest.mark.torch
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(max_norm):
    params = make_params()
    theirs = [torch.tensor(p.data.copy(), requires_grad=True) for p in params]
    grads = gradients(0)
    set_grads(params, grads)
    for t, g in zip(theirs, grads):
        t.grad = torch.tensor(g)
    norm = optim.clip_grad_norm(params, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm == pytest.approx(expected.item(), rel=1e-13)
    for p, t in zip(params, theirs):
        np.testing.assert_allclose(p.grad, t.grad.numpy(), rtol=1e-13, atol=1e-15)
    if max_norm < norm:
        assert optim.global_grad_norm(params) == pytest.approx(max_norm, rel=1e-5)
    else:
        for p, g in zip(params, grads):
            np.testing.assert_array_equal(p.grad, g)


def test_clip_grad_norm_uses_a_given_total_norm():
    params = make_params()
    set_grads(params, gradients(0))
    before = [p.grad.copy() for p in params]
    assert optim.clip_grad_norm(params, 1.0, total_norm=10.0) == 10.0
    for p, g in zip(params, before):
        np.testing.assert_allclose(p.grad, g * (1.0 / (10.0 + 1e-6)), rtol=1e-14)


# ---- schedule ---------------------------------------------------------------------------------
def test_warmup_cosine_rises_linearly_peaks_and_decays_to_the_floor():
    peak, warmup, total, floor = 2.0, 10, 110, 0.1
    lrs = [optim.warmup_cosine(s, peak, warmup, total, floor) for s in range(total + 1)]
    np.testing.assert_allclose(lrs[:warmup], peak * np.arange(1, warmup + 1) / warmup, rtol=1e-15)
    assert lrs[warmup - 1] == lrs[warmup] == peak
    decay = np.array(lrs[warmup:])
    assert np.all(np.diff(decay) < 0)
    assert lrs[warmup + (total - warmup) // 2] == pytest.approx(peak * (floor + (1 - floor) / 2))
    assert lrs[total] == pytest.approx(peak * floor)
    assert optim.warmup_cosine(total + 50, peak, warmup, total, floor) == pytest.approx(
        peak * floor
    )
    assert min(lrs) > 0


def test_warmup_cosine_without_warmup_starts_at_the_peak():
    assert optim.warmup_cosine(0, 1.0, 0, 100) == 1.0


@pytest.mark.torch
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_counts_steps_per_parameter_like_torch(name):
    """A parameter that got no gradient on early steps starts its bias correction later."""
    ours = make_params()
    theirs = [torch.tensor(p.data.copy(), requires_grad=True) for p in ours]
    opt = getattr(optim, name)(ours, lr=0.01)
    torch_opt = getattr(torch.optim, name)(theirs, lr=0.01)
    for step in range(4):
        grads = gradients(step)
        for k, (p, t, g) in enumerate(zip(ours, theirs, grads)):
            late = k == 0 and step < 2  # parameter 0 sits out the first two steps
            p.grad = None if late else g
            t.grad = None if late else torch.tensor(g)
        opt.step()
        torch_opt.step()
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-12, atol=1e-14)
