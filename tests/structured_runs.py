"""Shared by tests/test_prune_structured.py and tests/test_low_rank.py: a tiny GPT run's
flags, a replica's digest, and the one-process runs a data-parallel shrink must equal."""

import zlib

import numpy as np

from minidp import Tensor, nn, optim
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task

STEPS, AT, LR = 5, 2, 1e-2
CONFIG = dict(
    model="gpt", n_layer=1, n_embd=16, n_head=4, block_size=8, seed=3, batch_size=8,
    dtype="float64", bucket_mb=0.002, allreduce="ring", weight_decay=0.1, steps=STEPS,
    prune_structured=0.5, prune_structured_at=AT,
)  # fmt: skip


def digest(arrays) -> int:
    return zlib.crc32(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))


def assert_trains(model, opt, x, y, steps: int) -> None:
    """`steps` steps of `opt` on (x, y) lower the loss by a quarter or more."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0]


def assert_one_process(config, shrink, losses, params) -> None:
    """Training in one process on the global batch, `shrink(model, optimizer)` at step AT,
    gives these losses and parameters."""
    task = Task(config, np.float64)
    opt = optim.AdamW(task.model.parameters(), lr=LR, weight_decay=config.weight_decay)
    whole = DistributedSampler(task.num_examples, config.batch_size, seed=config.seed)
    want = []
    for step in range(STEPS):
        if step == AT:
            shrink(task.model, opt)
        opt.zero_grad()
        loss = task.loss(*task.batch(whole.local_indices(step)))
        loss.backward()
        optim.clip_grad_norm(task.model.parameters(), config.grad_clip)
        opt.step()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=1e-10)
    for p, q in zip(params, task.model.parameters(), strict=True):
        np.testing.assert_allclose(p, q.data, rtol=1e-9, atol=1e-12)
