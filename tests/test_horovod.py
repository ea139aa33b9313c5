"""Horovod's API (`import minidp.horovod as hvd`) on a user's model: ranks that start from
different weights, put right by the broadcasts, train as one process on the whole batch
(float64, 1e-12), with backward_passes_per_step=2 too; fp16 compression stays within 1e-2
of it after 3 steps; Adasum is its pairwise formula, applied as a tree over the ranks;
`join` (Horovod's and DDP's) with one rank a batch short: no hang, and the model one
process trains on the examples seen."""

import numpy as np
import pytest

import minidp.horovod as hvd
from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel import DistributedDataParallel
from minidp.parallel.horovod.adasum import adasum_pair
from minidp.tools.chunks import chunk_range

BATCH = 12  # equal slices over 2, 3 and 4 ranks: Horovod's Average is the mean of means


class Net(nn.Module):
    def __init__(self):
        rng = np.random.default_rng(0)
        self.fc1 = nn.Linear(5, 7, rng=rng, dtype=np.float64)
        self.fc2 = nn.Linear(7, 3, rng=rng, dtype=np.float64)

    def forward(self, x):
        return self.fc2(self.fc1(Tensor(x), relu=True))


def batch(step: int):
    rng = np.random.default_rng(50 + step)
    return rng.standard_normal((BATCH, 5)), rng.integers(0, 3, BATCH)


def one_process(steps, make_opt, seen=None) -> dict:
    """The whole batch (or, for step t, the rows seen[t]) on one process."""
    model = Net()
    opt = make_opt(model.parameters())
    for step in steps:
        x, y = batch(step)
        rows = slice(None) if seen is None else seen[step]
        opt.zero_grad()
        cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return {k: v.copy() for k, v in model.state_dict().items()}


def adamw(params):
    return optim.AdamW(params, lr=0.05, weight_decay=0.1)


def horovod_run(steps, passes=1, compression=hvd.Compression.none) -> dict:
    hvd.init()
    model = Net()
    for p in model.parameters():  # each rank its own start: the broadcast puts it right
        p.data += 0.3 * hvd.rank()
    opt = hvd.DistributedOptimizer(
        adamw(model.parameters()),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        compression=compression,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    lo, hi = chunk_range(BATCH, hvd.size(), hvd.rank())
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        cuts = np.array_split(np.arange(lo, hi), passes)
        for rows in cuts:  # each pass's loss weighted by its share: they sum to the mean
            loss = cross_entropy(model(x[rows]), y[rows]) * (len(rows) / (hi - lo))
            loss.backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parallel(nprocs=[4])
def test_horovods_loop_is_one_process():
    want = one_process(range(3), adamw)
    for passes in (1, 2):
        got = horovod_run(range(3), passes)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-12, err_msg=f"{passes} {name}")
    got = horovod_run(range(3), compression=hvd.Compression.fp16)  # half the bytes: close
    gap = max(np.abs(got[k] - v).max() for k, v in want.items())
    assert 0 < gap < 1e-2, gap


@pytest.mark.parallel(nprocs=[4])
def test_adasum_is_its_pairwise_formula_as_a_tree():
    hvd.init()
    rng = np.random.default_rng(3)
    every = rng.standard_normal((4, 6))
    got = hvd.allreduce(every[hvd.rank()].copy(), op=hvd.Adasum)

    def by_hand(a, b):
        dot = a @ b
        return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b

    want = by_hand(by_hand(every[0], every[1]), by_hand(every[2], every[3]))
    np.testing.assert_allclose(got, want, rtol=1e-13)
    g = rng.standard_normal(6)
    np.testing.assert_allclose(adasum_pair(g, g), g, rtol=1e-15)  # alike: the average
    a, h = np.r_[g[0], g[1], np.zeros(4)], np.r_[-g[1], g[0], np.zeros(4)]
    np.testing.assert_allclose(adasum_pair(a, h), a + h, rtol=1e-15)  # orthogonal: the sum


def seen_rows(size: int, short: int, steps: int) -> list:
    """The rows of each step's batch the ranks still in hold (rank `short` has one batch
    less: absent from the last step)."""
    seen = []
    for step in range(steps):
        ranks = [r for r in range(size) if not (r == short and step == steps - 1)]
        seen.append(np.concatenate([np.arange(*chunk_range(BATCH, size, r)) for r in ranks]))
    return seen


@pytest.mark.parallel(nprocs=[3])
def test_join_with_a_rank_a_batch_short_is_one_process_on_what_was_seen():
    group = comm.world()
    short, steps = group.size - 1, 3
    want = one_process(range(steps), adamw, seen_rows(group.size, short, steps))
    mine = range(steps - 1) if group.rank == short else range(steps)
    lo, hi = chunk_range(BATCH, group.size, group.rank)
    # PyTorch DDP's join
    model = Net()
    with DistributedDataParallel(model, group) as ddp:
        opt = adamw(model.parameters())
        with ddp.join():
            for step in mine:
                x, y = batch(step)
                opt.zero_grad()
                cross_entropy(ddp(x[lo:hi]), y[lo:hi]).backward()
                ddp.finish_gradient_sync()
                opt.step()
    for name, value in want.items():  # every rank: the last one's model after join
        np.testing.assert_allclose(model.state_dict()[name], value, rtol=1e-12, err_msg=name)
    assert ddp.share == 1 / group.size  # the weight before the block, back
    # Horovod's
    hvd.init()
    model = Net()
    opt = hvd.DistributedOptimizer(adamw(model.parameters()))
    for step in mine:
        x, y = batch(step)
        opt.zero_grad()
        cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    assert hvd.join() == 0  # the lowest of the ranks that joined last
    if group.rank != short:
        for name, value in want.items():
            np.testing.assert_allclose(model.state_dict()[name], value, rtol=1e-12)


def test_a_frozen_parameter_stays_and_a_new_wrapper_replaces_the_old_ones():
    """Horovod reduces only what requires grad: a frozen bias gets no gradient (no weight
    decay moves it); wrapping parameters again closes the wrappers that held any of them."""
    hvd.init()
    model = Net()
    model.fc1.bias.requires_grad = False
    frozen = model.fc1.bias.data.copy()
    a = hvd.DistributedOptimizer(optim.SGD([model.fc1.weight], lr=0.1))
    b = hvd.DistributedOptimizer(optim.SGD([model.fc2.weight], lr=0.1))
    both = hvd.DistributedOptimizer(optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5))
    assert not a._unhook and not b._unhook  # closed: their hooks count no more passes
    x, y = batch(0)
    both.zero_grad()
    cross_entropy(model(x), y).backward()
    both.step()
    np.testing.assert_array_equal(model.fc1.bias.data, frozen)
    both.close()
