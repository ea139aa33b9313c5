"""`ZeroRedundancyOptimizer` is the unsharded optimizer, sharded: on a model the test builds
(an MLP with a frozen bias, a parameter no forward reaches, one parameter passed twice), the
same parameters after every step (float64, 1e-10), replicas identical to the bit, frozen
parameters never moved; alone (the user averages the gradients) and after DDP. One
allgather of Ψ per step: (N-1)·Ψ·b bytes sent by the ranks together.
"""

import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel import DistributedDataParallel, ZeroRedundancyOptimizer
from minidp.parallel.across_ranks import replica_spread
from minidp.tools.chunks import chunk_range

STEPS, BATCH = 4, 10  # 10 examples: uneven slices over 3 ranks
OPTIMIZERS = {
    "adamw": (optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "momentum": (optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
}


class Net(nn.Module):
    """Ψ = 54 + 9 + 45 + 20 + 4 + 7 = 139 trainable elements (layer 1's bias is frozen)."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.mlp = nn.MLP([6, 9, 5, 4], rng=rng, dtype=np.float64)
        self.mlp.layers[1].bias.requires_grad = False  # frozen
        self.unused = nn.Parameter(rng.standard_normal(7))  # no forward reads it

    def forward(self, x):
        return self.mlp(x)


def passed(model):
    """What the user hands over: every parameter, the first layer's weight twice."""
    return [*model.parameters(), model.mlp.layers[0].weight]


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def batch(step):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((BATCH, 6)), rng.integers(0, 4, BATCH)


def my_slice(x, y, group):
    lo, hi = chunk_range(len(y), group.size, group.rank)
    return Tensor(x[lo:hi]), y[lo:hi]


def lr_at(step, defaults):
    return optim.warmup_cosine(step, defaults["lr"], warmup=2, total=STEPS)


def check(model, ref, start, group, where):
    """model (sharded optimizer) equals ref (plain optimizer); frozen never moved; replicas
    the same to the bit."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(
            p.data, q.data, rtol=1e-10, atol=1e-12, err_msg=f"{where} {name}"
        )
    frozen = model.mlp.layers[1].bias
    assert np.array_equal(frozen.data, start["mlp.layers.1.bias"]), where
    assert replica_spread([p.data for p in model.parameters()], group) == 0.0, where


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(120)
def test_alone_equals_the_unsharded_optimizer_on_one_process():
    """Each rank backpropagates its slice and the test averages the gradients (the user's
    job here); the reference is one process on the whole batch."""
    group = comm.world()
    for name, (cls, defaults) in OPTIMIZERS.items():
        model, ref = Net(), Net()
        start = {k: v.copy() for k, v in model.state_dict().items()}
        zero = ZeroRedundancyOptimizer(passed(model), cls, group, **defaults)
        plain = cls(trainable(ref), **defaults)
        assert len(zero.params) == len(trainable(model))  # repeated once, frozen left out
        group.reset_counters()
        for step in range(STEPS):
            x, y = batch(step)
            zero.zero_grad()
            x_mine, y_mine = my_slice(x, y, group)
            (cross_entropy(model(x_mine), y_mine) * (len(y_mine) / BATCH)).backward()
            for p in zero.params:  # unused: None on every rank, so skipped on every rank
                if p.grad is not None:
                    comm.allreduce(p.grad, group=group, out=p.grad)
            zero.lr = lr_at(step, defaults)
            zero.step()
            plain.zero_grad()
            cross_entropy(ref(Tensor(x)), y).backward()
            plain.lr = lr_at(step, defaults)
            plain.step()
            check(model, ref, start, group, f"{name} N={group.size} step {step}")
            assert model.unused.grad is None
            assert np.array_equal(model.unused.data, start["unused"])  # no grad: not moved
        # bytes: one allgather of Ψ a step; each element goes once to each rank lacking it
        psi, n = zero.layout.numel, group.size
        assert psi == 139
        gathered = group.counters["allgather"]
        sent = comm.allreduce(np.array([gathered["bytes_sent"]]), group=group)[0]
        assert gathered["calls"] == STEPS and sent == STEPS * (n - 1) * psi * 8
        mine = comm.allreduce(np.array([zero.shard_numel]), group=group)[0]
        assert mine == psi  # the chunks cover Ψ once
        # resuming: a fresh piece on a copy of the model, loaded, takes the same next step
        state, copy = zero.state_dict(), Net()
        copy.load_state_dict(model.state_dict())
        again = ZeroRedundancyOptimizer(passed(copy), cls, group, **defaults)
        again.load_state_dict(state)
        for p, q in zip(zero.params, again.params):
            p.grad = q.grad = np.full(p.shape, 0.5)  # the same whole gradient on every rank
        zero.step()
        again.step()
        for p, q in zip(model.parameters(), copy.parameters()):
            assert np.array_equal(p.data, q.data), f"{name} resumed"


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(120)
def test_after_ddp_equals_ddp_with_the_unsharded_optimizer():
    """loss.backward(); ddp.finish_gradient_sync(); zero.step(). DDP leaves the frozen bias
    alone (no .grad) and the parameter no rank reached with .grad None, so the reference is
    DDP with the plain optimizer over the trainable parameters: neither moves."""
    group = comm.world()
    for name, (cls, defaults) in OPTIMIZERS.items():
        model, ref = Net(), Net()
        start = {k: v.copy() for k, v in model.state_dict().items()}
        with (
            DistributedDataParallel(model, group, bucket_cap_mb=0.0005) as ddp,
            DistributedDataParallel(ref, group, bucket_cap_mb=0.0005) as ref_ddp,
        ):
            zero = ZeroRedundancyOptimizer(passed(model), cls, group, **defaults)
            plain = cls(trainable(ref), **defaults)
            for step in range(STEPS):
                x, y = my_slice(*batch(step), group)
                for wrapped, opt in ((ddp, zero), (ref_ddp, plain)):
                    wrapped.zero_grad()
                    wrapped.set_batch_share(len(y), BATCH)
                    cross_entropy(wrapped(x), y).backward()
                    wrapped.finish_gradient_sync()
                    opt.lr = lr_at(step, defaults)
                    opt.step()
                check(model, ref, start, group, f"{name} N={group.size} DDP step {step}")
                assert model.mlp.layers[1].bias.grad is None and model.unused.grad is None


# ---- serial ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_group_of_one_is_exactly_the_plain_optimizer(name):
    cls, defaults = OPTIMIZERS[name]
    model, ref = Net(), Net()
    zero = ZeroRedundancyOptimizer(passed(model), cls, **defaults)
    plain = cls(trainable(ref), **defaults)
    for step in range(STEPS):
        x, y = batch(step)
        for m, opt in ((model, zero), (ref, plain)):
            opt.zero_grad()
            cross_entropy(m(Tensor(x)), y).backward()
            opt.lr = lr_at(step, defaults)
            opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert np.array_equal(p.data, q.data), (name, step)
    # one piece per parameter, whole: the same state as the plain optimizer's, to the bit
    for mine, theirs in zip(zero.optimizer.state, plain.state):
        for key, value in theirs.items():
            assert np.array_equal(np.ravel(mine[key]), np.ravel(value)), key
    assert zero.lr == plain.lr == lr_at(STEPS - 1, defaults)


def test_bad_arguments_name_the_argument():
    model = Net()
    with pytest.raises(TypeError, match="optimizer_class"):
        ZeroRedundancyOptimizer(model.parameters(), "adamw", lr=0.1)
    with pytest.raises(TypeError, match="optimizer_class"):
        ZeroRedundancyOptimizer(model.parameters(), optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="params is empty"):
        ZeroRedundancyOptimizer([], optim.SGD, lr=0.1)
    frozen = nn.Parameter(np.zeros(3))
    frozen.requires_grad = False
    with pytest.raises(ValueError, match="params has 1 tensors and none requires grad"):
        ZeroRedundancyOptimizer([frozen], optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"params\[1\]"):
        ZeroRedundancyOptimizer([model.unused, np.zeros(3)], optim.SGD, lr=0.1)
    mixed = [nn.Parameter(np.zeros(2)), nn.Parameter(np.zeros(2, np.float32))]
    with pytest.raises(TypeError, match="params must share one dtype"):
        ZeroRedundancyOptimizer(mixed, optim.SGD, lr=0.1)


def test_a_state_of_another_cut_or_a_replaced_parameter_is_refused():
    model = Net()
    zero = ZeroRedundancyOptimizer(model.parameters(), optim.AdamW)
    state = zero.state_dict()
    with pytest.raises(ValueError, match="rank 1 of 2"):
        zero.load_state_dict({**state, "size": 2, "rank": 1})
    model.unused.data = np.zeros(7)  # rebound: the piece no longer updates the model
    with pytest.raises(RuntimeError, match="replaced"):
        zero.step()
