"""The engine's table of speed tricks (minidp/engine/registry.py): what it holds, that the
engine runs without it, and that each entry computes what the plain path computes.

Each entry's own op is checked against its composed graph, in float64 and against PyTorch,
in test_autograd.py (the fused ops) and test_deferred_grads.py (deferred weight gradients);
here the whole GPT and MLP are, with the table and without it."""

import ast
from pathlib import Path

import numpy as np
import pytest

from minidp import Tensor, cross_entropy, nn
from minidp.engine.registry import FAST, fast, plain
from minidp.fast import weight_grads

ROOT = Path(__file__).parent.parent
ENTRIES = {
    "row_sums",
    "weight_gradient",
    "layer_norm",
    "embedding",
    "gelu",
    "layer_norm_linear",
    "linear_residual",
    "attention",
}


def test_the_table_holds_the_documented_entries():
    import minidp.engine.registry as registry

    assert set(FAST) == ENTRIES
    for name in ENTRIES:  # each in the docstring's table, a row of its own
        assert f"\n    {name} " in registry.__doc__


def test_the_engine_never_imports_its_speed_tricks():
    """The engine's files name minidp.fast nowhere in an import: the tricks plug in."""
    for path in (ROOT / "minidp" / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "minidp":
                names = [f"minidp.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.startswith("minidp.fast") for n in names), (path.name, names)


def test_plain_empties_the_table_and_restores_it():
    whole = dict(FAST)
    with plain():
        assert FAST == {} and fast("gelu", Tensor(np.ones(2))) is None
    assert FAST == whole


def test_an_entry_is_taken_on_numpy_data_only():
    class OnDevice:  # stands in for a torch tensor's holder: not a NumPy array
        data = object()

    assert fast("gelu", Tensor(np.ones(2))) is FAST["gelu"]
    assert fast("gelu", OnDevice()) is None


def gpt_loss_and_grads(fused: bool):
    cfg = nn.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = nn.GPT(cfg, seed=3, dtype=np.float64, fused=fused)
    tokens = np.random.default_rng(0).integers(0, 11, (4, 9))
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.copy() for n, p in model.named_parameters()}


def test_the_gpt_without_the_table_is_the_plain_gpt_bit_for_bit():
    """Emptied, the table leaves a default GPT exactly the fused=False one: every helper of
    models/gpt.py falls back to the composed layers."""
    with plain():
        loss, grads = gpt_loss_and_grads(fused=True)
        plain_loss, plain_grads = gpt_loss_and_grads(fused=False)
    assert loss == plain_loss
    for name, g in grads.items():
        assert np.array_equal(g, plain_grads[name]), name


def test_the_gpt_with_the_table_equals_the_plain_gpt_to_rounding(monkeypatch):
    """The fused ops keep or regroup the composed graph's arithmetic (fused.py says which):
    equal to rounding in float64. And the default GPT takes every entry of the table."""
    taken = set()
    for name, fn in dict(FAST).items():

        def counted(*args, name=name, fn=fn):
            taken.add(name)
            return fn(*args)

        monkeypatch.setitem(FAST, name, counted)
    loss, grads = gpt_loss_and_grads(fused=True)
    assert taken == ENTRIES
    with plain():
        plain_loss, plain_grads = gpt_loss_and_grads(fused=False)
    assert loss == pytest.approx(plain_loss, rel=1e-12)
    for name, g in grads.items():
        np.testing.assert_allclose(g, plain_grads[name], rtol=1e-9, atol=1e-12, err_msg=name)


def test_an_mlp_step_is_bit_equal_with_and_without_the_deferred_weight_gradient():
    """One micro-batch: the deferred weight gradient is x^T g itself (weight_grads.py), so
    with the table holding that entry alone the step's bits are the plain path's."""

    def step():
        model = nn.MLP([6, 8, 3], rng=np.random.default_rng(1), dtype=np.float64)
        x = np.random.default_rng(2).standard_normal((5, 6))
        loss = cross_entropy(model(Tensor(x)), np.array([0, 1, 2, 1, 0]))
        loss.backward()
        return loss.item(), [p.grad.copy() for p in model.parameters()]

    with plain():
        loss, grads = step()
        FAST["weight_gradient"] = weight_grads.weight_gradient  # plain() restores the table
        fast_loss, fast_grads = step()
        assert set(FAST) == {"weight_gradient"}
    assert loss == fast_loss
    assert all(np.array_equal(a, b) for a, b in zip(grads, fast_grads))


def test_a_users_module_in_a_linears_place_runs_as_it_is():
    """models/gpt.py asks the table for a fused op only after it knows the module is the
    library's own Linear: a module without `.weight` in fc_proj's place is just called."""

    class Scaled(nn.Module):  # a user's own layer: no .weight attribute
        def __init__(self, inner):
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 0.5

    cfg = nn.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = nn.GPT(cfg, seed=3, dtype=np.float64)
    block = model.blocks[0]
    block.fc_proj = Scaled(block.fc_proj)
    block.attn.proj = Scaled(block.attn.proj)
    tokens = np.random.default_rng(0).integers(0, 11, (2, 8))
    assert np.isfinite(model(tokens).data).all()
