"""Deferred weight gradients (weight_grads.defer_weight_grads, weight_grads.Product): gradient
accumulation that multiplies each weight's rows once, on the first read of .grad.

Every test compares against the same backward passes without deferral, or against the
gradient of the whole batch at once."""

import contextlib

import numpy as np
import pytest

from minidp import Tensor, nn, optim
from minidp.fast import weight_grads
from minidp.fast.weight_grads import Product, defer_weight_grads
from minidp.nn import MLP, cross_entropy, linear

SIZES = [12, 16, 16, 3]  # 12*16 / 28: a stash of up to 6 rows for the first weight


def mlp(seed=0):
    return MLP(SIZES, rng=np.random.default_rng(seed), dtype=np.float64)


def batch(n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, SIZES[0])), rng.integers(0, SIZES[-1], n)


def accumulate(model, x, y, cuts, defer=True):
    """Backward over x[cuts[k]:cuts[k+1]], each loss weighed m_k / n (their sum: the batch
    mean); all but the last pass inside defer_weight_grads() when `defer`."""
    model.zero_grad()
    n = len(x)
    for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        last = k == len(cuts) - 2
        with defer_weight_grads() if defer and not last else contextlib.nullcontext():
            (cross_entropy(model(Tensor(x[lo:hi])), y[lo:hi]) * ((hi - lo) / n)).backward()
    return [None if p.grad is None else p.grad.copy() for p in model.parameters()]


def whole_batch(model, x, y):
    model.zero_grad()
    cross_entropy(model(Tensor(x)), y).backward()
    return [p.grad.copy() for p in model.parameters()]


def test_deferred_accumulation_is_the_gradient_of_the_whole_batch():
    x, y = batch(8)
    model = mlp()
    want = whole_batch(model, x, y)
    cuts = [0, 2, 4, 6, 8]
    got = accumulate(model, x, y, cuts)
    plain = accumulate(model, x, y, cuts, defer=False)
    for g, w, p in zip(got, want, plain):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(p, w, rtol=1e-12, atol=1e-15)


def test_backward_passes_inside_the_block_keep_rows_not_products():
    x, y = batch(4)
    model = mlp()
    with defer_weight_grads():
        cross_entropy(model(Tensor(x[:2])), y[:2]).backward()
    first = model.layers[0].weight
    assert first._pending is not None and first._pending.rows == 2  # kept, not multiplied
    assert first._grad is None
    assert first.grad is not None and first._pending is None  # the read multiplies them in


def test_rows_are_copied_so_changing_the_input_afterwards_changes_nothing():
    """A loader that refills one input buffer between micro-batches must not change the
    deferred gradient (NumPy has no version counter to catch it)."""
    x, y = batch(4)
    model = mlp()
    want = accumulate(model, x, y, [0, 2, 4], defer=False)
    model.zero_grad()
    buffer = x[:2].copy()
    with defer_weight_grads():
        (cross_entropy(model(Tensor(buffer)), y[:2]) * 0.5).backward()
    buffer[...] = x[2:]  # refilled for the next micro-batch
    (cross_entropy(model(Tensor(buffer)), y[2:]) * 0.5).backward()
    for p, w in zip(model.parameters(), want):
        np.testing.assert_allclose(p.grad, w, rtol=1e-12, atol=1e-15)


def test_reading_grad_between_passes_sees_everything_so_far_and_accumulation_goes_on():
    x, y = batch(6)
    model = mlp()
    want_two = accumulate(model, x[:4], y[:4], [0, 2, 4], defer=False)
    model.zero_grad()
    with defer_weight_grads():
        (cross_entropy(model(Tensor(x[:2])), y[:2]) * 0.5).backward()
        (cross_entropy(model(Tensor(x[2:4])), y[2:4]) * 0.5).backward()
        seen = [p.grad.copy() for p in model.parameters()]  # mid-accumulation
        (cross_entropy(model(Tensor(x[4:])), y[4:]) * 0.5).backward()
    for s, w in zip(seen, want_two):
        np.testing.assert_allclose(s, w, rtol=1e-12, atol=1e-15)
    third = whole_batch(mlp(), x[4:], y[4:])
    for p, w, t in zip(model.parameters(), want_two, third):
        np.testing.assert_allclose(p.grad, w + 0.5 * t, rtol=1e-12, atol=1e-15)


