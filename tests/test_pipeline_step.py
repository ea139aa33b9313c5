"""`schedule.step` on a user's own model split by hand (torch.distributed.pipelining's
API): every schedule, 2 and 4 ranks, a batch of 10 in 4 micro-batches (3, 3, 2, 2),
leaves in each stage's .grad the gradient one process computes on the whole batch (1e-12)
and returns that loss on the last stage's rank; a rank given another micro-batch count
fails, and every rank with it, at once."""

import time

import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn
from minidp.parallel import PipelineStage
from minidp.parallel.pipeline.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBH1,
)

BATCH, MICRO = 10, 4


class Block(nn.Module):
    def __init__(self, rng):
        self.norm = nn.LayerNorm(8, dtype=np.float64)
        self.fc = nn.Linear(8, 8, rng=rng, dtype=np.float64)

    def forward(self, x):
        return x + self.fc(self.norm(x)).relu()


class First(nn.Module):
    def __init__(self, rng):
        self.embed = nn.Linear(6, 8, rng=rng, dtype=np.float64)
        self.block = Block(rng)

    def forward(self, x):
        return self.block(self.embed(Tensor(x)))


class Last(nn.Module):
    def __init__(self, rng):
        self.block, self.norm = Block(rng), nn.LayerNorm(8, dtype=np.float64)
        self.head = nn.Linear(8, 4, rng=rng, dtype=np.float64)

    def forward(self, x):
        return self.head(self.norm(self.block(x)))


def parts(n: int) -> list:
    """The user's model, cut by hand into n stages (the same on every rank: one seed)."""
    rng = np.random.default_rng(0)
    return [First(rng), *(Block(rng) for _ in range(n - 2)), Last(rng)]


def data():
    rng = np.random.default_rng(1)
    return rng.standard_normal((BATCH, 6)), rng.integers(0, 4, BATCH)


def reference(n: int):
    """One process on the whole batch: the loss and every stage's gradients."""
    model, (x, y) = parts(n), data()
    h = x
    for part in model:
        h = part(h)
    loss = cross_entropy(h, y)
    loss.backward()
    return loss.item(), [[p.grad for p in part.parameters()] for part in model]


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb-h1": ScheduleZBH1}


@pytest.mark.parallel(nprocs=[2, 4])
def test_every_schedule_steps_a_users_model_as_one_process():
    group = comm.world()
    P = group.size
    for name in [*SCHEDULES, "interleaved"]:
        V = 2 if name == "interleaved" else 1
        want_loss, want_grads = reference(P * V)
        model = parts(P * V)
        mine = list(range(group.rank, P * V, P))
        stages = [PipelineStage(model[s], s, P * V, group) for s in mine]
        if name == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, MICRO, cross_entropy)
        else:
            schedule = SCHEDULES[name](stages[0], MICRO, cross_entropy)
        x, y = data()
        losses = []
        first, last = 0 in mine, P * V - 1 in mine
        loss = schedule.step(*([x] if first else []), target=y if last else None, losses=losses)
        if last:
            assert abs(loss - want_loss) < 1e-12, (name, loss, want_loss)
            assert len(losses) == MICRO and abs(np.dot(losses, [3, 3, 2, 2]) / 10 - loss) < 1e-12
        else:
            assert loss is None and losses == []
        for s in mine:
            for p, g in zip(model[s].parameters(), want_grads[s]):
                np.testing.assert_allclose(p.grad, g, rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.mark.parallel(nprocs=[2])
def test_a_rank_given_another_micro_batch_count_fails_every_rank_at_once():
    group = comm.world()
    model = parts(2)
    stage = PipelineStage(model[group.rank], group.rank, 2, group)
    schedule = Schedule1F1B(stage, MICRO if group.rank == 0 else MICRO - 1, cross_entropy)
    x, y = data()
    start = time.monotonic()
    with pytest.raises(ValueError, match="same n_microbatches"):
        schedule.step(*([x] if group.rank == 0 else []), target=y if group.rank else None)
    assert time.monotonic() - start < 1.0
