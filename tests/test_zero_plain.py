"""The plain ZeRO-3 (parallel/zero/plain.py) on models the test builds: AdamW steps over N
ranks, each on its slice of the batch, equal one process on the whole batch and the full
version, FullyShardedDataParallel, case by case (float64 and float32, token ids into an
Embedding, two backward passes accumulated); on one rank with Dropout, the same bits as one
process (the rerun draws the first run's masks); outside its op no layer is whole; a
model it cannot shard is refused naming the full version."""

import contextlib

import numpy as np
import pytest
from user_models import Block

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel import FullyShardedDataParallel, SimpleZeRO3

WIDTH, CLASSES, BATCH, VOCAB = 6, 3, 12, 20


class Net(nn.Module):
    """An input layer (features, or token ids into an Embedding), two residual blocks, a
    head: four layers to shard; `dropout` between the blocks."""

    def __init__(self, dtype=np.float64, tokens=False, dropout=0.0):
        rng = np.random.default_rng(5)
        self.input = (
            nn.Embedding(VOCAB, WIDTH, rng=rng, dtype=dtype, std=1.0)
            if tokens
            else nn.Linear(4, WIDTH, rng=rng, dtype=dtype)
        )
        self.blocks = [Block(WIDTH, rng, dtype) for _ in range(2)]
        self.drop = nn.Dropout(dropout, rng=np.random.default_rng(1))
        self.head = nn.Linear(WIDTH, CLASSES, rng=rng, dtype=dtype)

    def forward(self, x) -> Tensor:
        x = self.input(x if isinstance(self.input, nn.Embedding) else Tensor(x))
        return self.head(self.drop(self.blocks[1](self.drop(self.blocks[0](x)))))


CASES = {  # name: (Net's arguments, backward passes a step, rtol)
    "float64": ({}, 1, 1e-12),
    "float32": ({"dtype": np.float32}, 1, 2e-5),
    "token ids": ({"tokens": True}, 1, 1e-12),
    "two backwards a step": ({}, 2, 1e-12),
}


def batches(tokens: bool, steps: int = 3):
    rng = np.random.default_rng(9)
    x = [rng.integers(0, VOCAB, BATCH) if tokens else rng.standard_normal((BATCH, 4))]
    return [(x[0] + 0 * s, rng.integers(0, CLASSES, BATCH)) for s in range(steps)]


def train(piece, mine: slice, passes: int, tokens: bool) -> dict:
    """AdamW steps of `piece` on this rank's slice; the whole model's state after."""
    opt = optim.AdamW(piece.parameters(), lr=1e-2)
    for x, y in batches(tokens):
        opt.zero_grad()
        for half in range(passes):  # `passes` micro-batches of the slice, each its share
            part = np.array_split(np.arange(BATCH)[mine], passes)[half]
            # FSDP reduces at each backward unless told to wait: the plain one always does
            wait = half < passes - 1 and hasattr(piece, "no_sync")
            with piece.no_sync() if wait else contextlib.nullcontext():
                loss = cross_entropy(piece(x[part]), y[part]) * (len(part) / len(x[mine]))
                loss.backward()
        if hasattr(piece, "finish_gradient_sync"):
            piece.finish_gradient_sync()
        opt.step()
    return piece.full_state_dict()


class Alone:
    """One process on the whole batch: the reference, with the pieces' methods."""

    def __init__(self, net):
        self.net, self.parameters = net, net.parameters

    def __call__(self, x):
        return self.net(x)

    def full_state_dict(self):
        return self.net.state_dict()


@pytest.mark.parallel(nprocs=[1, 3])  # a group of one and a non-power of two
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES)
def test_plain_zero3_equals_one_process_and_fsdp(case):
    group = comm.world()
    args, passes, rtol = CASES[case]
    tokens, per = args.get("tokens", False), BATCH // group.size
    mine = slice(group.rank * per, (group.rank + 1) * per)
    want = train(Alone(Net(**args)), slice(None), passes, tokens)
    zero3 = SimpleZeRO3(Net(**args), group)
    state = train(zero3, mine, passes, tokens)
    fsdp = FullyShardedDataParallel(Net(**args), group, "full")
    full = train(fsdp, mine, passes, tokens)
    fsdp.close()
    for name, value in want.items():
        np.testing.assert_allclose(state[name], value, rtol=rtol, atol=rtol, err_msg=name)
        np.testing.assert_allclose(state[name], full[name], rtol=rtol, atol=rtol, err_msg=name)
    # outside its op no layer is whole: after a forward and after a backward alike
    x, y = batches(tokens)[0]
    loss = cross_entropy(zero3(x[mine]), y[mine])
    released = [p for p in zero3.model.parameters() if p.requires_grad]
    assert all(p.data.strides == (0,) * p.ndim for p in released)
    loss.backward()
    assert all(p.data.strides == (0,) * p.ndim and np.isnan(p.data).all() for p in released)
    n = sum(p.size for p in released)
    assert sum(c.size for c in zero3.parameters()) in range(n // group.size, n // group.size + 5)


def test_with_dropout_the_rerun_draws_the_first_runs_masks():
    """One rank: the same masks, so the same bits as one process, step after step."""
    alone = comm.world().split(comm.world().rank)
    want = train(Alone(Net(dropout=0.3)), slice(None), 1, False)
    got = train(SimpleZeRO3(Net(dropout=0.3), alone), slice(None), 1, False)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_model_it_cannot_shard_is_refused_naming_the_full_version():
    class Tied(nn.Module):
        def __init__(self):
            self.a = nn.Linear(3, 3, rng=np.random.default_rng(0), dtype=np.float64)
            self.b = nn.Linear(3, 3, rng=np.random.default_rng(1), dtype=np.float64)
            self.b.weight = self.a.weight  # one parameter in two layers

    with pytest.raises(ValueError, match="FullyShardedDataParallel handles the others"):
        SimpleZeRO3(Tied(), comm.world().split(comm.world().rank))
