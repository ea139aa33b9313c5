"""Layers on minidp Tensors: Module and Parameter, Linear, MLP, LayerNorm, Embedding, Dropout.
The tiny character-level GPT built from them is minidp/models/gpt.py (`minidp.nn.GPT` names
it too: minidp/__init__.py).

Conventions:
- A Linear computes y = x W + b with W of shape (in, out), the orientation of the Megatron
  paper (Y = XA), so "split A by columns" means split the output features.
- Every layer is initialized from a `np.random.Generator`, so every rank that builds a model
  from the same seed holds the identical model; under `deferred_init()` (deferred.py) the
  weights drawn are recipes, drawn later a slice at a time.
- `named_parameters()` yields, for each module, first its own Parameter attributes in the
  order each attribute was first assigned, then each sub-module's parameters, depth first,
  sub-modules also in first-assignment order (a list or tuple of modules in index order,
  named `blocks.0.`, `blocks.1.`, ...). So a module that assigns a child before a Parameter
  still lists the Parameter first; a Parameter inside a list, or a module inside a dict, is
  not found. The order depends only on the code: the same on every rank, every run.
- A shared Parameter (a tied weight: `model.fc4.weight = model.fc2.weight`) is one Parameter
  under several names. `named_parameters()` and `parameters()` yield it once, under the name
  it is first met by, as PyTorch's do (remove_duplicate=True): so an optimizer steps it once,
  `num_parameters()` counts it once, and DDP gives it one bucket slot. Its gradient is the
  sum over its uses, as for any tensor used twice. `state_dict()` lists it under every name,
  as PyTorch's does, and `load_state_dict()` wants every name.
- A Parameter with `requires_grad = False` is frozen: still a parameter (listed, counted,
  saved), but backward gives it no gradient, so optimizers (which skip a None .grad) leave it.
"""

from collections.abc import Iterator

import numpy as np

from minidp.engine import functional as F
from minidp.engine.backend import is_torch, namespace, to_numpy
from minidp.engine.casts import computed, in_float32, matmul_operands
from minidp.engine.deferred import deferred_init, materialize_module, normal, uniform
from minidp.engine.functional import cross_entropy, mse
from minidp.engine.registry import FAST, fast
from minidp.engine.tensor import Tensor, op

__all__ = [
    "Parameter",
    "Module",
    "linear",
    "Linear",
    "MLP",
    "LayerNorm",
    "Embedding",
    "Dropout",
    "deferred_init",
    "materialize_module",
    "cross_entropy",
    "mse",
]


class Parameter(Tensor):
    """A Tensor that is trained: requires a gradient, and is found by `Module.parameters()`.
    Set `requires_grad = False` to freeze it (see the module docstring). `recipe`: how to
    draw its values while they are not drawn yet (deferred_init, engine/deferred.py)."""

    recipe = None

    def __init__(self, data, dtype=None):
        super().__init__(data, requires_grad=True, dtype=dtype)
        self.recipe = getattr(data, "recipe", None)  # a deferred draw's stand-in carries it


