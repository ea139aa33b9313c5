"""Activation recomputation: a piece of the model keeps only its inputs, and runs again in
backward. PyTorch calls it `torch.utils.checkpoint.checkpoint(fn, *args)`; so does minidp:

    from minidp.engine.recompute import checkpoint
    for block in self.blocks:
        x = checkpoint(block, x)       # instead of x = block(x)

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"); Megatron-LM's full
recomputation. A transformer block keeps about 3 B H T^2 + 20 B T C numbers for its
backward (tools/memory.py); recomputed, it keeps its input and output only:

    forward:   y = fn(x) under no_grad          keeps x and y, nothing inside fn
    backward:  y' = fn(x') with x' a fresh leaf  fn's graph again, for a moment
               y'.backward(dL/dy)                -> the parameters' gradients, and dL/dx'
               hand dL/dx' to x

One more forward of fn per step (about a third more compute) for the memory of everything
inside it. The bits are the same: the same arithmetic runs twice. Dropout draws the same
masks the second time: the random generators of fn's modules are set back to where they
stood before the first forward, and returned to where they are after (PyTorch's
`preserve_rng_state`).

The parameters' gradients are added by the inner backward (the engine's own, firing their
hooks), so a data-parallel bucket or a ZeRO shard sees each gradient as usual, only later;
and a pipeline stage split into B and W (parallel/pipeline/backward_split.py) computes a
recomputed block's weight gradients during B: W has only the blocks not recomputed.
`fn` may be a Module (its parameters are then recorded as parents, so the op is in the graph
even when no input needs a gradient) or any function of Tensors whose result is one Tensor;
a plain function's op is recorded only when some input needs a gradient, and its dropout
generators are not found (only a Module's are): pass the Module that holds the dropout.

What recomputation holds: the graph outside the recomputed pieces, and, for a moment in
backward, one piece's graph. `measuring(bytes_of)` lets a caller count the second (the
step skeleton adds the largest to its activation peak: parallel/step.py).
"""

import contextlib

import numpy as np

from minidp.engine.nn import Module
from minidp.engine.tensor import Tensor, is_grad_enabled, no_grad, op

__all__ = ["checkpoint", "measuring"]

_measures: list = []  # [(bytes_of, results)] while measuring(); empty otherwise


def checkpoint(fn, *args):
    """fn(*args), keeping only the Tensors among args: fn runs again in backward (see the
    module doc). Arguments that are not Tensors (arrays, numbers) are passed as they are.
    Under no_grad nothing is kept anyway: fn(*args), once."""
    if not is_grad_enabled():
        return fn(*args)
    params = [p for p in fn.parameters() if p.requires_grad] if isinstance(fn, Module) else []
    generators = _generators(fn)
    before = [g.bit_generator.state for g in generators]
    with no_grad():
        y = fn(*args)
    tensors = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
    kept = [(args[i].data, args[i].requires_grad) for i in tensors]

    def backward(g):
        again = list(args)
        for i, (data, needs_grad) in zip(tensors, kept):
            again[i] = Tensor(data, requires_grad=needs_grad)
        after = [gen.bit_generator.state for gen in generators]
        for gen, state in zip(generators, before):  # the same dropout masks
            gen.bit_generator.state = state
        y_again = fn(*again)
        for gen, state in zip(generators, after):
            gen.bit_generator.state = state
        for bytes_of, results in _measures:
            results.append(bytes_of(y_again))
        if y_again.requires_grad:
            y_again.backward(g)  # the parameters' gradients, here
        return (*[again[i].grad for i in tensors], *[None] * len(params))

    # the parameters are parents so that the op is recorded even if no input needs a gradient
    return op(y.data, (*[args[i] for i in tensors], *params), backward)


@contextlib.contextmanager
def measuring(bytes_of):
    """Within: each recomputed graph's bytes, `bytes_of(its output)`, appended to the list
    this yields (tools/memory.py's activation_bytes is such a function)."""
    results: list[int] = []
    _measures.append((bytes_of, results))
    try:
        yield results
    finally:
        _measures.remove((bytes_of, results))


def _generators(fn) -> list[np.random.Generator]:
    """The distinct random generators that fn's modules hold (a Dropout's `rng`)."""
    found, stack = {}, [fn] if isinstance(fn, Module) else []
    while stack:
        module = stack.pop()
        for value in vars(module).values():
            if isinstance(value, np.random.Generator):
                found[id(value)] = value
        stack.extend(child for _, child in module.children())
    return list(found.values())
