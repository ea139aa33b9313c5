"""Each compressor as a user builds it, by name with keyword arguments, registered as the
communication hook of a DDP around a model the test builds: replicas stay identical, and the
bits are those of the same compressor built from `--compress NAME:PARAM` (make_compressor);
its state_dict resumes bit for bit; a bad argument is a ValueError that names it."""

import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel import (
    BF16,
    FP16,
    QSGD,
    DistributedDataParallel,
    PowerSGD,
    RandomK,
    Sign,
    SignNoEF,
    TopK,
)
from minidp.parallel.across_ranks import replica_spread
from minidp.parallel.compression.table import make_compressor

BY_HAND = {  # what a user writes -> the --compress value that builds the same compressor
    "fp16": FP16,
    "bf16": BF16,
    "topk:0.1": lambda: TopK(density=0.1),
    "randomk:0.1": lambda: RandomK(density=0.1),
    "sign": Sign,
    "sign-noef": SignNoEF,
    "qsgd:3": lambda: QSGD(levels=3),
    "powersgd:2": lambda: PowerSGD(rank=2),
}
SIZES, BATCH = [6, 16, 12, 3], 8  # per rank


def batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's examples of global step `step`: the same whoever asks, whenever."""
    rng = np.random.default_rng([step, rank])
    return rng.standard_normal((BATCH, SIZES[0])).astype(np.float32), rng.integers(0, 3, BATCH)


def train(hook, group: comm.Group, steps: range, weights=None) -> tuple[list, list, nn.MLP]:
    """The user's loop around an MLP (float32, from seed 0 or from `weights`), DDP with
    `hook` registered: (this rank's losses, the parameters, the model)."""
    model = nn.MLP(SIZES, rng=np.random.default_rng(0), dtype=np.float32)
    if weights is not None:
        for p, w in zip(model.parameters(), weights):
            p.data[...] = w
    opt = optim.SGD(model.parameters(), lr=0.1)  # no momentum: the hook holds all the state
    losses = []
    with DistributedDataParallel(model, group, bucket_cap_mb=0.001) as ddp:  # three buckets
        ddp.register_comm_hook(hook)
        for step in steps:
            x, y = batch(step, group.rank)
            loss = cross_entropy(model(Tensor(x)), y)
            opt.zero_grad()
            loss.backward()
            ddp.finish_gradient_sync()
            opt.step()
            losses.append(loss.item())
    return losses, [p.data.copy() for p in model.parameters()], model


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_every_compressor_by_name_is_the_command_lines_bit_for_bit():
    group = comm.world()
    for spec, build in BY_HAND.items():
        hook, flag = build(), make_compressor(spec)
        assert type(hook) is type(flag) and hook.spec == flag.spec == spec
        losses, weights, model = train(hook, group, range(3))
        assert np.isfinite(losses).all(), spec
        assert replica_spread(weights, group) == 0.0, f"{spec}: the replicas differ"
        assert hook.relative_error() is not None, f"{spec}: the hook saw no gradient"
        flag_losses, flag_weights, _ = train(flag, group, range(3))
        assert flag_losses == losses, spec
        for mine, theirs in zip(weights, flag_weights):
            np.testing.assert_array_equal(mine, theirs, err_msg=spec)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_the_hooks_state_dict_resumes_bit_for_bit():
    group = comm.world()
    for build in (lambda: PowerSGD(rank=2, seed=4), lambda: TopK(density=0.1)):
        want_losses, want, _ = train(build(), group, range(4))
        first = build()
        losses, weights, _ = train(first, group, range(2))
        state = first.state_dict()
        assert state["residuals"], "the residuals are in the state"
        second = build()
        second.load_state_dict(state)
        more, got, _ = train(second, group, range(2, 4), weights)
        assert losses + more == want_losses
        for mine, theirs in zip(got, want):
            np.testing.assert_array_equal(mine, theirs)
        _, fresh, _ = train(build(), group, range(2, 4), weights)  # without the state
        assert any((a != b).any() for a, b in zip(fresh, want)), "the state must matter"


# ---- serial: the arguments ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "build, says",
    [
        (lambda: PowerSGD(rank=0), "PowerSGD(rank=0): the rank must be an integer >= 1"),
        (lambda: PowerSGD(rank=1.5), "PowerSGD(rank=1.5)"),
        (lambda: TopK(density=0), "TopK(density=0): the density must be in (0, 1]"),
        (lambda: RandomK(density=float("nan")), "RandomK(density=nan)"),
        (lambda: QSGD(levels=128), "QSGD(levels=128): the number of levels S must be"),
        (lambda: FP16(warmup=-1), "FP16(warmup=-1): the warmup must be an integer >= 0"),
        (lambda: Sign(seed=0.5), "Sign(seed=0.5): the seed must be an integer"),
        (lambda: BF16(algo="fast"), "BF16(algo='fast'): the allreduce algorithm must be one of"),
    ],
)
def test_a_bad_argument_is_named(build, says):
    with pytest.raises(ValueError) as error:
        build()
    assert says in str(error.value) and "--" not in str(error.value)  # no flag: a library


def test_arguments_are_keywords_and_the_flag_is_their_one_translation():
    with pytest.raises(TypeError):
        PowerSGD(2)  # rank=2: what the number means is named
    flag = make_compressor("powersgd:4", algo="ring", seed=3, warmup=2)
    hand = PowerSGD(rank=4, algo="ring", seed=3, warmup=2)
    assert vars(flag).keys() == vars(hand).keys()
    assert all(getattr(flag, k) == getattr(hand, k) for k in ("rank", "allreduce_algo", "seed"))
    assert (flag.warmup, TopK().density, QSGD().levels, PowerSGD().rank) == (2, 0.01, 4, 2)
    with pytest.raises(ValueError, match=r"^'topk:2': TopK\(density=2\)"):
        make_compressor("topk:2")
