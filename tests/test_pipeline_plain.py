"""The plain GPipe (parallel/pipeline/plain.py) on a model the test builds, cut by hand into
one stage per rank: a few AdamW steps equal one process on the whole batch (float64,
1e-12), and the full machinery's ScheduleGPipe (executor.py) to the bit; a batch that does
not divide into the micro-batches too; bad arguments name themselves."""

import numpy as np
import pytest
from user_models import Block

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel import PipelineStage, ScheduleGPipe, SimpleGPipe, run_schedule, split_batch

F64, WIDTH, CLASSES = np.float64, 6, 3


class Stage(nn.Module):
    """A slice of the model: an input layer on the first, blocks, a head on the last."""

    def __init__(self, s: int, num_stages: int, rng):
        self.input = nn.Linear(4, WIDTH, rng=rng, dtype=F64) if s == 0 else None
        self.blocks = [Block(WIDTH, rng) for _ in range(2)]
        self.head = nn.Linear(WIDTH, CLASSES, rng=rng, dtype=F64) if s == num_stages - 1 else None

    def forward(self, x):
        x = self.input(Tensor(x) if not isinstance(x, Tensor) else x) if self.input else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head else x


def stages(num_stages: int) -> list[Stage]:
    rng = np.random.default_rng(7)  # every rank builds every stage alike, keeps its own
    return [Stage(s, num_stages, rng) for s in range(num_stages)]


def batches(batch: int, steps: int = 3):
    rng = np.random.default_rng(11)
    return [
        (rng.standard_normal((batch, 4)), rng.integers(0, CLASSES, batch)) for _ in range(steps)
    ]


def one_process(num_stages: int, batch: int):
    parts = stages(num_stages)
    opt = optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-2)
    losses = []
    for x, y in batches(batch):
        opt.zero_grad()
        for part in parts:
            x = part(x)
        loss = cross_entropy(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, parts


def plain(group, batch: int, m: int):
    mine = stages(group.size)[group.rank]
    pipe, opt = SimpleGPipe(mine, group, m), optim.AdamW(mine.parameters(), lr=1e-2)
    losses = []
    for x, y in batches(batch):
        opt.zero_grad()
        losses.append(pipe.step(x if group.rank == 0 else None, target=y))
        opt.step()
    return losses, mine


def full(group, batch: int, m: int):
    mine = stages(group.size)[group.rank]
    stage = PipelineStage(mine, group.rank, group.size, group)
    schedule, opt = ScheduleGPipe(group.size, m), optim.AdamW(mine.parameters(), lr=1e-2)
    for x, y in batches(batch):
        opt.zero_grad()
        micro_in, micro_t, shares = split_batch(x, y, m)
        run_schedule(schedule, {group.rank: stage}, micro_in, micro_t, shares)
        opt.step()
    return mine


@pytest.mark.parallel(nprocs=[2, 4])
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("batch", "m"), [(8, 4), (7, 3)])  # 7 = 3 + 2 + 2: unequal shares
def test_plain_gpipe_equals_one_process_and_the_full_schedule(batch, m):
    group = comm.world()
    want, parts = one_process(group.size, batch)
    got, mine = plain(group, batch, m)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for p, q in zip(mine.parameters(), parts[group.rank].parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-12, atol=1e-14)
    for p, q in zip(mine.parameters(), full(group, batch, m).parameters()):
        np.testing.assert_array_equal(p.data, q.data)  # the same operations, the same bits


@pytest.mark.parallel(nprocs=[2])
def test_bad_arguments_name_themselves():
    group = comm.world()
    mine = stages(2)[group.rank]
    with pytest.raises(ValueError, match="n_microbatches must be a positive integer"):
        SimpleGPipe(mine, group, 0)
    pipe = SimpleGPipe(mine, group, 4)
    if group.rank == 1:
        with pytest.raises(ValueError, match="the last stage's step needs the batch's target"):
            pipe.step()
