"""DDP on a model the user built, shared, frozen and unused parameters and all, as PyTorch's
DDP takes it: the same training as one process on the whole global batch (float64, 1e-10),
whatever the buckets, with overlap on and off.
"""

import numpy as np
import pytest
from test_data_parallel import assert_replicas_bitwise_identical

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.nn import Module, Parameter
from minidp.parallel import DistributedDataParallel, ModelMismatch
from minidp.parallel.data_parallel.buckets import bucket_groups
from minidp.tools.chunks import chunk_range

B, STEPS = 7, 4  # 7 examples: 4 + 3 at 2 ranks
# the examples flagged "rare" at each step (rank 0 reads 0-3, rank 1 reads 4-6): `rare` is
# reached on rank 0 only, then on no rank, then on both, then on rank 1 only
RARE = [(0,), (), (1, 5), (6,)]


class TiedFrozenUnused(Module):
    """fc4 uses fc2's weight (tied, as GPT-2 ties its embedding and head); fc3's bias and
    `scale` are frozen; `rare` is used only for examples flagged rare, `spare` never."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)
        kw = dict(rng=rng, dtype=np.float64)
        self.scale = Parameter(rng.uniform(0.5, 1.5, 8))
        self.scale.requires_grad = False
        self.rare = Parameter(rng.standard_normal(8))
        self.fc1, self.fc2, self.fc3, self.fc4 = (nn.Linear(a, 8, **kw) for a in (6, 8, 8, 8))
        self.fc4.weight = self.fc2.weight
        self.fc3.bias.requires_grad = False
        self.head, self.spare = nn.Linear(8, 3, **kw), nn.Linear(8, 3, **kw)

    def forward(self, x: np.ndarray, rare: np.ndarray) -> Tensor:
        h = self.fc2(self.fc1(Tensor(x), relu=True), relu=True)
        if rare.any():  # else no backward reaches `rare`
            h = h + Tensor(rare[:, None] * 1.0) * self.rare
        h = self.fc4(self.fc3(h).tanh()) * self.scale
        return self.head(h)


def batch(step: int):
    rng = np.random.default_rng(100 + step)
    x, y = rng.standard_normal((B, 6)), rng.integers(0, 3, B)
    rare = np.isin(np.arange(B), RARE[step])
    return x, y, rare


def make_optimizer(params):
    return optim.AdamW(params, lr=0.05, weight_decay=0.1)


def reference():
    """One process, the whole global batch, from rank 0's initial weights: each step's loss,
    parameters after it, and which parameters had no gradient."""
    model = TiedFrozenUnused(seed=10)
    opt = make_optimizer(model.parameters())
    steps = []
    for step in range(STEPS):
        x, y, rare = batch(step)
        opt.zero_grad()
        loss = cross_entropy(model(x, rare), y)
        loss.backward()
        no_grad = [p.grad is None for p in model.parameters()]
        opt.step()
        steps.append((loss.item(), [p.data.copy() for p in model.parameters()], no_grad))
    return TiedFrozenUnused(seed=10), steps


def caps_for(model: Module) -> dict[int, float]:
    """bucket_cap_mb giving 1, 2 and 3 buckets for this model's trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    caps = {}
    for cap in range(8, sum(p.data.nbytes for p in params) + 1, 8):
        caps.setdefault(len(bucket_groups(params, cap)), cap / 2**20)
    return {n: caps[n] for n in (1, 2, 3)}


