"""Pruning as functions, under torch.nn.utils.prune's names (minidp/models/prune/functions.py): the
masks are torch's (and a NumPy reference's), repeated calls count among the unpruned, pruned
weights stay exactly zero through AdamW, remove makes it permanent, bad input is named.
The same functions under DDP with the kept-gradients hook: tests/test_prune_dp.py.
"""

import numpy as np
import pytest

from minidp import Tensor, nn, optim
from minidp.models.prune import functions as prune

SHAPES = [(6, 5), (4, 7), (3, 3)]


def layers_with(weights):
    """Bias-free Linear layers holding these weights (minidp's W is (in, out))."""
    rng = np.random.default_rng(0)
    layers = [nn.Linear(w.shape[0], w.shape[1], bias=False, rng=rng, dtype=np.float64)
              for w in weights]  # fmt: skip
    for layer, w in zip(layers, weights):
        layer.weight.data[...] = w
    return layers


def random_weights(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in SHAPES]


def reference_masks(weights, k):
    """NumPy's reference: the k smallest |w| over all the weights get mask 0."""
    flat = np.abs(np.concatenate([w.ravel() for w in weights]))
    keep = flat > np.sort(flat)[k - 1] if k else np.ones(flat.size, bool)
    return np.split(keep, np.cumsum([w.size for w in weights])[:-1])


# amounts: a fraction, a count, and a second call that counts among the unpruned ones
AMOUNTS = [(0.3,), (7,), (0.5, 0.5), (0.4, 3), (0.0,), (1.0,)]


@pytest.mark.parametrize("amounts", AMOUNTS, ids=str)
@pytest.mark.parametrize("scope", ["layer", "global"])
def test_the_masks_keep_the_largest_magnitudes(scope, amounts):
    weights = random_weights()
    layers = layers_with(weights)
    pruned = [0] * len(layers) if scope == "layer" else [0]
    for amount in amounts:
        if scope == "layer":
            for i, layer in enumerate(layers):
                prune.l1_unstructured(layer, "weight", amount)
                left = weights[i].size - pruned[i]
                pruned[i] += amount if isinstance(amount, int) else round(amount * left)
        else:
            prune.global_unstructured([(layer, "weight") for layer in layers], amount)
            left = sum(w.size for w in weights) - pruned[0]
            pruned[0] += amount if isinstance(amount, int) else round(amount * left)
    if scope == "layer":
        want = [reference_masks([w], k)[0] for w, k in zip(weights, pruned)]
    else:
        want = reference_masks(weights, pruned[0])
    for layer, w, keep in zip(layers, weights, want):
        np.testing.assert_array_equal(layer.weight_mask.ravel(), keep)
        np.testing.assert_array_equal(layer.weight.data, np.where(layer.weight_mask, w, 0))
    assert all(prune.is_pruned(layer) for layer in layers)


@pytest.mark.torch
@pytest.mark.parametrize("amounts", AMOUNTS, ids=str)
@pytest.mark.parametrize("scope", ["layer", "global"])
def test_the_masks_are_torch_prunes(scope, amounts):
    import torch
    from torch.nn.utils import prune as torch_prune

    weights = random_weights(1)
    ours = layers_with(weights)
    theirs = [torch.nn.Linear(w.shape[0], w.shape[1], bias=False).double() for w in weights]
    for layer, w in zip(theirs, weights):
        layer.weight.data = torch.from_numpy(w.T.copy())  # torch's W is (out, in)
    for amount in amounts:
        if scope == "layer":
            for a, b in zip(ours, theirs):
                prune.l1_unstructured(a, "weight", amount)
                torch_prune.l1_unstructured(b, "weight", amount=amount)
        else:
            prune.global_unstructured([(a, "weight") for a in ours], amount)
            pairs = [(b, "weight") for b in theirs]
            torch_prune.global_unstructured(pairs, torch_prune.L1Unstructured, amount=amount)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a.weight_mask, b.weight_mask.numpy().T.astype(bool))
        np.testing.assert_array_equal(a.weight.data, b.weight.detach().numpy().T)
        assert prune.is_pruned(a) == torch_prune.is_pruned(b) is True
        prune.remove(a, "weight")
        torch_prune.remove(b, "weight")
        np.testing.assert_array_equal(a.weight.data, b.weight.detach().numpy().T)
        assert prune.is_pruned(a) == torch_prune.is_pruned(b) is False


def test_pruned_weights_stay_zero_through_adamw_and_remove_lets_them_train():
    """Pruned after AdamW has stepped: the grad-ready hook zeroes the masked gradients, and
    optimizer= zeroes the moments, so the weights stay exactly 0 step after step."""
    rng = np.random.default_rng(0)
    model = nn.MLP([8, 16, 4], rng=rng, dtype=np.float64)
    opt = optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    x, y = Tensor(rng.standard_normal((32, 8))), rng.integers(0, 4, 32)

    def step():
        opt.zero_grad()
        nn.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()  # the moments fill up
    weights = [(layer, "weight") for layer in model.layers]
    prune.global_unstructured(weights, 0.6, optimizer=opt)
    prune.l1_unstructured(model.layers[1], "weight", 0.5, optimizer=opt)  # and more, here
    assert prune.is_pruned(model) and prune.is_pruned(model.layers[0])
    for _ in range(4):
        step()
        for layer in model.layers:
            assert (layer.weight.data[~layer.weight_mask] == 0).all()
            assert (layer.weight.grad[~layer.weight_mask] == 0).all()
    masks = [layer.weight_mask.copy() for layer in model.layers]
    for layer in model.layers:
        prune.remove(layer, "weight")
        assert not hasattr(layer, "weight_mask")
    assert not prune.is_pruned(model)
    step()
    assert all((layer.weight.data[~m] != 0).any() for layer, m in zip(model.layers, masks))


def test_bad_input_is_named():
    layer = layers_with(random_weights())[0]
    with pytest.raises(ValueError, match="amount must be in \\[0, 1\\]"):
        prune.l1_unstructured(layer, "weight", 1.5)
    with pytest.raises(ValueError, match="amount must be in \\[0, 1\\]"):
        prune.l1_unstructured(layer, "weight", float("nan"))
    with pytest.raises(ValueError, match="amount 31 must be in \\[0, 30\\]"):
        prune.l1_unstructured(layer, "weight", 31)
    with pytest.raises(TypeError, match="amount must be a float"):
        prune.l1_unstructured(layer, "weight", "half")
    with pytest.raises(TypeError, match="amount must be a float"):
        prune.l1_unstructured(layer, "weight", True)
    with pytest.raises(ValueError, match="name 'wieght': Linear has no parameter"):
        prune.l1_unstructured(layer, "wieght", 0.5)
    with pytest.raises(ValueError, match="name 'bias': Linear has no parameter"):
        prune.l1_unstructured(layer, "bias", 0.5)  # bias=False: None
    with pytest.raises(TypeError, match="module must be a minidp.nn.Module"):
        prune.l1_unstructured(np.ones(3), "weight", 0.5)
    with pytest.raises(ValueError, match="parameters must name at least one"):
        prune.global_unstructured([], 0.5)
    with pytest.raises(ValueError, match="parameter 'weight' of Linear is not pruned"):
        prune.remove(layer, "weight")
    assert not prune.is_pruned(layer)  # nothing was pruned on the way
