"""Layers: Module bookkeeping, then each layer and the whole GPT against PyTorch in float64.

The PyTorch side is written out here as plain torch.nn modules with the same attribute names,
so `named_parameters()` lines up name for name. minidp's Linear stores W as (in, out) and
computes x W + b; torch's stores (out, in), so its weight is our W.T (and so is its gradient).
"""

import numpy as np
import pytest
from gradcheck import check_gradients

from minidp import Tensor, cross_entropy, no_grad, optim
from minidp.nn import (
    GPT,
    MLP,
    Dropout,
    Embedding,
    GPTConfig,
    LayerNorm,
    Linear,
    Module,
    Parameter,
    linear,
)

try:
    import torch
    import torch.nn.functional as F
    from torch import nn as tnn
except Exception:
    torch = None


CONFIG = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0)
TIGHT = {"rtol": 1e-10, "atol": 1e-13}


def randomized(model: Module, seed: int = 0, scale: float = 0.5) -> Module:
    """Every parameter redrawn at a larger scale (LayerNorm's too), so nothing is near-linear."""
    rng = np.random.default_rng(seed)
    model.load_state_dict(
        {n: rng.standard_normal(p.shape) * scale for n, p in model.named_parameters()}
    )
    return model


def tiny_gpt(seed=0, config=CONFIG, dtype=np.float64) -> GPT:
    return randomized(GPT(config, seed=seed, dtype=dtype), seed)


def tokens(shape, seed=0, vocab=CONFIG.vocab_size):
    return np.random.default_rng(seed).integers(0, vocab, shape)


# ---- Module bookkeeping ---------------------------------------------------------------------
def test_named_parameters_follow_assignment_order_with_dotted_names():
    model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4), seed=0)
    block = [
        "ln1.weight",
        "ln1.bias",
        "attn.qkv.weight",
        "attn.qkv.bias",
        "attn.proj.weight",
        "attn.proj.bias",
        "ln2.weight",
        "ln2.bias",
        "fc.weight",
        "fc.bias",
        "fc_proj.weight",
        "fc_proj.bias",
    ]
    expected = [
        "wte.weight",
        "wpe.weight",
        *("blocks.0." + n for n in block),
        "ln_f.weight",
        "ln_f.bias",
        "head.weight",
    ]
    assert [name for name, _ in model.named_parameters()] == expected
    assert model.parameters() == [p for _, p in model.named_parameters()]


def test_mlp_names_and_a_linear_without_bias():
    mlp = MLP([3, 4, 2], rng=np.random.default_rng(0))
    assert [n for n, _ in mlp.named_parameters()] == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ]
    assert mlp.num_parameters() == 3 * 4 + 4 + 4 * 2 + 2
    assert [
        n for n, _ in Linear(3, 2, bias=False, rng=np.random.default_rng(0)).named_parameters()
    ] == ["weight"]


def test_same_seed_same_model_other_seed_other_model():
    a, b, c = (GPT(CONFIG, seed=s).state_dict() for s in (3, 3, 4))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["blocks.0.fc.weight"], c["blocks.0.fc.weight"])
    m1, m2 = (MLP([4, 8, 3], rng=np.random.default_rng(5)).state_dict() for _ in range(2))
    assert all(np.array_equal(m1[k], m2[k]) for k in m1)


def test_default_dtype_is_float32_and_float64_on_request():
    assert {p.dtype for p in GPT(CONFIG).parameters()} == {np.dtype(np.float32)}
    assert {p.dtype for p in GPT(CONFIG, dtype=np.float64).parameters()} == {np.dtype(np.float64)}


def test_state_dict_roundtrip_reproduces_the_model_in_place():
    a, b = tiny_gpt(seed=0), tiny_gpt(seed=1)
    idx = tokens((2, 5))
    assert not np.array_equal(a(idx).data, b(idx).data)
    arrays = [p.data for p in b.parameters()]
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a(idx).data, b(idx).data)
    assert all(p.data is arr for p, arr in zip(b.parameters(), arrays))  # copied into, not rebound


def test_state_dict_holds_the_parameters_own_arrays_as_torchs_shares_storage():
    """A broadcast into it (Horovod's broadcast_parameters) sets the model; a snapshot copies."""
    model = tiny_gpt()
    state = model.state_dict()
    assert state["head.weight"] is model.head.weight.data
    state["head.weight"][...] = 0
    assert not np.any(model.head.weight.data)


