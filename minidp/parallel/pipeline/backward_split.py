"""Backward split in two, B and W: the zero-bubble pipeline's actions (Qi et al., ICLR 2024,
"Zero Bubble Pipeline Parallelism").

A layer y = x W has two gradients, and only one of them is on the critical path:

    B  (input):   dL/dx = dL/dy W^T     the previous stage waits for it: send it at once
    W  (weight):  dL/dW = x^T dL/dy     nobody waits for it: run it later, in a bubble

`backward_input(root)` walks the graph behind `root` as the engine's backward does
(engine/tensor.py: reverse topological order, each tensor's gradient complete before it flows
on), but hands nothing to a parameter: each gradient meant for a leaf is kept, in a list of
(leaf, gradient), and left uncomputed where the op allows it. nn.linear's backward gives
its weight's gradient as a `Product` (weight_grads.py): the two factors x and dL/dy, not yet
multiplied. So B does the activation-gradient products and sends, W the weight products.
(With the deferral switched off, `weight_grads.deferral(False)`, linear returns x^T g
multiplied: B then computes every weight gradient too, and W only adds them in.)

`backward_weight(kept)` then adds the kept gradients into the leaves' .grad through the
engine itself: one op whose parents are the leaves and whose backward returns the kept
gradients, backpropagated. The engine multiplies each Product out (or keeps its rows inside
`defer_weight_grads()`), adds it into .grad, and fires each leaf's grad-ready hooks, as a
full backward would have. B then W equals one backward, to rounding (the same products;
a leaf used twice sums its two gradients in W, not in B).

Memory: between B and W a stage still holds, per Linear, its input x and dL/dy (the
Product's factors); the rest of the micro-batch's graph is freed after B.
"""

import numpy as np

from minidp.engine.backend import base_of
from minidp.engine.tensor import LazyGradient, Tensor, op
from minidp.fast.weight_grads import Product
from minidp.tools.memory import nbytes

__all__ = ["backward_input", "backward_weight", "kept_bytes"]


def _array(g):
    return g.value() if isinstance(g, LazyGradient) else g


def backward_input(root: Tensor) -> list[tuple[Tensor, object]]:
    """B: backpropagate from `root` (seeded with ones, root is 0-d or size 1) into every
    tensor but the leaves; return [(leaf, its gradient: an array or a LazyGradient)]."""
    grads = {id(root): np.ones_like(root.data)}
    kept = []
    for node in reversed(root._topological_order()):
        g = grads.pop(id(node), None)
        if g is None or node._backward is None:
            continue  # leaves are reached only through `kept`
        for parent, pg in zip(node._parents, node._backward(g)):
            if pg is None or not parent.requires_grad:
                continue
            if parent._backward is None:
                kept.append((parent, pg))  # W's, uncomputed
                continue
            total = grads.get(id(parent))
            grads[id(parent)] = _array(pg) if total is None else _array(total) + _array(pg)
    return kept


def backward_weight(kept: list[tuple[Tensor, object]]) -> None:
    """W: add the gradients `backward_input` kept into their leaves' .grad (through the
    engine: Products multiplied, grad-ready hooks fired)."""
    if not kept:
        return
    leaves = tuple(leaf for leaf, _ in kept)
    grads = tuple(g for _, g in kept)
    ones = np.ones((), leaves[0].dtype)
    op(ones, leaves, lambda _seed: grads).backward()


def kept_bytes(kept: list[tuple[Tensor, object]], inputs=None) -> int:
    """Bytes of what B kept for W: gradients, and each Product's two factors; not `inputs`
    (the first stage's batch, the user's array and no activation, as activation_bytes
    leaves leaves out), nor any view of the array it lies in."""
    arrays = []
    for _, g in kept:
        arrays += [g.x, g.g] if isinstance(g, Product) else [_array(g)]
    if inputs is not None:
        batch = id(base_of(getattr(inputs, "data", inputs)))
        arrays = [a for a in arrays if id(base_of(a)) != batch]
    return nbytes(arrays)
