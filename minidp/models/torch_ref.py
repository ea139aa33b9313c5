"""The reference in plain PyTorch: minidp's MLP and GPT written in torch.nn, trained with
torch's own autograd and torch.optim.AdamW (minidp_bench/torch_train.py has the loop and DDP).

    net = torch_model(task.model)          # the same architecture, minidp's weights loaded
    load_minidp_state(net, model.state_dict())
    state = minidp_state(net)              # back: a minidp state dict (NumPy arrays)

Nothing here imports minidp's engine: it is what a PyTorch user would write, so that minidp
can be checked against the system people actually use (same weights and data in, the same
losses out). Names match minidp's parameter names one for one (`blocks.0.attn.qkv.weight`);
the one difference of layout is torch.nn.Linear's weight, (out, in), the transpose of
minidp's (in, out) (minidp follows the Megatron paper, Y = XA): loading transposes it.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear layers with ReLU between them, as minidp.nn.MLP."""

    def __init__(self, sizes: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class Attention(nn.Module):
    """Causal multi-head self-attention, written out (no fused kernel: the same arithmetic
    as minidp's, softmax over a -inf-masked score matrix)."""

    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        future = torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), diagonal=1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H = self.n_head
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
        att = att.masked_fill(self.future[:T, :T], float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + fc_proj(gelu(fc(ln2(x))))."""

    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head, block_size)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token and position embeddings, blocks, a final LayerNorm, a head without bias."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[-1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def torch_model(model, dtype=torch.float32, device: str = "cpu") -> nn.Module:
    """The PyTorch twin of a minidp MLP or GPT, holding the same weights."""
    if hasattr(model, "config"):  # a minidp GPT
        c = model.config
        if c.dropout:
            raise ValueError("the torch reference compares without dropout: --dropout 0")
        net = GPT(c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_embd)
    else:
        net = MLP([model.layers[0].weight.shape[0], *(l.weight.shape[1] for l in model.layers)])
    net = net.to(device=device, dtype=dtype)
    load_minidp_state(net, model.state_dict())
    return net


def _linear_weights(net: nn.Module) -> set[str]:
    """Names of the nn.Linear weights: stored (out, in) in torch, (in, out) in minidp."""
    return {f"{name}.weight" for name, m in net.named_modules() if isinstance(m, nn.Linear)}


def load_minidp_state(net: nn.Module, state: dict[str, np.ndarray]) -> None:
    """Copy a minidp state dict (name -> NumPy array) into `net`, transposing Linear weights."""
    linear = _linear_weights(net)
    params = dict(net.named_parameters())
    if params.keys() != state.keys():
        raise KeyError(f"minidp state and torch model differ: {sorted(params.keys() ^ state)}")
    with torch.no_grad():
        for name, p in params.items():
            value = np.asarray(state[name])
            p.copy_(torch.from_numpy(np.ascontiguousarray(value.T if name in linear else value)))


def minidp_state(net: nn.Module) -> dict[str, np.ndarray]:
    """`net`'s parameters as a minidp state dict (NumPy, Linear weights as (in, out))."""
    linear = _linear_weights(net)
    return {
        name: (p.detach().cpu().numpy().T if name in linear else p.detach().cpu().numpy()).copy()
        for name, p in net.named_parameters()
    }
