"""Cutting a user's model into pipeline stages: which layers each stage runs.

    GPT, n_layer 5, 3 stages:   stage 0: wte + wpe, blocks 0 1
                                stage 1:            blocks 2 3
                                stage 2:            block  4,  ln_f + head
    MLP, 4 Linears, 3 stages:   stage 0: layers 0 1 | stage 1: layer 2 | stage 2: layer 3
    your list of 4 modules:     the same as the MLP's (torch.nn.Sequential's contract:
                                each module's output is the next one's input)

Blocks (or layers) go to stages as evenly as possible, the first `n % S` stages taking one
more (`chunk_bounds`, as a vector is cut into chunks). A part holds the user's own modules,
not copies: its parameters are the model's, frozen ones included, and training a part
trains the model. The loss is not in the part: the last PipelineStage applies it. A
weight shared by two stages (a head tied to the embedding) is refused: its two gradients
would live on two ranks (Megatron-LM allreduces them between the first and last stage).
"""

import functools

import numpy as np

from minidp import comm
from minidp.engine import nn
from minidp.engine.recompute import checkpoint
from minidp.engine.tensor import Tensor
from minidp.models.gpt import GPT
from minidp.tools.chunks import chunk_bounds

__all__ = ["GPTPart", "LayersPart", "MLPPart", "RankStages", "gather_stages", "split_model"]


def _renumbered(named, list_name: str, offset: int):
    """(name, parameter) pairs with `list_name.i.` renamed `list_name.{i + offset}.`: a
    part's names are the whole model's (its state_dict loads into the model's)."""
    head = list_name + "."
    for name, p in named:
        if name.startswith(head):
            i, rest = name[len(head) :].split(".", 1)
            name = f"{head}{int(i) + offset}.{rest}"
        yield name, p


class GPTPart(nn.Module):
    """Blocks [lo, hi) of a GPT, with the embeddings in front on the first stage and the
    final LayerNorm and head behind on the last. Input: token ids (first) or activations
    (B, T, C); output: activations, or logits (B, T, vocab_size) on the last. Parameters
    are named as in the whole GPT ("blocks.2.fc.weight" for its third block). `recompute`:
    each block keeps only its input and runs again in backward
    (engine/recompute.py).

    `gpt` is an nn.GPT or a TensorParallelGPT (a stage of a pipeline whose layers are split
    over a TP group too: the 3-D mesh); either has the parts named here and an `embed`."""

    def __init__(self, gpt, lo: int, hi: int, recompute: bool = False):
        self.recompute = recompute
        self.offset = lo
        self.first, self.last = lo == 0, hi == len(gpt.blocks)
        if self.first:  # the model's own embedding, on its own modules (held here)
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
            self.embed = gpt.embed
        self.blocks = gpt.blocks[lo:hi]
        if self.last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x) -> Tensor:
        if self.first:
            x = self.embed(x)
        for block in self.blocks:
            x = checkpoint(block, x) if self.recompute else block(x)
        return self.head(self.ln_f(x)) if self.last else x

    def _every_named_parameter(self, prefix: str):
        return _renumbered(super()._every_named_parameter(prefix), prefix + "blocks", self.offset)


class MLPPart(nn.Module):
    """Layers [lo, hi) of an MLP: a ReLU after each but the model's last layer. Parameters
    are named as in the whole MLP ("layers.2.weight")."""

    def __init__(self, mlp: nn.MLP, lo: int, hi: int):
        self.offset = lo
        self.layers = mlp.layers[lo:hi]
        self.relu = [lo + i < len(mlp.layers) - 1 for i in range(hi - lo)]
        self.fuse_relu = mlp.fuse_relu

    def forward(self, x) -> Tensor:
        for layer, relu in zip(self.layers, self.relu):
            x = layer(x, relu=True) if relu and self.fuse_relu else layer(x)
            if relu and not self.fuse_relu:
                x = x.relu()
        return x

    def _every_named_parameter(self, prefix: str):
        return _renumbered(super()._every_named_parameter(prefix), prefix + "layers", self.offset)


class LayersPart(nn.Module):
    """Modules [lo, hi) of a user's sequential model, a list of modules each taking the one
    before's output (torch.nn.Sequential's contract). Parameters are named by the module's
    index in the whole list, as torch.nn.Sequential names them ("3.fc.weight")."""

    def __init__(self, layers: list, lo: int, hi: int):
        self.offset = lo
        self.layers = list(layers[lo:hi])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def _every_named_parameter(self, prefix: str):
        for i, layer in enumerate(self.layers):
            yield from layer._every_named_parameter(f"{prefix}{self.offset + i}.")


