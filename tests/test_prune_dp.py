"""Pruning under data parallelism (minidp/parallel/pruning.py), in one launch: a pruned DP
run is a pruned single-process run (float64, 1e-10), every rank holds the same masks and
bitwise identical parameters after every step, the bytes sent fall as the ring's arithmetic
says, and until the first weight is pruned the run is bitwise the unpruned one. Then the
same hook on a user's own DDP, over masks the torch-named functions left (prune/functions.py).
"""

import zlib
from dataclasses import replace

import numpy as np
import pytest

from minidp import Tensor, comm, nn, optim
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.models.data import DistributedSampler
from minidp.models.prune import functions as prune
from minidp.models.prune.magnitude import MagnitudePruner, cubic_sparsity
from minidp.models.tasks import Task
from minidp.parallel import DistributedDataParallel
from minidp.parallel.across_ranks import bytes_sent
from minidp.parallel.pruning import masked_allreduce_hook

STEPS = 6
CONFIG = dict(
    model="gpt", n_layer=1, n_embd=16, n_head=2, block_size=8, seed=3, batch_size=10,
    dtype="float64", bucket_mb=0.002, allreduce="ring", overlap="on", grad_accum=2,
    weight_decay=0.1, steps=STEPS, prune=0.8, prune_start=1, prune_end=4, prune_every=1,
)  # fmt: skip
LR = 1e-2


