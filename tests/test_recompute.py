"""Recomputation (engine/recompute.py's `checkpoint`, `--recompute`): the same bits as
keeping every activation, on a user's module, a plain function and the GPT with dropout, in
every strategy; and the activation peak of the GPT at 4 layers at least 2x lower."""

from dataclasses import replace

import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.engine.recompute import checkpoint


class Scaled(nn.Module):
    """A user's module with a second, non-Tensor argument."""

    def __init__(self, rng):
        self.fc1 = nn.Linear(5, 8, rng=rng, dtype=np.float64)
        self.fc2 = nn.Linear(8, 5, rng=rng, dtype=np.float64)

    def forward(self, x, scale: float):
        return self.fc2(self.fc1(x).relu()) * scale + x


def grads_of(make_loss, params) -> tuple[float, list]:
    for p in params:
        p.grad = None
    loss = make_loss()
    loss.backward()
    return loss.item(), [p.grad.copy() for p in params]


def test_checkpoint_of_a_users_module_gives_the_same_bits():
    block = Scaled(np.random.default_rng(0))
    x = np.random.default_rng(1).normal(size=(4, 5))
    params = block.parameters()
    plain = grads_of(lambda: (block(block(Tensor(x), 0.5), 2.0) ** 2).sum(), params)
    again = grads_of(
        lambda: (checkpoint(block, checkpoint(block, Tensor(x), 0.5), 2.0) ** 2).sum(), params
    )
    assert plain[0] == again[0]
    for g, h in zip(plain[1], again[1], strict=True):
        np.testing.assert_array_equal(g, h)


def test_checkpoint_of_a_plain_function_passes_the_input_gradient():
    w = nn.Parameter(np.arange(6.0).reshape(2, 3))

    def fn(x):
        return (x @ w).tanh()

    x = Tensor(np.ones((4, 2)), requires_grad=True)
    (fn(x) ** 2).sum().backward()
    want_x, want_w = x.grad.copy(), w.grad.copy()
    x.grad = w.grad = None
    (checkpoint(fn, x) ** 2).sum().backward()
    np.testing.assert_array_equal(x.grad, want_x)
    np.testing.assert_array_equal(w.grad, want_w)


def loss_of(model, idx):
    logits = model(idx)
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))


def test_the_gpt_with_dropout_recomputes_the_same_masks():
    """Each block's dropout draws again in backward from where its generator stood in the
    forward (PyTorch's preserve_rng_state): two steps, the same losses and gradients."""
    config = nn.GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8, dropout=0.2)
    idx = np.random.default_rng(2).integers(0, 11, size=(3, 6))
    runs = []
    for recompute in (False, True):
        model = nn.GPT(config, seed=4, dtype=np.float64)
        model.recompute = recompute
        runs.append(
            [grads_of(lambda m=model: loss_of(m, idx), model.parameters()) for _ in range(2)]
        )
    for (loss, grads), (loss_again, grads_again) in zip(*runs, strict=True):
        assert loss == loss_again
        for g, h in zip(grads, grads_again, strict=True):
            np.testing.assert_array_equal(g, h)


def test_recompute_holds_at_least_half_less_of_the_4_layer_gpt_s_activations():
    config = TrainConfig(n_layer=4, steps=2, eval_batches=1, sample_tokens=0, threads=1)
    plain, again = (train(replace(config, recompute=r)) for r in (False, True))
    held, held_again = (f["memory_bytes"]["activations_peak"] for f in (plain, again))
    assert held_again * 2 <= held, (held, held_again)
    assert plain["final_loss"] == again["final_loss"] and plain["param_l2"] == again["param_l2"]


def test_recompute_is_a_flag_of_the_gpt():
    from minidp.cli.commands import parse_train_args

    with pytest.raises(SystemExit):
        parse_train_args(["--model", "mlp", "--recompute"])


# ---- every strategy, 2 ranks ----------------------------------------------------------------
TINY = dict(
    n_layer=2, n_embd=16, n_head=2, block_size=8, batch_size=6, steps=2, dtype="float64",
    eval_batches=1, sample_tokens=0, log_every=1, seed=5,
)  # fmt: skip
SCHEMES = [  # dropout on: each recomputed block draws the masks of its first forward again
    dict(strategy="dp", dropout=0.1),
    dict(strategy="zero", zero_stage=3, dropout=0.1),
    dict(strategy="tp", sequence_parallel=True, dropout=0.1),
    dict(strategy="pp", micro_batches=2, dropout=0.1),
    dict(strategy="ps", servers=1),
]


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(180)
def test_every_strategy_recomputes_to_the_same_bits():
    group = comm.world()
    for scheme in SCHEMES:
        config = TrainConfig(**TINY, **scheme)
        plain, again = (train(replace(config, recompute=r), group) for r in (False, True))
        for key in ("final_loss", "val_loss", "param_l2"):
            assert plain[key] == again[key], (scheme, key, plain[key], again[key])
        if scheme["strategy"] != "ps":  # the servers hold no activations
            held = plain["memory_bytes"]["activations_peak"]
            assert again["memory_bytes"]["activations_peak"] < held, scheme