def test_load_state_dict_names_missing_and_unexpected_keys():
    model = tiny_gpt()
    state = model.state_dict()
    del state["ln_f.bias"]
    with pytest.raises(KeyError, match="missing.*ln_f.bias"):
        model.load_state_dict(state)
    state = {**model.state_dict(), "extra.weight": np.zeros(3)}
    with pytest.raises(KeyError, match="unexpected.*extra.weight"):
        model.load_state_dict(state)


def test_load_state_dict_names_a_wrong_shape():
    model = tiny_gpt()
    state = model.state_dict()
    state["head.weight"] = np.zeros((3, 3))
    with pytest.raises(ValueError, match=r"head.weight.*\(3, 3\).*\(8, 13\)"):
        model.load_state_dict(state)


def test_train_and_eval_reach_every_submodule():
    model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=2, n_head=1, n_embd=4, dropout=0.5))
    dropouts = [
        model.drop,
        *(m for b in model.blocks for m in (b.drop, b.attn.attn_drop, b.attn.resid_drop)),
    ]
    assert model.eval() is model
    assert not model.training and not any(d.training for d in dropouts)
    assert not any(b.training or b.attn.training or b.ln1.training for b in model.blocks)
    model.train()
    assert model.training and all(d.training for d in dropouts)


def test_dropout_module_is_active_in_train_and_off_in_eval():
    model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4, dropout=0.5))
    idx = tokens((2, 4), vocab=5)
    assert not np.array_equal(model(idx).data, model(idx).data)
    model.eval()
    np.testing.assert_array_equal(model(idx).data, model(idx).data)
    drop = Dropout(0.5, rng=np.random.default_rng(0)).eval()
    x = Tensor(np.ones(4))
    assert drop(x) is x


def test_zero_grad_clears_every_gradient():
    model = tiny_gpt()
    cross_entropy(model(tokens((2, 4))), tokens((2, 4), seed=1)).backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


class Tied(Module):
    """x -> fc1 -> relu -> fc2, with fc2 using fc1's weight (tied, as GPT-2 ties its token
    embedding and its head); `tied=False` gives fc2 a copy of it instead."""

    def __init__(self, tied: bool = True):
        rng = np.random.default_rng(0)
        self.fc1 = Linear(4, 4, rng=rng, dtype=np.float64)
        self.fc2 = Linear(4, 4, rng=rng, dtype=np.float64)
        self.fc2.weight = self.fc1.weight if tied else Parameter(self.fc1.weight.data.copy())

    def forward(self, x):
        return self.fc2(self.fc1(Tensor(x), relu=True))


def test_a_shared_parameter_is_listed_counted_and_stepped_once():
    model, untied = Tied(), Tied(tied=False)
    assert [n for n, _ in model.named_parameters()] == ["fc1.weight", "fc1.bias", "fc2.bias"]
    assert len(model.parameters()) == 3 and model.num_parameters() == 16 + 4 + 4
    everything = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert everything == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]

    # its gradient sums its two uses, and an optimizer steps it once: as the untied model's
    # two gradients, added, stepped once (what torch does with a tied weight)
    x, y = np.random.default_rng(1).standard_normal((5, 4)), np.arange(5) % 4
    for make in (
        lambda ps: optim.AdamW(ps, lr=0.1, weight_decay=0.1),
        lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    ):
        model, untied = Tied(), Tied(tied=False)
        cross_entropy(model(x), y).backward()
        cross_entropy(untied(x), y).backward()
        both = untied.fc1.weight.grad + untied.fc2.weight.grad
        np.testing.assert_allclose(model.fc1.weight.grad, both, **TIGHT)
        shared = Parameter(untied.fc1.weight.data.copy())
        shared.grad = model.fc1.weight.grad  # the reference: one parameter, one step
        for opt in (make(model.parameters()), make([shared])):
            opt.step()
        np.testing.assert_array_equal(model.fc1.weight.data, shared.data)
        assert model.fc2.weight is model.fc1.weight


def test_a_shared_parameter_is_saved_under_each_name_as_torch_does():
    model = Tied()
    state = model.state_dict()
    assert list(state) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    other = Tied()
    other.load_state_dict({k: v + 1 for k, v in state.items()})
    np.testing.assert_array_equal(other.fc2.weight.data, state["fc1.weight"] + 1)
    assert other.fc2.weight is other.fc1.weight  # still one parameter
    del state["fc2.weight"]
    with pytest.raises(KeyError, match=r"missing \['fc2.weight'\]"):
        other.load_state_dict(state)