def test_setting_grad_to_none_drops_the_deferred_rows():
    x, y = batch(4)
    model = mlp()
    with defer_weight_grads():
        cross_entropy(model(Tensor(x[:2])), y[:2]).backward()
    model.zero_grad()  # p.grad = None: the rows go with the old gradient
    cross_entropy(model(Tensor(x[2:])), y[2:]).backward()
    for p, w in zip(model.parameters(), whole_batch(mlp(), x[2:], y[2:])):
        np.testing.assert_allclose(p.grad, w, rtol=1e-12, atol=1e-15)


def test_the_stash_never_outgrows_the_gradient_and_the_sum_stays_right():
    """12 x 16 weight: at most 12*16 // 28 = 6 rows kept; 7 passes of 2 rows overflow it."""
    x, y = batch(14)
    model = mlp()
    cuts = list(range(0, 15, 2))
    want = accumulate(model, x, y, cuts, defer=False)
    model.zero_grad()
    first = model.layers[0].weight
    most = 0
    with defer_weight_grads():
        for lo in cuts[:-1]:
            (cross_entropy(model(Tensor(x[lo : lo + 2])), y[lo : lo + 2]) * (2 / 14)).backward()
            if first._pending is not None:
                most = max(most, first._pending.rows)
                assert first._pending.x.nbytes + first._pending.g.nbytes <= first.data.nbytes
    assert most == 6
    for p, w in zip(model.parameters(), want):
        np.testing.assert_allclose(p.grad, w, rtol=1e-12, atol=1e-15)


def test_too_many_rows_for_the_gradient_are_multiplied_at_once():
    x, y = batch(8)
    model = mlp()
    with defer_weight_grads():  # 8 rows > 6: keeping them would cost more than the gradient
        cross_entropy(model(Tensor(x)), y).backward()
    assert model.layers[0].weight._pending is None
    assert model.layers[1].weight._pending is not None  # 16 * 16 // 32 = 8 rows: they fit
    model.layers[1].weight.grad  # noqa: B018
    for p, w in zip(model.parameters(), whole_batch(mlp(), x, y)):
        np.testing.assert_allclose(p.grad, w, rtol=1e-12, atol=1e-15)


def test_a_hook_that_reads_grad_inside_the_block_sees_the_whole_gradient():
    x, y = batch(4)
    model = mlp()
    seen = []
    weight = model.layers[0].weight
    weight.register_grad_ready_hook(lambda p: seen.append(p.grad.copy()))
    with defer_weight_grads():
        cross_entropy(model(Tensor(x)), y).backward()
    np.testing.assert_allclose(seen[0], whole_batch(mlp(), x, y)[0], rtol=1e-12, atol=1e-15)


def test_a_weight_that_is_no_leaf_gets_an_array_and_a_shared_weight_sums_both_uses():
    rng = np.random.default_rng(3)
    W = Tensor(rng.standard_normal((4, 4)), requires_grad=True)
    x = Tensor(rng.standard_normal((2, 4)))
    with defer_weight_grads():  # W * 2.0 is an op's output: its backward needs an array
        linear(linear(x, W * 2.0).tanh(), W).sum().backward()
    h = np.tanh(x.data @ (2 * W.data))
    upstream = np.ones((2, 4)) @ W.data.T * (1 - h * h)
    by_hand = h.T @ np.ones((2, 4)) + 2 * (x.data.T @ upstream)
    np.testing.assert_allclose(W.grad, by_hand, rtol=1e-12)


