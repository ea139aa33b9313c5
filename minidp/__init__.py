"""minidp: distributed training from scratch, in NumPy and mpi4py, small enough to read.

    import minidp
    x = minidp.Tensor([[1.0, 2.0]], requires_grad=True)
    (x * x).sum().backward()          # x.grad == 2 x

The layers, bottom up, one folder each (arrows point down only: tests/test_layering.py):

    engine/     Tensor + op + backward, functional, nn, optim: plain, no MPI, no speed tricks
    fast/       the engine's speed tricks, switched in by the engine's table (registry.py)
    tools/      log, names, chunks, plots, memory, info, the parser and flags, paths,
                records, the meter
    models/     the GPT, the PyTorch reference, the data and the sampler, tasks, pruning
    comm/       hand-written collectives on MPI point to point; the trace of what ranks did
    parallel/   the pieces a user wraps around their own model, one folder per scheme
    cli/        the command line: its config, the one loop, the --strategy recipes
    cost/       the cost model, a tool beside the face: a layout or a run priced without
                running it (`python -m minidp predict`, `simulate`, a --json run's record)

Everything below comm/ imports without MPI, and so does cost/'s model (cost/step.py).
`minidp.nn`, `minidp.optim` and `minidp.functional` are the engine's modules under PyTorch's
names (`import minidp.nn as nn` works); `minidp.nn.GPT` and `minidp.nn.GPTConfig` name the
model of models/gpt.py, `minidp.nn.MoE` and `minidp.nn.load_balancing_loss` the experts'
layer of models/moe/; `import minidp.horovod as hvd` is parallel/horovod/, Horovod's
names. A new op (a communication op of a parallel scheme, say) is written with `minidp.op`:
engine/tensor.py's docstring states its contract.
"""

import importlib
import importlib.abc
import importlib.util
import sys

from minidp import fast  # noqa: F401 (fills the engine's table: fast/__init__.py)
from minidp.engine import functional, nn, optim
from minidp.engine.functional import (
    concatenate,
    cross_entropy,
    dropout,
    mse,
    split,
    stack,
    where,
)
from minidp.engine.tensor import Tensor, is_grad_enabled, no_grad, op
from minidp.fast.weight_grads import Product, defer_weight_grads
from minidp.models import data
from minidp.models.gpt import GPT, Block, CausalSelfAttention, GPTConfig
from minidp.models.moe import MoE, load_balancing_loss

# PyTorch's names for the engine's modules: `import minidp.nn as nn`, `from minidp.optim
# import AdamW` (and `from minidp.data import DistributedSampler`, the models' data). And
# the GPT under nn, as the contract has it (engine/nn.py cannot import models/gpt.py,
# which is built from it).
nn.GPT, nn.GPTConfig, nn.Block, nn.CausalSelfAttention = GPT, GPTConfig, Block, CausalSelfAttention
nn.MoE, nn.load_balancing_loss = MoE, load_balancing_loss  # models/moe/: experts for any model
for _name, _module in (("nn", nn), ("optim", optim), ("functional", functional), ("data", data)):
    sys.modules[f"minidp.{_name}"] = _module


class _Horovod(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import minidp.horovod as hvd`: Horovod's names (parallel/horovod/), imported only
    when asked for, so that `import minidp` stays without MPI."""

    def find_spec(self, name, path=None, target=None):
        if name == "minidp.horovod":
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module("minidp.parallel.horovod")
        self.spec = module.__spec__  # the import system sets the alias's spec on it next
        return module

    def exec_module(self, module) -> None:
        """The module ran when create_module imported it: its own spec back."""
        module.__spec__ = self.spec


sys.meta_path.append(_Horovod())

__version__ = "0.1.0"

__all__ = [
    "Tensor",
    "op",
    "no_grad",
    "is_grad_enabled",
    "defer_weight_grads",
    "Product",
    "nn",
    "functional",
    "optim",
    "data",
    "concatenate",
    "stack",
    "split",
    "where",
    "dropout",
    "cross_entropy",
    "mse",
    "GPT",
    "GPTConfig",
    "__version__",
]