def test_a_frozen_parameter_gets_no_gradient_and_no_optimizer_moves_it():
    layer = Linear(4, 3, rng=np.random.default_rng(0), dtype=np.float64)
    layer.bias.requires_grad = False
    before = layer.bias.data.copy()
    assert layer.parameters() == [layer.weight, layer.bias] and layer.num_parameters() == 15
    opts = [optim.AdamW(layer.parameters(), weight_decay=0.1), optim.SGD(layer.parameters(), 0.1)]
    for opt in opts:
        cross_entropy(layer(Tensor(np.ones((2, 4)))), np.array([0, 1])).backward()
        assert layer.weight.grad is not None and layer.bias.grad is None
        opt.step()
        opt.zero_grad()
    np.testing.assert_array_equal(layer.bias.data, before)


# ---- layers, by finite differences -------------------------------------------------------------
def test_layer_norm_gradients_by_central_differences():
    ln = LayerNorm(5, dtype=np.float64)
    rng = np.random.default_rng(0)

    def layer_norm(x, weight, bias):
        ln.weight, ln.bias = weight, bias
        return ln(x)

    check_gradients(
        layer_norm, [rng.standard_normal((2, 3, 5)), rng.standard_normal(5), rng.standard_normal(5)]
    )


@pytest.mark.parametrize("relu", [False, True])
def test_linear_gradients_by_central_differences(relu):
    layer = Linear(4, 3, rng=np.random.default_rng(0), dtype=np.float64)

    def linear(x, weight, bias):
        layer.weight, layer.bias = weight, bias
        return layer(x, relu=relu)

    rng = np.random.default_rng(1)
    check_gradients(
        linear,
        [rng.standard_normal((2, 5, 4)), rng.standard_normal((4, 3)), rng.standard_normal(3)],
    )


