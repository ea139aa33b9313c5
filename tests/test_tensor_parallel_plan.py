"""parallelize_module on a user's model (PyTorch's plan: ColwiseParallel, RowwiseParallel):
a residual block with minidp's attention (its heads split: "blocks.0.attn.qkv") and an MLP
(fc1 by columns, fc2 by rows, an uneven hidden size of 11), over 4 ranks: three AdamW
steps equal one process (float64, 1e-12), gather_full gives the whole model back on every
rank, and each rank holds the slice the docs say."""

import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.models.gpt import CausalSelfAttention, GPTConfig
from minidp.parallel.tensor_parallel import (
    ColwiseParallel,
    RowwiseParallel,
    gather_full,
    parallelize_module,
)
from minidp.tools.chunks import chunk_range


class Block(nn.Module):
    def __init__(self, rng):
        cfg = GPTConfig(vocab_size=4, block_size=5, n_layer=1, n_head=4, n_embd=8)
        self.norm1, self.norm2 = (
            nn.LayerNorm(8, dtype=np.float64),
            nn.LayerNorm(8, dtype=np.float64),
        )
        self.attn = CausalSelfAttention(cfg, rng=rng, dtype=np.float64, fused=False)
        self.fc1 = nn.Linear(8, 11, rng=rng, dtype=np.float64)
        self.fc2 = nn.Linear(11, 8, rng=rng, dtype=np.float64)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.fc1(self.norm2(x)).relu())


class Net(nn.Module):
    def __init__(self):
        rng = np.random.default_rng(0)
        self.embed = nn.Linear(3, 8, rng=rng, dtype=np.float64)
        self.blocks = [Block(rng)]
        self.head = nn.Linear(8, 4, rng=rng, dtype=np.float64)

    def forward(self, x):
        return self.head(self.blocks[0](self.embed(Tensor(x))))


PLAN = {
    "blocks.0.attn.qkv": ColwiseParallel(),
    "blocks.0.attn.proj": RowwiseParallel(),
    "blocks.0.fc1": ColwiseParallel(),
    "blocks.0.fc2": RowwiseParallel(),
}


def batch(step: int):
    rng = np.random.default_rng(10 + step)
    return rng.standard_normal((6, 5, 3)), rng.integers(0, 4, (6, 5))


def train(model, steps: int):
    opt = optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parallel(nprocs=[4])
def test_a_planned_users_model_trains_as_one_process_and_gathers_back():
    group = comm.world()
    ref = Net()
    train(ref, 3)
    model = parallelize_module(Net(), group, PLAN)
    fc1 = model.blocks[0].fc1
    assert np.array_equal(
        fc1.weight.placement.index, np.arange(*chunk_range(11, group.size, group.rank))
    )
    assert model.blocks[0].attn.n_head == 4 // group.size  # the rank's own heads
    train(model, 3)
    whole = gather_full(model)
    want = ref.state_dict()
    assert whole.keys() == want.keys()
    for name, value in want.items():
        # (atol: attention's key bias has a zero gradient, met as rounding noise of 1e-14)
        np.testing.assert_allclose(whole[name], value, rtol=1e-12, atol=1e-12, err_msg=name)


def test_a_plan_names_what_it_cannot_split():
    group = comm.world()
    with pytest.raises(ValueError, match="no 'fc9'"):
        parallelize_module(Net(), group, {"blocks.0.fc9": ColwiseParallel()})
    with pytest.raises(TypeError, match="not an nn.Linear"):
        parallelize_module(Net(), group, {"blocks.0.norm1": ColwiseParallel()})


def test_a_plan_that_fails_changes_nothing():
    """Every entry is checked before any layer is replaced: a weight shared with another
    layer is refused, and the entries before it stay plain Linears."""
    group = comm.world()
    shared = Net()
    shared.blocks[0].fc2.weight = shared.blocks[0].attn.proj.weight  # tied, by the user
    plan = {"blocks.0.fc1": ColwiseParallel(), "blocks.0.fc2": RowwiseParallel()}
    with pytest.raises(ValueError, match="shared with"):
        parallelize_module(shared, group, plan)
    assert type(shared.blocks[0].fc1) is nn.Linear  # the first entry was not applied