def test_a_product_stands_for_x_transposed_times_g():
    rng = np.random.default_rng(4)
    x, g = rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    p = Product(x, g)
    assert p.shape == (3, 2)
    np.testing.assert_array_equal(p.value(), x.T @ g)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_mlp_trained_with_deferred_accumulation_tracks_the_plain_one(dtype):
    x, y = batch(16)
    models = [MLP(SIZES, rng=np.random.default_rng(0), dtype=dtype) for _ in range(2)]
    opts = [optim.SGD(m.parameters(), lr=0.1) for m in models]
    for _ in range(5):
        for model, opt, defer in zip(models, opts, (True, False)):
            accumulate(model, x.astype(dtype), y, [0, 4, 8, 12, 16], defer=defer)
            opt.step()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        np.testing.assert_allclose(a.data, b.data, rtol=tol, atol=tol)


@pytest.mark.parallel(nprocs=[2])
def test_ddp_no_sync_defers_and_the_synchronized_backward_multiplies_once():
    from minidp import comm
    from minidp.parallel import DistributedDataParallel

    x, y = batch(4)  # every rank the same data: the mean over ranks is one rank's gradient
    want = accumulate(mlp(), x, y, [0, 2, 4], defer=False)
    model = mlp()
    with DistributedDataParallel(model, comm.world(), overlap=False) as ddp:
        ddp.zero_grad()
        with ddp.no_sync():
            (cross_entropy(ddp(Tensor(x[:2])), y[:2]) * 0.5).backward()
        assert model.layers[0].weight._pending is not None  # no_sync defers
        (cross_entropy(ddp(Tensor(x[2:])), y[2:]) * 0.5).backward()
        ddp.finish_gradient_sync()
        assert all(p._pending is None for p in model.parameters())
        for p, w in zip(model.parameters(), want):
            np.testing.assert_allclose(p.grad, w, rtol=1e-12, atol=1e-15)


def test_accumulation_adds_in_the_buckets_and_an_unused_parameter_has_a_zero_slot():
    """After ddp.zero_grad() (every .grad None), the end of a no_sync block moves each
    gradient into its bucket slot (a deferred weight keeps its rows, nothing else): later
    micro-batches add up in place (one gradient's memory, not two), and a parameter no
    micro-batch reaches still has a .grad to write (update.LocalGradients does), until the sync
    finds that no backward reached it: None then, as one process leaves it."""

    def model_with_a_spare_layer():
        net = mlp()
        net.spare = nn.Linear(3, 3, rng=np.random.default_rng(9), dtype=np.float64)
        return net

    x, y = batch(4)
    reference = model_with_a_spare_layer()
    want = accumulate(reference, x, y, [0, 2, 4], defer=False)
    for zero_grad in ("ddp", "optimizer"):  # DDP's own, or an optimizer's set-to-None
        accumulates_in_the_buckets(model_with_a_spare_layer(), x, y, want, zero_grad)


def accumulates_in_the_buckets(model, x, y, want, zero_grad):
    from minidp import comm
    from minidp.parallel import DistributedDataParallel

    spare = model.spare.weight
    with DistributedDataParallel(model, comm.world(), overlap=False) as ddp:
        if zero_grad == "ddp":
            ddp.zero_grad()
        else:
            optim.SGD(model.parameters(), lr=0.1).zero_grad()
        assert all(p.grad is None for p in model.parameters())
        with ddp.no_sync():
            (cross_entropy(ddp(Tensor(x[:2])), y[:2]) * 0.5).backward()
        views = {id(v) for b in ddp.buckets for v in b.views}
        for p in model.parameters():  # in the buckets, or rows kept and no array at all
            assert id(p._grad) in views or (p._grad is None and p._pending is not None)
        assert all(id(p._grad) in views for p in model.parameters() if p.ndim == 1)
        assert not spare.grad.any()
        spare.grad[...] = 0.0  # writable: a slot, not None
        (cross_entropy(ddp(Tensor(x[2:])), y[2:]) * 0.5).backward()
        ddp.finish_gradient_sync()
        for p, w in zip(model.parameters(), want):
            if w is None:
                assert p is spare or p is model.spare.bias
                assert p.grad is None
            else:
                np.testing.assert_allclose(p.grad, w, rtol=1e-12, atol=1e-15)