def composed_linear(x, weight, bias, relu=False):
    """What Linear computed before it was one op: reshape, matmul, add, reshape back (and
    what an MLP's hidden layer computed before: then a ReLU)."""
    x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
    y = x2 @ weight
    y = y if bias is None else y + bias
    y = y if x.ndim == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
    return y.relu() if relu else y


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(16, 37), (3, 5, 37), (37,), (1, 37)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("relu", [False, True])
def test_fused_linear_has_the_bits_of_matmul_then_add(dtype, shape, bias, relu):
    """Forward and every gradient equal, bit for bit, to the composed ops (losses too)."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape), rng.standard_normal((37, 23)), rng.standard_normal(23)]
    rows = arrays[0].reshape(-1, 37)
    if len(rows) > 2:  # ReLU's edges: one inf in a row makes outputs of +inf and -inf (their
        rows[-1, 0], rows[-2, 0] = np.inf, np.nan  # signs: W's), one nan a row of nan
    results = []
    for f in (linear, composed_linear):
        x, w, b = (Tensor(a.astype(dtype), requires_grad=True) for a in arrays)
        with np.errstate(invalid="ignore"):  # inf - inf in the products: nan, as wanted
            y = f(x, w, b if bias else None, relu=relu)
            weights = np.cos(np.arange(y.size)).reshape(y.shape).astype(dtype)
            (y * Tensor(weights)).sum().backward()
        results.append([y.data, x.grad, w.grad] + ([b.grad] if bias else []))
    for ours, theirs in zip(*results):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert ours.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_mlp_with_relu_fused_has_the_bits_of_the_plain_mlp(dtype):
    """MLP(fuse_relu=True), the speed trick, against MLP(fuse_relu=False), a Linear then
    .relu(): the same output, loss and gradients, bit for bit, over two SGD steps."""
    rng = np.random.default_rng(4)
    x = Tensor(rng.standard_normal((7, 6)).astype(dtype))
    y = rng.integers(0, 3, 7)
    runs = []
    for fuse in (True, False):
        model = MLP([6, 5, 4, 3], rng=np.random.default_rng(0), dtype=dtype, fuse_relu=fuse)
        opt, seen = optim.SGD(model.parameters(), lr=0.1), []
        for _ in range(2):
            model.zero_grad()
            loss = cross_entropy(model(x), y)
            loss.backward()
            seen += [loss.data.tobytes(), *(p.grad.tobytes() for p in model.parameters())]
            opt.step()
        runs.append(seen + [p.data.tobytes() for p in model.parameters()])
    assert runs[0] == runs[1]


def test_an_mlp_records_one_node_per_layer_and_keeps_one_array_per_layer():
    """Linear and ReLU fused (nn.linear(relu=True)): 3 layers, 3 nodes before the loss."""
    from minidp.tools.memory import activation_bytes

    model = MLP([6, 5, 4, 3], rng=np.random.default_rng(0), dtype=np.float64)
    out = model(Tensor(np.ones((2, 6))))
    nodes = [t for t in out._topological_order() if t._parents]
    assert len(nodes) == 3
    assert activation_bytes(out) == 2 * (5 + 4 + 3) * 8  # each layer's output only


def test_gpt_gradients_by_central_differences_on_sampled_entries():
    model = tiny_gpt()
    idx, targets = tokens((2, 6)), tokens((2, 6), seed=1)
    cross_entropy(model(idx), targets).backward()
    rng = np.random.default_rng(2)
    eps = 1e-6
    for name, p in model.named_parameters():
        for _ in range(2):
            i = tuple(rng.integers(0, n) for n in p.shape)
            if name == "wte.weight":
                i = (int(idx[0, 0]),) + i[1:]  # a row that is used
            old = p.data[i]
            with no_grad():
                p.data[i] = old + eps
                up = cross_entropy(model(idx), targets).item()
                p.data[i] = old - eps
                down = cross_entropy(model(idx), targets).item()
            p.data[i] = old
            np.testing.assert_allclose(
                p.grad[i], (up - down) / (2 * eps), rtol=1e-6, atol=1e-9, err_msg=f"{name}{list(i)}"
            )


def test_gpt_is_causal():
    model = tiny_gpt()
    idx = tokens((2, 7))
    changed = idx.copy()
    changed[:, 4] = (changed[:, 4] + 1) % CONFIG.vocab_size
    before, after = model(idx).data, model(changed).data
    np.testing.assert_array_equal(before[:, :4], after[:, :4])
    assert not np.allclose(before[:, 4:], after[:, 4:])


def test_gpt_rejects_a_sequence_longer_than_block_size():
    with pytest.raises(ValueError, match="block_size 8"):
        tiny_gpt()(tokens((1, 9)))


def test_generate_extends_each_row_and_keeps_the_mode():
    model = GPT(CONFIG, seed=0)  # float32: sampling must still see probabilities summing to 1
    prompt = tokens((2, 3))
    out = model.generate(prompt, 20, np.random.default_rng(0))
    assert out.shape == (2, 23)
    np.testing.assert_array_equal(out[:, :3], prompt)
    assert out.min() >= 0 and out.max() < CONFIG.vocab_size
    np.testing.assert_array_equal(out, model.generate(prompt, 20, np.random.default_rng(0)))
    assert model.training


# ---- the same networks in PyTorch ---------------------------------------------------------------
if torch is not None:

    class TorchBlock(tnn.Module):
        def __init__(self, cfg):
            super().__init__()
            C = cfg.n_embd
            self.n_head = cfg.n_head
            self.ln1 = tnn.LayerNorm(C, dtype=torch.float64)
            self.attn = tnn.Module()
            self.attn.qkv = tnn.Linear(C, 3 * C, dtype=torch.float64)
            self.attn.proj = tnn.Linear(C, C, dtype=torch.float64)
            self.ln2 = tnn.LayerNorm(C, dtype=torch.float64)
            self.fc = tnn.Linear(C, 4 * C, dtype=torch.float64)
            self.fc_proj = tnn.Linear(4 * C, C, dtype=torch.float64)

        def forward(self, x):
            B, T, C = x.shape
            H = self.n_head
            q, k, v = self.attn.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class TorchGPT(tnn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.wte = tnn.Embedding(cfg.vocab_size, cfg.n_embd, dtype=torch.float64)
            self.wpe = tnn.Embedding(cfg.block_size, cfg.n_embd, dtype=torch.float64)
            self.blocks = tnn.ModuleList(TorchBlock(cfg) for _ in range(cfg.n_layer))
            self.ln_f = tnn.LayerNorm(cfg.n_embd, dtype=torch.float64)
            self.head = tnn.Linear(cfg.n_embd, cfg.vocab_size, bias=False, dtype=torch.float64)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    class TorchMLP(tnn.Module):
        def __init__(self, sizes):
            super().__init__()
            self.layers = tnn.ModuleList(
                tnn.Linear(a, b, dtype=torch.float64) for a, b in zip(sizes[:-1], sizes[1:])
            )

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                x = torch.relu(x) if i < len(self.layers) - 1 else x
            return x


def linear_weight_names(module: Module, prefix: str = "") -> set[str]:
    """Names of every Linear's W: stored (in, out) here, (out, in) in torch."""
    names = set()
    for name, child in module.children():
        if isinstance(child, Linear):
            names.add(f"{prefix}{name}.weight")
        names |= linear_weight_names(child, f"{prefix}{name}.")
    return names


