"""The plain ZeRO-3 (parallel/zero/plain.py) on a model the test builds: a few AdamW steps
over N ranks, each on its slice of the batch, equal one process on the whole batch
(float64, 1e-12) and the full version, FullyShardedDataParallel; between the ops no layer is
whole; a model it cannot shard is refused naming the full version."""

import numpy as np
import pytest
from user_models import Block

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel import FullyShardedDataParallel, SimpleZeRO3

F64, WIDTH, CLASSES, BATCH = np.float64, 6, 3, 12


class Net(nn.Module):
    """An input layer, two residual blocks, a head: four layers to shard."""

    def __init__(self):
        rng = np.random.default_rng(5)
        self.input = nn.Linear(4, WIDTH, rng=rng, dtype=F64)
        self.blocks = [Block(WIDTH, rng) for _ in range(2)]
        self.head = nn.Linear(WIDTH, CLASSES, rng=rng, dtype=F64)

    def forward(self, x) -> Tensor:
        x = self.input(Tensor(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(steps: int = 3):
    rng = np.random.default_rng(9)
    return [
        (rng.standard_normal((BATCH, 4)), rng.integers(0, CLASSES, BATCH)) for _ in range(steps)
    ]


def train(wrap, group, mine: slice):
    """AdamW steps of wrap(Net()) on this rank's slice; (losses, the whole model's state)."""
    piece = wrap(Net())
    opt = optim.AdamW(piece.parameters(), lr=1e-2)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = cross_entropy(piece(x[mine]), y[mine])
        loss.backward()
        if hasattr(piece, "finish_gradient_sync"):
            piece.finish_gradient_sync()
        opt.step()
        total = comm.allreduce(np.array([loss.item()]), op="avg", group=group)
        losses.append(total[0])
    return losses, piece.full_state_dict(), piece


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(120)
def test_plain_zero3_equals_one_process_and_fsdp():
    group = comm.world()
    per = BATCH // group.size
    mine = slice(group.rank * per, (group.rank + 1) * per)
    want, whole, _ = train(lambda net: Alone(net), group, slice(None))
    got, state, zero3 = train(lambda net: SimpleZeRO3(net, group), group, mine)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for name, value in whole.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-12, atol=1e-14, err_msg=name)
    _, full, _ = train(lambda net: FullyShardedDataParallel(net, group, "full"), group, mine)
    for name, value in full.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-12, atol=1e-14, err_msg=name)
    # between the ops no layer is whole: every parameter is a stand-in of one element
    zero3(batches()[0][0][mine])
    assert all(p.data.strides == (0,) * p.ndim for p in zero3.model.parameters())
    n = sum(p.size for p in zero3.model.parameters())
    assert sum(c.size for c in zero3.parameters()) in range(n // group.size, n // group.size + 5)


class Alone:
    """One process on the whole batch: the reference, with the pieces' methods."""

    def __init__(self, net):
        self.net = net

    def __call__(self, x):
        return self.net(x)

    def parameters(self):
        return self.net.parameters()

    def full_state_dict(self):
        return self.net.state_dict()


def test_a_model_it_cannot_shard_is_refused_naming_the_full_version():
    class Tied(nn.Module):
        def __init__(self):
            self.a = nn.Linear(3, 3, rng=np.random.default_rng(0), dtype=F64)
            self.b = nn.Linear(3, 3, rng=np.random.default_rng(1), dtype=F64)
            self.b.weight = self.a.weight  # one parameter in two layers

    with pytest.raises(ValueError, match="FullyShardedDataParallel handles the others"):
        SimpleZeRO3(Tied(), comm.world().split(comm.world().rank))
