"""Data parallelism is single-process training, split: same global batch, same seed, same
losses and parameters (float64: 1e-10 relative), and every rank holds identical parameters.
"""

import hashlib
from dataclasses import replace

import numpy as np
import pytest

from minidp import Tensor, comm, nn, optim
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.nn import Module, Parameter
from minidp.parallel import DistributedDataParallel, ModelMismatch
from minidp.parallel.across_ranks import replica_spread

STEPS = 3
TINY = dict(n_layer=1, n_embd=16, n_head=2, block_size=8, hidden=16, seed=3)


def make_optimizer(name, params):
    if name == "sgd":
        return optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    return optim.AdamW(params, lr=0.01, weight_decay=0.1)


def reference(config, opt_name):
    """Plain single-process training on the global batch: no DDP, no communication."""
    task = Task(config, np.dtype(config.dtype))
    opt = make_optimizer(opt_name, task.model.parameters())
    sampler = DistributedSampler(task.num_examples, config.batch_size, seed=config.seed)
    losses = []
    for step in range(STEPS):
        loss = task.loss(*task.batch(sampler.local_indices(step)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.data.copy() for p in task.model.parameters()]


def max_param_difference(model, group):
    return replica_spread([p.data for p in model.parameters()], group)


def assert_replicas_bitwise_identical(model, group, step):
    """Every rank's parameters hash to the same sha256 (compared through mpi4py itself)."""
    digest = hashlib.sha256(b"".join(p.data.tobytes() for p in model.parameters())).hexdigest()
    digests = group.comm.allgather(digest)
    assert len(set(digests)) == 1, f"after step {step} the replicas differ: {digests}"


def data_parallel(config, opt_name, group, overlap=True, grad_accum=1, algo="auto"):
    """Train STEPS steps with the "dp" strategy, as the training loop drives it."""
    task = Task(config, np.dtype(config.dtype))
    # a tiny bucket cap: several buckets, so overlap really launches them during backward
    config = replace(
        config,
        bucket_mb=0.002,
        allreduce=algo,
        overlap="on" if overlap else "off",
        grad_accum=grad_accum,
        grad_clip=0.0,
    )
    opt = make_optimizer(opt_name, task.model.parameters())
    strategy = DataParallel(task, config, group, optimizer=opt)
    ddp = strategy.ddp
    sampler = DistributedSampler(
        task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
    )
    losses = []
    for step in range(STEPS):
        losses.append(strategy.step(sampler.local_indices(step), opt.lr).loss)
        assert_replicas_bitwise_identical(task.model, group, step)
    assert strategy.max_param_diff() == 0.0, "ranks' parameters differ"
    strategy.close()
    assert ddp.comm_group.broken == "freed", "close() must free the thread's communicator"
    ddp.close()  # twice is harmless
    return losses, [p.data.copy() for p in task.model.parameters()], len(ddp.buckets)


def assert_same_training(got, want, rtol):
    (losses, params), (ref_losses, ref_params) = got[:2], want
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    for p, q in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(p, q, rtol=rtol, atol=rtol * np.abs(q).max())


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.timeout(300)
def test_matches_single_process_float64():
    group = comm.world()
    for model in ("mlp", "gpt"):
        # 10 does not divide by 3 or 4: the first ranks take one example more
        config = TrainConfig(model=model, batch_size=10, dtype="float64", **TINY)
        for opt_name in ("sgd", "adamw"):
            want = reference(config, opt_name)
            for overlap in (True, False):
                for grad_accum in (1, 2):
                    got = data_parallel(config, opt_name, group, overlap, grad_accum)
                    assert got[2] > 1, "the test needs several buckets"
                    assert_same_training(got, want, rtol=1e-10)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(200)
def test_matches_single_process_float32_gpt():
    config = TrainConfig(model="gpt", batch_size=12, dtype="float32", **TINY)
    assert_same_training(
        data_parallel(config, "sgd", comm.world()), reference(config, "sgd"), rtol=1e-5
    )
    # Adam divides by sqrt(v): where a gradient is ~0, float32 rounding of the sum decides the
    # update's sign, so compare AdamW's losses, not every parameter.
    got, want = data_parallel(config, "adamw", comm.world()), reference(config, "adamw")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)