def copy_into_torch(ours: Module, theirs) -> dict:
    """Copy every parameter into the torch twin; return its parameters by our names."""
    transposed = linear_weight_names(ours)
    params = dict(theirs.named_parameters())
    assert sorted(params) == sorted(n for n, _ in ours.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            params[name].copy_(torch.from_numpy(p.data.T if name in transposed else p.data))
    return params


def assert_same_gradients(ours: Module, torch_params: dict) -> None:
    transposed = linear_weight_names(ours)
    for name, p in ours.named_parameters():
        expected = torch_params[name].grad.numpy()
        np.testing.assert_allclose(
            p.grad, expected.T if name in transposed else expected, **TIGHT, err_msg=name
        )


@pytest.mark.torch
@pytest.mark.parametrize("T", [1, 5, 8])
def test_gpt_logits_and_every_gradient_match_torch(T):
    ours = tiny_gpt(seed=T)
    theirs = TorchGPT(CONFIG)
    params = copy_into_torch(ours, theirs)
    idx, targets = tokens((3, T), seed=T), tokens((3, T), seed=T + 1)

    logits = ours(idx)
    expected = theirs(torch.as_tensor(idx))
    np.testing.assert_allclose(logits.data, expected.detach().numpy(), **TIGHT)
    loss = cross_entropy(logits, targets)
    expected_loss = F.cross_entropy(
        expected.reshape(-1, CONFIG.vocab_size), torch.as_tensor(targets).reshape(-1)
    )
    np.testing.assert_allclose(loss.item(), expected_loss.item(), **TIGHT)
    loss.backward()
    expected_loss.backward()
    assert_same_gradients(ours, params)


@pytest.mark.torch
def test_mlp_output_and_every_gradient_match_torch():
    sizes = [6, 9, 7, 4]
    ours = randomized(MLP(sizes, rng=np.random.default_rng(0), dtype=np.float64))
    theirs = TorchMLP(sizes)
    params = copy_into_torch(ours, theirs)
    rng = np.random.default_rng(1)
    x, targets = rng.standard_normal((10, 6)), rng.integers(0, 4, 10)
    out, expected = ours(Tensor(x)), theirs(torch.as_tensor(x))
    np.testing.assert_allclose(out.data, expected.detach().numpy(), **TIGHT)
    cross_entropy(out, targets).backward()
    F.cross_entropy(expected, torch.as_tensor(targets)).backward()
    assert_same_gradients(ours, params)


@pytest.mark.torch
def test_layer_norm_matches_torch():
    rng = np.random.default_rng(0)
    ln = randomized(LayerNorm(5, dtype=np.float64))
    x = Tensor(rng.standard_normal((2, 3, 5)) * 3 + 1, requires_grad=True)
    tx = torch.tensor(x.data, requires_grad=True)
    tw, tb = (torch.tensor(p.data, requires_grad=True) for p in (ln.weight, ln.bias))
    out, expected = ln(x), F.layer_norm(tx, (5,), tw, tb, eps=1e-5)
    np.testing.assert_allclose(out.data, expected.detach().numpy(), **TIGHT)
    w = rng.standard_normal(out.shape)
    (out * Tensor(w)).sum().backward()
    (expected * torch.tensor(w)).sum().backward()
    for a, b in ((x, tx), (ln.weight, tw), (ln.bias, tb)):
        np.testing.assert_allclose(a.grad, b.grad.numpy(), **TIGHT)


@pytest.mark.torch
@pytest.mark.parametrize("shape", [(4,), (3, 4), (2, 3, 4)])
def test_linear_on_any_leading_shape_matches_torch(shape):
    rng = np.random.default_rng(0)
    layer = Linear(4, 5, rng=rng, dtype=np.float64)
    x = Tensor(rng.standard_normal(shape), requires_grad=True)
    tx = torch.tensor(x.data, requires_grad=True)
    tW = torch.tensor(layer.weight.data.T.copy(), requires_grad=True)
    tb = torch.tensor(layer.bias.data, requires_grad=True)
    out, expected = layer(x), F.linear(tx, tW, tb)
    assert out.shape == (*shape[:-1], 5)
    np.testing.assert_allclose(out.data, expected.detach().numpy(), **TIGHT)
    w = rng.standard_normal(out.shape)
    (out * Tensor(w)).sum().backward()
    (expected * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(x.grad, tx.grad.numpy(), **TIGHT)
    np.testing.assert_allclose(layer.weight.grad, tW.grad.numpy().T, **TIGHT)
    np.testing.assert_allclose(layer.bias.grad, tb.grad.numpy(), **TIGHT)


@pytest.mark.torch
def test_embedding_with_repeated_ids_matches_torch():
    emb = Embedding(6, 3, rng=np.random.default_rng(0), dtype=np.float64)
    ids = np.array([[1, 4, 1], [1, 0, 4]])
    tW = torch.tensor(emb.weight.data, requires_grad=True)
    out, expected = emb(ids), F.embedding(torch.as_tensor(ids), tW)
    np.testing.assert_array_equal(out.data, expected.detach().numpy())
    w = np.random.default_rng(1).standard_normal(out.shape)
    (out * Tensor(w)).sum().backward()
    (expected * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(emb.weight.grad, tW.grad.numpy(), **TIGHT)
    np.testing.assert_allclose(emb.weight.grad[1], w[0, 0] + w[0, 2] + w[1, 0], rtol=1e-14)
    np.testing.assert_array_equal(emb.weight.grad[[2, 3, 5]], 0)


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_the_fused_gpt_computes_what_the_composed_gpt_does(dtype, tol):
    """GPT(fused=True), every fused op of fused.py at work (a block's LayerNorms folded into
    the Linear after each), against GPT(fused=False): logits and every gradient, to rounding."""
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)
    idx = np.random.default_rng(0).integers(0, 11, (3, 8))
    results = []
    for fused in (True, False):
        model = GPT(cfg, seed=3, dtype=dtype, fused=fused)
        for p in model.parameters():  # LayerNorms away from w = 1, b = 0
            p.data += 0.1 * np.random.default_rng(p.size).standard_normal(p.shape).astype(dtype)
        logits = model(idx)
        cross_entropy(logits, idx).backward()
        results.append([logits.data] + [p.grad for p in model.parameters()])
    for ours, composed in zip(*results, strict=True):
        np.testing.assert_allclose(ours, composed, rtol=tol, atol=tol)


def test_a_users_head_or_linear_in_a_fused_gpt_runs_as_written():
    """LayerNorm + Linear, and a Linear + the residual add, are fused only where they are the
    library's own: a tied head (no bias, E^T), a Linear subclass with its own forward, or a
    forward set on the instance is called as written, and the fused GPT computes what the
    composed one does."""
    from minidp.models.gpt import own_forward

    class TiedHead(Module):
        def __init__(self, wte):
            self.weight = wte.weight

        def forward(self, x):
            return x @ self.weight.T

    class Doubled(Linear):
        def forward(self, x):
            return super().forward(x) * 2.0

    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)
    idx = np.random.default_rng(0).integers(0, 11, (2, 8))
    results = []
    for fused in (True, False):
        model = GPT(cfg, seed=3, dtype=np.float64, fused=fused)
        model.head = TiedHead(model.wte)
        fc = model.blocks[0].fc
        model.blocks[0].fc = doubled = Doubled(
            8, 32, rng=np.random.default_rng(1), dtype=np.float64
        )
        doubled.weight.data[...], doubled.bias.data[...] = fc.weight.data, fc.bias.data
        for block, name in ((model.blocks[0], "fc_proj"), (model.blocks[0].attn, "proj")):
            old = getattr(block, name)  # the residual's Linears too (gpt.add_linear)
            setattr(block, name, Doubled(*old.weight.shape, rng=np.random.default_rng(2)))
            new = getattr(block, name)
            new.weight.data, new.bias.data = old.weight.data.copy(), old.bias.data.copy()
        logits = model(idx)
        cross_entropy(logits, idx).backward()
        results.append([logits.data, model.wte.weight.grad])
    for ours, composed in zip(*results, strict=True):
        np.testing.assert_allclose(ours, composed, rtol=1e-12, atol=1e-12)
    linear = Linear(2, 2, rng=np.random.default_rng(0))
    assert own_forward(linear, Linear) and not own_forward(
        Doubled(2, 2, rng=np.random.default_rng(0)), Linear
    )
    linear.forward = lambda x: x  # as FSDP wraps a unit's forward
    assert not own_forward(linear, Linear) and not own_forward(TiedHead(model.wte), Linear)