def split_model(model, num_stages: int, *, recompute: bool = False) -> list[nn.Module]:
    """The `num_stages` parts of a user's nn.GPT (or its TensorParallelGPT), nn.MLP, or
    sequential model (a list or tuple of modules run in order), in order. ValueError naming
    `num_stages` when the model has fewer blocks (layers) than stages. `recompute` (GPT
    only): every block recomputed in backward (engine/recompute.py)."""
    if isinstance(model, list | tuple):
        if not model or not all(isinstance(m, nn.Module) for m in model):
            raise TypeError("split_model: a sequential model is a non-empty list of Modules")
        if recompute:
            raise ValueError("recompute=True: for an nn.GPT's blocks")
        units, part, what = len(model), LayersPart, "modules"
    elif isinstance(model, GPT) or _is_gpt(model):
        units, what = len(model.blocks), "blocks"
        part = functools.partial(GPTPart, recompute=recompute)
    elif isinstance(model, nn.MLP):
        units, part, what = len(model.layers), MLPPart, "layers"
        if recompute:
            raise ValueError(
                "recompute=True: for an nn.GPT's blocks (an MLP's layer keeps its input anyway)"
            )
    else:
        raise TypeError(
            f"split_model: model must be a GPT (an nn.GPT or a TensorParallelGPT), an nn.MLP "
            f"or a list of Modules run in order, got {type(model)}"
        )
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > units:
        raise ValueError(f"num_stages ({num_stages}) exceeds the model's {units} {what}")
    bounds = chunk_bounds(units, num_stages)
    parts = [part(model, bounds[s], bounds[s + 1]) for s in range(num_stages)]
    _check_nothing_shared(parts)
    return parts


def _is_gpt(model) -> bool:
    """A GPT split some other way, as GPTPart reads one (a TensorParallelGPT): its blocks
    and the modules around them, and an `embed`."""
    return all(hasattr(model, a) for a in ("blocks", "embed", "wte", "wpe", "ln_f", "head"))


def _check_nothing_shared(parts: list[nn.Module]) -> None:
    """A parameter in two parts (a head tied to the embedding, with the embedding on the
    first stage and the head on the last) would get two halves of its gradient on two ranks
    and drift apart: refused, naming it."""
    owner: dict[int, tuple[int, str]] = {}
    for s, part in enumerate(parts):
        for name, p in part.named_parameters():
            if id(p) in owner and owner[id(p)][0] != s:
                first, first_name = owner[id(p)]
                raise ValueError(
                    f"num_stages ({len(parts)}): parameter {first_name!r} of stage {first} is "
                    f"also {name!r} of stage {s} (a tied weight); stages cannot share one"
                )
            owner[id(p)] = (s, name)


class RankStages(nn.Module):
    """A rank's parts (one, or V for interleaving) as one module for DDP or ZeRO to wrap:
    its parameters are the parts', under the parts' own names."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def _every_named_parameter(self, prefix: str):
        for part in self.parts:
            yield from part._every_named_parameter(prefix)


def gather_stages(model, num_stages: int, whole: dict, stage_rank, pp_group: comm.Group) -> None:
    """Collective over `pp_group`: every parameter of `model` (cut as split_model cuts it
    into `num_stages`) set from the rank that holds its stage, `stage_rank(s)`; `whole`:
    {name: whole array} of this rank's stages' parameters (gathered over TP where the
    stages are TP shards). A parameter whose array is already `whole`'s keeps it."""
    target = dict(model.named_parameters())
    for s, part in enumerate(split_model(model, num_stages)):  # the whole model's names
        names = [name for name, _ in part.named_parameters()]
        if not names:
            continue
        mine = all(n in whole for n in names)
        dtype = target[names[0]].dtype
        if mine:
            flat = np.concatenate([np.asarray(whole[n], dtype).ravel() for n in names])
        else:
            flat = np.empty(sum(target[n].size for n in names), dtype)
        comm.broadcast(flat, root=stage_rank(s), group=pp_group)
        offset = 0
        for n in names:
            p = target[n]
            if whole.get(n) is not p.data:
                p.data = flat[offset : offset + p.size].reshape(p.shape).copy()
            offset += p.size