def test_rows_of_another_dtype_than_the_weight_take_no_more_bytes_than_its_gradient():
    x, y = batch(8)
    model = MLP(SIZES, rng=np.random.default_rng(0), dtype=np.float32)
    want = accumulate(model, x.astype(np.float32), y, [0, 2, 4, 6, 8], defer=False)
    model.zero_grad()
    first = model.layers[0].weight
    with defer_weight_grads():  # float64 rows into a float32 weight: 3 rows, not 6
        for lo in (0, 2, 4):
            part = slice(lo, lo + 2)
            (cross_entropy(model(Tensor(x[part])), y[part]) * 0.25).backward()
            if first._pending is not None:
                assert first._pending.x.nbytes + first._pending.g.nbytes <= first.data.nbytes
    (cross_entropy(model(Tensor(x[6:])), y[6:]) * 0.25).backward()
    for p, w in zip(model.parameters(), want):
        np.testing.assert_allclose(p.grad, w, rtol=1e-5, atol=1e-6)


def test_zero_stage_2_accumulation_defers_too(monkeypatch):
    from minidp import comm
    from minidp.cli.strategies import ZeRO
    from minidp.cli.training.config import TrainConfig
    from minidp.fast import weight_grads
    from minidp.models.tasks import Task

    kept = []
    add = weight_grads.Rows.add
    monkeypatch.setattr(
        weight_grads.Rows, "add", lambda rows, p: (kept.append(len(p.x)), add(rows, p))
    )
    config = TrainConfig(
        model="mlp", strategy="zero", zero_stage=2, grad_accum=2, batch_size=8, hidden=32,
        dtype="float64", overlap="off",
    )  # fmt: skip
    with ZeRO(Task(config, np.float64), config, comm.world()) as zero:
        zero.step(np.arange(8), config.lr)
    assert kept  # the first micro-batch's rows were kept, not multiplied


def test_linear_keeps_the_dtype_of_x_at_weight_plus_bias():
    rng = np.random.default_rng(5)
    x, W = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((3, 4))
    W32, b64 = W.astype(np.float32), rng.standard_normal(4)
    out = linear(Tensor(x), Tensor(W32), Tensor(b64))
    assert out.dtype == (x @ W32 + b64).dtype == np.float64
    ints = linear(Tensor(np.ones((2, 3), np.int64)), Tensor(np.ones((3, 4), np.int64)), Tensor(b64))
    np.testing.assert_array_equal(ints.data, np.full((2, 4), 3.0) + b64)


def test_rows_of_a_new_dtype_are_not_rounded_into_the_old_ones():
    """A float32 micro-batch then a float64 one, into float64 weights: the second's rows
    must not be copied into float32 storage (that would round them silently)."""
    x, y = batch(4)
    model = mlp()
    inputs = [x[:2].astype(np.float32), x[2:]]
    for defer in (False, True):
        model.zero_grad()
        with defer_weight_grads() if defer else contextlib.nullcontext():
            for part, targets in zip(inputs, (y[:2], y[2:])):
                (cross_entropy(model(Tensor(part)), targets) * 0.5).backward()
        got = [p.grad.copy() for p in model.parameters()]
        if not defer:
            want = got
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-15)


@pytest.mark.parallel(nprocs=[2])
def test_closing_ddp_with_rows_kept_keeps_the_gradient():
    """DDP.close() moves the gradients out of shared memory (algo auto, one machine): rows a
    weight still keeps must be multiplied in before the move, not lost with the old slot."""
    from minidp import comm
    from minidp.parallel import DistributedDataParallel

    x, y = batch(2)
    want = whole_batch(mlp(), x, y)
    model = mlp()
    ddp = DistributedDataParallel(model, comm.world(), overlap=False)
    ddp.zero_grad()
    with ddp.no_sync():
        cross_entropy(ddp(Tensor(x)), y).backward()
    assert model.layers[0].weight._pending is not None
    ddp.close()
    for p, w in zip(model.parameters(), want):
        np.testing.assert_allclose(p.grad, w, rtol=1e-12, atol=1e-15)


