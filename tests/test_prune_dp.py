"""Pruning under data parallelism (minidp/parallel/prune_comm.py), in one launch: a pruned DP
run is a pruned single-process run (float64, 1e-10), every rank holds the same masks and
bitwise identical parameters after every step, the bytes sent fall as the ring's arithmetic
says, and until the first weight is pruned the run is bitwise the unpruned one.
"""

import zlib
from dataclasses import replace

import numpy as np
import pytest

from minidp import comm, optim
from minidp.config import TrainConfig
from minidp.data import DistributedSampler
from minidp.parallel import DataParallel
from minidp.prune import MagnitudePruner, cubic_sparsity
from minidp.tasks import Task

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