def train(group, cap_mb, overlap, algo, want):
    start, steps = want
    r = group.rank
    model = TiedFrozenUnused(seed=10 + r)  # each rank starts from other weights
    ddp = DistributedDataParallel(model, group, bucket_cap_mb=cap_mb, algo=algo, overlap=overlap)
    for p, q in zip(model.parameters(), start.parameters(), strict=True):
        np.testing.assert_array_equal(p.data, q.data)  # rank 0's, the frozen ones too
    slots = [p for b in ddp.buckets for p in b.params]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(slots) == len(trainable) == 11 and {id(p) for p in slots} == set(map(id, trainable))
    frozen = {id(p): p.data.copy() for p in (model.scale, model.fc3.bias)}
    opt = make_optimizer(ddp.parameters())
    lo, hi = chunk_range(B, group.size, r)
    for step, (want_loss, want_params, want_none) in enumerate(steps):
        x, y, rare = batch(step)
        ddp.zero_grad()
        ddp.set_batch_share(hi - lo, B)
        local = cross_entropy(ddp(x[lo:hi], rare[lo:hi]), y[lo:hi])
        local.backward()
        calls = group.counters.get("allreduce", {}).get("calls", 0)
        ddp.finish_gradient_sync()
        # the reached flags: one small allreduce on the group (the buckets go on their own)
        assert group.counters["allreduce"]["calls"] == calls + 1
        # no gradient exactly where one process has none: `spare`, the frozen ones, and
        # `rare` at the step no rank reached it (though rank 0 or 1 alone did elsewhere)
        assert [p.grad is None for p in model.parameters()] == want_none, step
        assert (model.rare.grad is None) == (step == 1)
        opt.step()
        loss = comm.allreduce(np.array([local.item() * ddp.share]), group=group)[0]
        np.testing.assert_allclose(loss, want_loss, rtol=1e-10)
        for p, q in zip(model.parameters(), want_params, strict=True):
            np.testing.assert_allclose(p.data, q, rtol=1e-10, atol=1e-12)
        assert_replicas_bitwise_identical(model, group, step)
    for p in (model.scale, model.fc3.bias):
        np.testing.assert_array_equal(p.data, frozen[id(p)])
    np.testing.assert_array_equal(model.spare.weight.data, start.spare.weight.data)
    ddp.close()
    return [p.data.copy() for p in model.parameters()]


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(300)
def test_shared_frozen_and_unused_parameters_train_as_one_process():
    group = comm.world()
    want = reference()
    got = {}
    for n, cap_mb in caps_for(want[0]).items():
        for algo in ("auto", "ring"):
            for overlap in (False, True):
                got[n, algo, overlap] = train(group, cap_mb, overlap, algo, want)
    # the buckets reduced together after backward, or one by one during it: the same bits
    for n in (1, 2, 3):
        for p, q in zip(got[n, "auto", False], got[n, "auto", True], strict=True):
            np.testing.assert_array_equal(p, q)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_a_second_backward_before_the_sync_is_refused_with_overlap_on_and_off():
    group = comm.world()
    x, y, rare = batch(2)
    for overlap in (False, True):
        model = TiedFrozenUnused(seed=0)
        for p in model.spare.parameters():  # frozen: every trainable parameter is reached
            p.requires_grad = False
        with DistributedDataParallel(model, group, bucket_cap_mb=1e-4, overlap=overlap) as ddp:
            cross_entropy(ddp(x, rare), y).backward()
            # with overlap the hooks have launched every bucket: the case that went unnoticed
            assert ddp.buckets_launched == (len(ddp.buckets) if overlap else 0)
            with pytest.raises(RuntimeError, match=r"second backward .* finish_gradient_sync"):
                cross_entropy(ddp(x, rare), y).backward()


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_gradients_set_by_hand_are_averaged_not_dropped():
    """No backward at all: .grad assigned by hand (rank r: r + 1 everywhere) is reached, so
    the sync leaves every trainable parameter the mean, 1.5, never None."""
    group = comm.world()
    model = TiedFrozenUnused(seed=0)
    with DistributedDataParallel(model, group, bucket_cap_mb=1e-4, overlap=False) as ddp:
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            p.grad = np.full(p.shape, group.rank + 1.0)
        ddp.finish_gradient_sync()
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert p.grad is not None, name
                np.testing.assert_array_equal(p.grad, 1.5, err_msg=name)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_a_rank_that_froze_another_parameter_holds_another_model():
    group = comm.world()
    model = TiedFrozenUnused(seed=0)
    if group.rank == 1:
        model.fc1.bias.requires_grad = False
    with pytest.raises(ModelMismatch, match=r"rank 1 has 'fc1.bias \(8,\) float64 frozen'"):
        DistributedDataParallel(model, group)


def test_a_model_with_nothing_to_train_is_refused():
    model = TiedFrozenUnused(seed=0)
    for p in model.parameters():
        p.requires_grad = False
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        DistributedDataParallel(model, comm.world())
