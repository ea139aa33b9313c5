"""The plain GPipe (parallel/pipeline/plain.py) on models the test builds, cut by hand into
one stage per rank, case by case (float64; float32 fed float64 data; token ids into an
Embedding; a batch the micro-batches do not divide): a few AdamW steps equal one process
on the whole batch, and the full machinery's ScheduleGPipe (executor.py) to the bit; bad
arguments name themselves."""

import numpy as np
import pytest
from user_models import Block

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel import PipelineStage, ScheduleGPipe, SimpleGPipe, run_schedule, split_batch

WIDTH, CLASSES, VOCAB = 6, 3, 20


class Stage(nn.Module):
    """A slice of the model: the input layer on the first (features, or token ids into an
    Embedding), residual blocks, the head on the last."""

    def __init__(self, s: int, num_stages: int, rng, dtype=np.float64, tokens=False):
        self.input = None
        if s == 0:
            self.input = (
                nn.Embedding(VOCAB, WIDTH, rng=rng, dtype=dtype, std=1.0)
                if tokens
                else nn.Linear(4, WIDTH, rng=rng, dtype=dtype)
            )
        self.blocks = [Block(WIDTH, rng, dtype) for _ in range(2)]
        last = s == num_stages - 1
        self.head = nn.Linear(WIDTH, CLASSES, rng=rng, dtype=dtype) if last else None

    def forward(self, x):
        if isinstance(self.input, nn.Linear):
            x = self.input(Tensor(x))
        elif self.input is not None:
            x = self.input(x)  # token ids, as they are
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head else x


CASES = {  # name: (Stage's arguments, batch, micro-batches, rtol against one process)
    "float64": ({}, 8, 4, 1e-12),
    "uneven micro-batches": ({}, 7, 3, 1e-12),  # 7 = 3 + 2 + 2: unequal shares
    "float32 fed float64 data": ({"dtype": np.float32}, 8, 4, 2e-5),
    "token ids": ({"tokens": True}, 8, 2, 1e-12),
}


def stages(num_stages: int, args: dict) -> list[Stage]:
    rng = np.random.default_rng(7)  # every rank builds every stage alike, keeps its own
    return [Stage(s, num_stages, rng, **args) for s in range(num_stages)]


def batches(batch: int, tokens: bool, steps: int = 3):
    rng = np.random.default_rng(11)
    inputs = [rng.integers(0, VOCAB, batch) if tokens else rng.standard_normal((batch, 4))]
    return [(inputs[0], rng.integers(0, CLASSES, batch)) for _ in range(steps)]


def one_process(num_stages: int, args: dict, batch: int):
    parts = stages(num_stages, args)
    opt = optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-2)
    losses = []
    for x, y in batches(batch, args.get("tokens", False)):
        opt.zero_grad()
        for part in parts:
            x = part(x)
        loss = cross_entropy(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, parts


def plain(group, args: dict, batch: int, m: int):
    mine = stages(group.size, args)[group.rank]
    pipe, opt = SimpleGPipe(mine, group, m), optim.AdamW(mine.parameters(), lr=1e-2)
    losses = []
    for x, y in batches(batch, args.get("tokens", False)):
        opt.zero_grad()
        losses.append(pipe.step(x if group.rank == 0 else None, target=y))
        opt.step()
    return losses, mine


def full(group, args: dict, batch: int, m: int):
    mine = stages(group.size, args)[group.rank]
    stage = PipelineStage(mine, group.rank, group.size, group)
    schedule, opt = ScheduleGPipe(group.size, m), optim.AdamW(mine.parameters(), lr=1e-2)
    for x, y in batches(batch, args.get("tokens", False)):
        opt.zero_grad()
        micro_in, micro_t, shares = split_batch(x, y, m)
        run_schedule(schedule, {group.rank: stage}, micro_in, micro_t, shares)
        opt.step()
    return mine


@pytest.mark.parallel(nprocs=[1, 3])  # one rank, and first, middle and last stages
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES)
def test_plain_gpipe_equals_one_process_and_the_full_schedule(case):
    group = comm.world()
    args, batch, m, rtol = CASES[case]
    want, parts = one_process(group.size, args, batch)
    got, mine = plain(group, args, batch, m)
    np.testing.assert_allclose(got, want, rtol=rtol)
    for p, q in zip(mine.parameters(), parts[group.rank].parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=rtol, atol=rtol)
    for p, q in zip(mine.parameters(), full(group, args, batch, m).parameters()):
        np.testing.assert_array_equal(p.data, q.data)  # the same operations, the same bits


@pytest.mark.parallel(nprocs=[2])
def test_bad_arguments_name_themselves():
    group = comm.world()
    mine = stages(2, {})[group.rank]
    with pytest.raises(ValueError, match="n_microbatches must be a positive integer"):
        SimpleGPipe(mine, group, 0)
    pipe = SimpleGPipe(mine, group, 4)
    if group.rank == 1:
        with pytest.raises(ValueError, match="the last stage's step needs the batch's target"):
            pipe.step()