# ---- the trick against the plain path (weight_grads.deferral(False)) ----------------------
# Measured (OpenBLAS, 2026-12-03): one micro-batch gives the plain path's bits, inside
# defer_weight_grads() or not. With K > 1 a deferred weight's gradient is one product over the
# stacked rows, a reassociated sum: not bit-equal, within 1e-15 of the largest entry in
# float64 (5e-7 in float32); biases, and weights whose rows did not fit, stay bit-equal.

PLAIN_CASES = [([12, 16, 16, 3], 8), ([64, 256, 64, 10], 32)]


def micro_batches(sizes, dtype, n, K, trick, defer_the_last=False):
    """Gradients of K micro-batches of n examples (each loss weighed by its share), all but
    the last inside defer_weight_grads() (the last too with `defer_the_last`), with the
    trick on or off."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, sizes[0])).astype(dtype)
    y = rng.integers(0, sizes[-1], n)
    model = MLP(sizes, rng=np.random.default_rng(0), dtype=dtype)
    cuts = np.linspace(0, n, K + 1).astype(int)
    with weight_grads.deferral(trick):
        for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            inside = k < K - 1 or defer_the_last
            with defer_weight_grads() if inside else contextlib.nullcontext():
                (cross_entropy(model(Tensor(x[lo:hi])), y[lo:hi]) * ((hi - lo) / n)).backward()
            if trick and inside and k == 0:
                assert any(p._pending is not None for p in model.parameters())  # it deferred
            if not trick:
                assert all(p._pending is None for p in model.parameters())  # no Product
    return model, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sizes, n", PLAIN_CASES)
@pytest.mark.parametrize("defer_the_last", [False, True])
def test_one_micro_batch_gives_the_plain_paths_bits(sizes, n, dtype, defer_the_last):
    _, plain = micro_batches(sizes, dtype, n, 1, trick=False)
    _, deferred = micro_batches(sizes, dtype, n, 1, trick=True, defer_the_last=defer_the_last)
    for d, p in zip(deferred, plain):
        np.testing.assert_array_equal(d, p)


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-6), (np.float64, 1e-14)])
@pytest.mark.parametrize("sizes, n", PLAIN_CASES)
@pytest.mark.parametrize("K", [2, 4])
def test_micro_batches_equal_the_plain_path_to_rounding_and_biases_bit_for_bit(
    sizes, n, K, dtype, tol
):
    """K > 1: a deferred weight's stacked product reassociates the sum over the rows, so it
    is equal to the plain path's within tol of its largest entry, not bit for bit; every
    gradient that was not deferred (biases, weights whose rows did not fit) is bit-equal."""
    model, deferred = micro_batches(sizes, dtype, n, K, trick=True)
    _, plain = micro_batches(sizes, dtype, n, K, trick=False)
    for param, d, p in zip(model.parameters(), deferred, plain):
        if param.ndim == 2 and n // K <= param.size // sum(param.shape):  # its rows were kept
            assert np.max(np.abs(d - p)) <= tol * np.max(np.abs(p))
        else:
            np.testing.assert_array_equal(d, p)


def test_with_the_trick_off_linear_returns_an_array():
    x, W = Tensor(np.ones((2, 8))), Tensor(np.ones((8, 8)), requires_grad=True)  # 4 rows fit
    with weight_grads.deferral(False), defer_weight_grads():
        linear(x, W).sum().backward()
        assert W._pending is None and W._grad is not None
    with weight_grads.deferral(True), defer_weight_grads():
        W.grad = None
        linear(x, W).sum().backward()
        assert W._pending is not None and W._grad is None