class Module:
    """Base class: finds its parameters and sub-modules among its attributes."""

    training = True

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def children(self) -> Iterator[tuple[str, "Module"]]:
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value
            elif isinstance(value, list | tuple):
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield f"{name}.{i}", item

    def named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter): this module's own, in assignment order, then each
        child's, depth first (the order DDP's buckets and optimizers see). A parameter met
        again under another name (a tied weight) is left out, unless remove_duplicate=False."""
        seen: set[int] = set()
        for name, p in self._every_named_parameter(prefix):
            if remove_duplicate and id(p) in seen:
                continue
            seen.add(id(p))
            yield name, p

    def _every_named_parameter(self, prefix: str) -> Iterator[tuple[str, Parameter]]:
        """Every (name, parameter), a shared one under each of its names."""
        for name, value in vars(self).items():
            if isinstance(value, Parameter):
                yield prefix + name, value
        for name, child in self.children():
            yield from child._every_named_parameter(f"{prefix}{name}.")

    def parameters(self) -> list[Parameter]:
        """Each parameter once (see named_parameters), frozen ones included."""
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        """How many numbers the parameters hold (a shared one counted once, frozen ones too)."""
        return sum(p.size for p in self.parameters())

    def train(self, mode: bool = True) -> "Module":
        self.training = mode
        for _, child in self.children():
            child.train(mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters by name, a shared one under each of its names: their own arrays,
        as PyTorch's state dict shares the parameters' storage (so a broadcast into it,
        Horovod's broadcast_parameters, sets the model; copy it to keep a snapshot). On
        --backend torch, host NumPy copies (torch_ref.py and a NumPy model load it alike)."""
        named = self.named_parameters(remove_duplicate=False)
        return {
            name: p.data if isinstance(p.data, np.ndarray) else np.array(to_numpy(p.data))
            for name, p in named
        }

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Copy values into the existing arrays (in place: views into them stay valid).

        Every name `state_dict()` gives must be there, a shared parameter's each of them; they
        are copied in the order state_dict lists them, so the last of its names gives the value
        it keeps (as in PyTorch's load_state_dict)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        missing, unexpected = params.keys() - state.keys(), state.keys() - params.keys()
        if missing or unexpected:
            raise KeyError(
                f"load_state_dict: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        for name, p in params.items():
            value = np.asarray(state[name])
            if value.shape != p.shape:
                raise ValueError(
                    f"load_state_dict: {name} has shape {value.shape}, model {p.shape}"
                )
            if is_torch(p.data):  # --backend torch: copied onto the parameter's device
                p.data.copy_(p.data.new_tensor(value))
            else:
                p.data[...] = value


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False) -> Tensor:
    """y = x W + b as one op, for x of shape (..., in): what `x @ weight + bias` computes;
    with relu=True, max(x W + b, 0): what `(x @ weight + bias).relu()` computes.

    Why fused: composed, a Linear records two graph nodes (four for a (B, T, C) input: a
    reshape in and out), each with a Tensor, a closure and an unbroadcast in backward, and a
    ReLU after it one more. On a small model that bookkeeping costs as much as the
    arithmetic; one op does the same NumPy calls, so the same float bits, with one node (and
    keeps one array where the ReLU kept three: its input, its mask, its output). It is also
    the op API at its plainest: arrays in, `op(data, parents, backward)` out, the gradients
    beside the forward. (PyTorch fuses the same way on GPUs: cuBLASLt's GEMM epilogues add
    the bias and apply the ReLU in the product's kernel.)
    """
    x = x if isinstance(x, Tensor) else Tensor(x)
    x, weight = matmul_operands(x, weight)  # torch: x cast to a 16-bit weight's (casts.py)
    X = x.data if x.ndim == 2 else x.data.reshape(-1, x.shape[-1])  # (N, in): one plain product
    W = weight.data
    if X.shape[-1] != W.shape[0]:
        raise ValueError(f"linear: input {x.shape} does not fit a weight of shape {W.shape}")
    y = X @ W
    if bias is not None and bias.dtype == y.dtype:
        y += bias.data  # in place: y is this op's own new array
    elif bias is not None:
        y = y + bias.data  # the dtype x @ weight + bias has
    if relu and isinstance(y, np.ndarray):
        np.maximum(y, 0, out=y)  # maximum, not y * (y > 0): -inf * 0 would be nan
    elif relu:
        y = namespace(y).maximum(y, 0)  # a torch tensor (--backend torch)

    def backward(g):  # y = X W + b  ->  dX = g W^T,  dW = X^T g,  db = sum of g over rows
        g = g.reshape(y.shape)
        if relu:  # through the ReLU first: y > 0 exactly where x W + b > 0
            g = g * (y > 0)
        dx = (g @ W.T).reshape(x.shape) if x.requires_grad else None
        dw = None
        if weight.requires_grad:  # X^T g, or a speed trick's (registry.py: weight_gradient)
            deferred = FAST.get("weight_gradient")
            dw = X.T @ g if deferred is None else deferred(X, g)
        if bias is None:
            return dx, dw
        return dx, dw, (g.sum(axis=0) if bias.requires_grad else None)

    parents = (x, weight) if bias is None else (x, weight, bias)
    return op(y if x.ndim == 2 else y.reshape(*x.shape[:-1], W.shape[1]), parents, backward)


class Linear(Module):
    """y = x W + b, W: (in_features, out_features). PyTorch's default init: U(+-1/sqrt(in))."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        rng: np.random.Generator,
        dtype=np.float32,
        std: float | None = None,
    ):
        bound = 1 / np.sqrt(in_features)
        shape = (in_features, out_features)
        w = uniform(rng, shape, bound, dtype) if std is None else normal(rng, shape, std, dtype)
        self.weight = Parameter(w, dtype=dtype)
        self.bias = None
        if bias:
            b = uniform(rng, out_features, bound, dtype) if std is None else np.zeros(out_features)
            self.bias = Parameter(b, dtype=dtype)

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        """x W + b; with relu=True, max(x W + b, 0) in the same op (see `linear`)."""
        return linear(x, self.weight, self.bias, relu=relu)


class MLP(Module):
    """Linear layers with ReLU between them: sizes (784, 1024, 1024, 10) -> 3 Linears.

    `fuse_relu`: each hidden Linear and its ReLU as one op (`linear(..., relu=True)`, a speed
    trick: one graph node and one kept array a layer), or, False, the plain way, a Linear
    then `.relu()`. The same bits either way (tests/test_nn.py); `bench autograd` times both."""

    def __init__(
        self, sizes: list[int], *, rng: np.random.Generator, dtype=np.float32, fuse_relu=True
    ):
        self.layers = [Linear(a, b, rng=rng, dtype=dtype) for a, b in zip(sizes[:-1], sizes[1:])]
        self.fuse_relu = fuse_relu

    def forward(self, x: Tensor) -> Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i < last and not self.fuse_relu:
                x = layer(x).relu()  # the plain way: two ops
            else:
                x = layer(x, relu=i < last)  # Linear and ReLU as one op (see `linear`)
        return x


class LayerNorm(Module):
    """(x - mean) / sqrt(var + eps) * weight + bias, over the last axis.

    `fused` (the default): where the speed tricks are in (registry.py), one op with its
    backward written out (fast/fused.py layer_norm: 1 graph node where the plain way below
    records 11); False: always the plain way, the reference it is tested against."""

    def __init__(self, dim: int, eps: float = 1e-5, *, dtype=np.float32, fused: bool = True):
        self.eps = eps
        self.weight = Parameter(np.ones(dim), dtype=dtype)
        self.bias = Parameter(np.zeros(dim), dtype=dtype)
        self.fused = fused

    def forward(self, x: Tensor) -> Tensor:
        x = in_float32(x)  # 16-bit torch activations: normalized in float32 (casts.py)
        fused = self.fused and fast("layer_norm", x, self.weight, self.bias)
        if fused:
            return fused(x, self.weight, self.bias, self.eps)
        centered = x - x.mean(axis=-1, keepdims=True)
        var = (centered * centered).mean(axis=-1, keepdims=True)
        return centered / (var + self.eps).sqrt() * self.weight + self.bias


class Embedding(Module):
    """A lookup table: row i of `weight` is the vector of token i: `weight[idx]`, whose
    backward adds g's rows into a zeroed table with np.add.at. `fused` (the default): where
    the speed tricks are in, the same gradient summed by sorting the ids (fast/fused.py
    embedding; equal to rounding)."""

    def __init__(
        self,
        num: int,
        dim: int,
        *,
        rng: np.random.Generator,
        dtype=np.float32,
        std: float = 0.02,
        fused: bool = True,
    ):
        self.weight = Parameter(normal(rng, (num, dim), std, dtype), dtype=dtype)
        self.fused = fused

    def forward(self, idx: np.ndarray) -> Tensor:
        weight = computed(self.weight)  # a 16-bit table: rows summed back in float32, once cast
        fused = self.fused and fast("embedding", weight)
        return fused(weight, idx) if fused else weight[np.asarray(idx)]


class Dropout(Module):
    def __init__(self, p: float, *, rng: np.random.Generator):
        self.p, self.rng = p, rng

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.rng, self.training)