@pytest.mark.parallel(nprocs=[2, 4])
@pytest.mark.timeout(200)
def test_every_allreduce_algorithm_trains_like_one_process():
    # 11 examples: 6 + 5 at 2 ranks, 3 + 3 + 3 + 2 at 4; each slice in 2 micro-batches
    config = TrainConfig(model="mlp", batch_size=11, dtype="float64", **TINY)
    want = reference(config, "adamw")
    for algo in comm.ALGORITHMS["allreduce"]:
        got = data_parallel(config, "adamw", comm.world(), grad_accum=2, algo=algo)
        assert_same_training(got, want, 1e-10)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_overlap_launches_every_bucket_during_backward():
    task = Task(TrainConfig(model="mlp", **TINY), np.float64)
    for overlap in (True, False):
        ddp = DistributedDataParallel(
            task.model, comm.world(), bucket_cap_mb=0.002, overlap=overlap
        )
        assert len(ddp.buckets) >= 3, "the test needs several buckets"
        ddp.zero_grad()
        task.loss(*task.batch(np.arange(4))).backward()
        # before finish_gradient_sync: with overlap the hooks have handed over every bucket
        assert ddp.buckets_launched == (len(ddp.buckets) if overlap else 0)
        ddp.finish_gradient_sync()
        ddp.close()


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_parameters_start_from_rank_0():
    group = comm.world()
    config = TrainConfig(model="mlp", **{**TINY, "seed": 10 + group.rank})  # different inits
    task = Task(config, np.float64)
    ddp = DistributedDataParallel(task.model, group)
    assert max_param_difference(task.model, group) == 0.0
    want = Task(TrainConfig(model="mlp", **{**TINY, "seed": 10}), np.float64).model
    for p, q in zip(task.model.parameters(), want.parameters(), strict=True):
        np.testing.assert_array_equal(p.data, q.data)
    ddp.close()


@pytest.mark.parallel(nprocs=[3])
@pytest.mark.timeout(60)
def test_different_models_are_a_clear_error_on_every_rank():
    group = comm.world()
    hidden = 16 if group.rank != 2 else 24  # rank 2 built another model
    task = Task(TrainConfig(model="mlp", **{**TINY, "hidden": hidden}), np.float64)
    with pytest.raises(ModelMismatch, match=r"rank 2 .*layers\.0\.weight"):
        DistributedDataParallel(task.model, group)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_gradients_are_views_into_buckets():
    task = Task(TrainConfig(model="mlp", **TINY), np.float64)
    ddp = DistributedDataParallel(task.model, comm.world(), bucket_cap_mb=0.002)
    for bucket in ddp.buckets:
        for p in bucket.params:
            assert np.shares_memory(p.grad, bucket.data)
    order = [p for b in ddp.buckets for p in b.params]
    assert order == task.model.parameters()[::-1], "buckets fill in reverse parameter order"
    ddp.close()


class ThreeWeights(Module):
    """loss = sum over used weights of sum(x @ W): dloss/dW = outer(x.sum(0), 1), by hand."""

    def __init__(self):
        self.w0, self.w1, self.w2 = (Parameter(np.zeros((4, 3))) for _ in range(3))

    def loss(self, x: np.ndarray, used: tuple) -> Tensor:
        return sum((Tensor(x) @ getattr(self, f"w{i}")).sum() for i in used)


def by_hand(x: np.ndarray) -> np.ndarray:
    return np.outer(x.sum(0), np.ones(3))


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(60)
def test_unused_parameters_no_sync_and_replaced_grads_give_the_mean_gradient():
    group = comm.world()
    p = group.size
    xs = [np.random.default_rng(k).standard_normal((2, 4)) for k in range(p)]  # rank k's data
    for overlap in (True, False):  # the ordering matters with overlap: buckets go from hooks
        unused_parameters_give_the_mean_gradient(group, xs, overlap)