def single_process(config):
    """The reference: one process, the global batch, the pruner's own mask_grads (no DDP)."""
    task = Task(config, np.float64)
    opt = optim.AdamW(task.model.parameters(), lr=LR, weight_decay=config.weight_decay)
    pruner = MagnitudePruner(
        task.model, opt, config.prune, config.prune_start, config.prune_end, config.prune_every
    )
    sampler = DistributedSampler(task.num_examples, config.batch_size, seed=config.seed)
    losses = []
    for step in range(STEPS):
        pruner.begin_step()
        loss = task.loss(*task.batch(sampler.local_indices(step)))
        opt.zero_grad()
        loss.backward()
        pruner.mask_grads()
        optim.clip_grad_norm(task.model.parameters(), config.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, [p.data.copy() for p in task.model.parameters()]


def same_on_every_rank(arrays, group) -> bool:
    digest = zlib.crc32(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
    return len(set(group.comm.allgather(digest))) == 1


@pytest.mark.parallel(nprocs=[3])
@pytest.mark.timeout(200)
def test_pruned_data_parallel_is_pruned_single_process_training():
    group, config = comm.world(), TrainConfig(**CONFIG)
    N = group.size
    strategy = DataParallel(Task(config, np.float64), config, group)
    hook, model = strategy.pruning, strategy.task.model
    pruner = hook.pruner
    sampler = DistributedSampler(
        strategy.task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
    )
    dense_vectors = sum(p.size for p in model.parameters() if p.data.ndim < 2)
    n_prunable = sum(p.size for p in pruner.params)
    assert len(strategy.ddp.buckets) > 1 and hook.dense_elements == dense_vectors + n_prunable
    losses = []
    for step in range(STEPS):
        losses.append(strategy.step(sampler.local_indices(step), LR).loss)
        assert same_on_every_rank(pruner.masks, group), f"masks differ after step {step}"
        assert same_on_every_rank([p.data for p in model.parameters()], group)
        for p, mask in zip(pruner.params, pruner.masks):
            assert (p.data[~mask] == 0).all() and (p.grad[~mask] == 0).all()
        # the arithmetic: global pruning masks round(s_t n) weights; the ring sends
        # 2 (N-1) / N of each packed bucket per rank, so 2 (N-1) kept elements over the ranks
        s_t = cubic_sparsity(step, config.prune, config.prune_start, config.prune_end)
        kept = dense_vectors + n_prunable - round(s_t * n_prunable)
        assert hook.step_elements == kept
        assert sum(group.comm.allgather(hook.step_bytes)) == 2 * (N - 1) * kept * 8
    assert strategy.max_param_diff() == 0.0
    record = strategy.record()
    assert record["prune_sparsity"] == pytest.approx(0.8, abs=1e-4)
    assert record["prune_grad_elements_per_step"] < 0.3 * record["prune_dense_grad_elements"]
    params = [p.data.copy() for p in model.parameters()]
    strategy.close()

    want_losses, want_params = single_process(config)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    for p, q in zip(params, want_params, strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-10, atol=1e-10 * np.abs(q).max())

    # --prune 0 is the unpruned path itself; and before the first weight is pruned (step 1
    # prunes s_1 = 0) the pruned run's packed allreduce is bitwise the plain one
    with DataParallel(Task(config, np.float64), replace(config, prune=0.0), group) as plain:
        assert plain.pruning is None and plain.ddp.reducer.hook.algo == "ring"
        plain_losses = [plain.step(sampler.local_indices(s), LR).loss for s in range(3)]
    assert plain_losses[:2] == losses[:2] and plain_losses[2] != losses[2]


def user_mlp_training(group=None, steps=6):
    """A user's MLP, pruned with the functions (60% over all weights, then half of the last
    layer's rest at step 3), trained with AdamW: in one process (group None) on the whole
    batch, or under DDP with the masked hook, each rank on its slice. Returns the losses,
    the parameters, the masks, and per step the bytes this rank sent."""
    rng = np.random.default_rng(5)
    model = nn.MLP([6, 24, 24, 3], rng=rng, dtype=np.float64)
    x, y = rng.standard_normal((8, 6)), rng.integers(0, 3, 8)
    prune.global_unstructured([(layer, "weight") for layer in model.layers], 0.6)
    ddp = hook = None
    if group is not None:  # prune first, then wrap (as with frozen parameters)
        ddp = DistributedDataParallel(model, group, bucket_cap_mb=0.004, algo="ring", overlap=True)
        hook = masked_allreduce_hook(ddp)
        rows = np.array_split(np.arange(len(x)), group.size)[group.rank]
        x, y = x[rows], y[rows]
    opt = optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    losses, sent = [], []
    for step in range(steps):
        if step == 3:
            prune.l1_unstructured(model.layers[-1], "weight", 0.5, optimizer=opt)
        before = 0 if ddp is None else bytes_sent(ddp.comm_group)
        opt.zero_grad()
        loss = nn.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        if ddp is not None:
            ddp.finish_gradient_sync()
            sent.append(bytes_sent(ddp.comm_group) - before)
            assert hook.step_bytes == sent[-1]
            loss = comm.allreduce(np.array([loss.item() / group.size]), group=group)
        opt.step()
        losses.append(float(np.asarray(loss.data if ddp is None else loss).ravel()[0]))
        for layer in model.layers:
            assert (layer.weight.data[~layer.weight_mask] == 0).all(), f"step {step}"
    if ddp is not None:
        ddp.close()
    masks = [layer.weight_mask.copy() for layer in model.layers]
    return losses, [p.data.copy() for p in model.parameters()], masks, sent


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_a_users_pruned_mlp_under_ddp_with_the_masked_hook_is_one_process():
    group = comm.world()
    losses, params, masks, sent = user_mlp_training(group)
    assert same_on_every_rank(params, group) and same_on_every_rank(masks, group)
    want_losses, want_params, want_masks, _ = user_mlp_training(None)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    for p, q in zip(params, want_params, strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-10, atol=1e-10 * np.abs(q).max())
    for a, b in zip(masks, want_masks):
        np.testing.assert_array_equal(a, b)

    # the dense allreduce of the same buckets, for comparison: the masked hook sends less,
    # and less again once the last layer is pruned further (step 3)
    model = nn.MLP([6, 24, 24, 3], rng=np.random.default_rng(5), dtype=np.float64)
    with DistributedDataParallel(model, group, bucket_cap_mb=0.004, algo="ring") as dense:
        nn.cross_entropy(model(Tensor(np.ones((4, 6)))), np.zeros(4, int)).backward()
        dense.finish_gradient_sync()
        dense_bytes = bytes_sent(dense.comm_group)
    assert len(dense.buckets) > 1
    assert sent[0] == sent[2] < 0.6 * dense_bytes and sent[3] < sent[2]