def unused_parameters_give_the_mean_gradient(group, xs, overlap):
    p, r = group.size, group.rank
    model = ThreeWeights()
    ddp = DistributedDataParallel(model, group, bucket_cap_mb=1e-6, overlap=overlap)
    assert len(ddp.buckets) == 3  # one weight per bucket

    # w2 fills bucket 0, yet only rank 0 uses it: its bucket must wait for the finish on
    # every rank, or the ranks would run their allreduces in different orders
    ddp.zero_grad()
    model.loss(xs[r], (0, 1, 2) if r == 0 else (0, 1)).backward()
    ddp.finish_gradient_sync()
    mean = sum(by_hand(x) for x in xs) / p
    np.testing.assert_allclose(model.w0.grad, mean)
    np.testing.assert_allclose(model.w2.grad, by_hand(xs[0]) / p)

    # accumulation: a no_sync backward that leaves w1 unused, then a full one
    ddp.zero_grad()
    with ddp.no_sync():
        model.loss(xs[r], (0, 2)).backward()
    model.loss(xs[r], (0, 1, 2)).backward()
    ddp.finish_gradient_sync()
    np.testing.assert_allclose(model.w0.grad, 2 * mean)
    np.testing.assert_allclose(model.w1.grad, mean)

    # an optimizer's set-to-None zero_grad, with w1 unused on every rank: None (no rank's
    # backward reached it), not last step's gradient, nor zeros an optimizer would step on
    for w in model.parameters():
        w.grad = None
    model.loss(xs[r], (0, 2)).backward()
    ddp.finish_gradient_sync()
    np.testing.assert_allclose(model.w0.grad, mean)
    assert model.w1.grad is None

    # a .grad replaced by hand is dropped by ddp.zero_grad, which sets every .grad to None
    model.w0.grad = model.w0.grad * 0.5
    ddp.zero_grad()
    assert all(w.grad is None for w in model.parameters())
    ddp.close()


def test_closing_restores_the_gil_switch_interval_after_the_last_thread():
    import sys

    before = sys.getswitchinterval()
    models = [Task(TrainConfig(model="mlp", **TINY), np.float64).model for _ in range(2)]
    first, second = (DistributedDataParallel(m, comm.world(), overlap=True) for m in models)
    assert sys.getswitchinterval() < before  # shortened while a communication thread runs
    first.close()
    assert sys.getswitchinterval() < before  # the second thread still runs
    second.close()
    assert sys.getswitchinterval() == before


def test_each_gradient_is_weighed_into_its_bucket_as_backward_finishes_it():
    """Overlap or not, a grad-ready hook weighs each gradient by n_r / B into its bucket
    slot the moment it is final (hot in cache), so finish_gradient_sync reads nothing to
    scale or copy; under no_sync nothing is weighed; close() unhooks every parameter."""
    for overlap in (False, True):
        model = Task(TrainConfig(model="mlp", **TINY), np.float64).model
        ddp = DistributedDataParallel(model, comm.world(), overlap=overlap)
        ddp.set_batch_share(1, 4)
        x, y = np.ones((2, model.layers[0].weight.shape[0])), np.array([0, 1])
        with ddp.no_sync():
            nn.cross_entropy(ddp(Tensor(x)), y).backward()
        assert not any(any(b.weighed) for b in ddp.buckets)
        local = {id(p): p.grad.copy() for p in model.parameters()}
        for p in model.parameters():
            p.grad = None  # as an optimizer's zero_grad leaves them: new arrays come back
        nn.cross_entropy(ddp(Tensor(x)), y).backward()
        if not overlap:  # before the finish: every slot already weighed, every .grad its view
            for bucket in ddp.buckets:
                assert all(bucket.weighed)
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    assert p.grad is view
                    assert np.array_equal(view, local[id(p)] * 0.25)
        ddp.finish_gradient_sync()
        assert all(len(p._hooks) == 1 for p in model.parameters())
        ddp.close()
        assert all(not p._hooks for p in model.parameters())


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_replica_spread_walks_the_arrays_in_small_chunks_and_sees_every_element():
    """The end-of-run check packs small arrays and cuts large ones (never a model-sized
    array): a difference in the last element of the last chunk and a NaN both show."""
    group = comm.world()
    arrays = [np.zeros(3), np.zeros((5, 7)), np.zeros(1)]
    assert replica_spread(arrays, group, chunk=4) == 0.0
    arrays[1][4, 6] = 0.5 * group.rank  # element 37 of 39: in the tenth chunk of four
    assert replica_spread(arrays, group, chunk=4) == 0.5
    assert replica_spread(arrays, group) == 0.5  # one chunk holds them all
    arrays[2][0] = np.nan if group.rank == 1 else 0.0
    assert np.isnan(replica_spread(arrays, group, chunk=4))
    assert np.isnan(replica_spread([np.array([1.0, np.inf])], group))  # inf - inf: not 0
