"""Activation recomputation: a block keeps only its input, and runs again in backward.

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"); Megatron-LM's full
recomputation. A pipeline stage holds one micro-batch's activations from its forward to its
backward, for up to S micro-batches (1F1B) or M (GPipe): per transformer block that is
about 3 B H T^2 + 20 B T C numbers (memory.py). Recomputed, a block keeps its input x
(B T C) and output only:

    forward:   y = block(x) under no_grad          keeps x and y, nothing inside the block
    backward:  y' = block(x') with x' a fresh leaf  the block's graph again, for a moment
               y'.backward(dL/dy)                   -> the parameters' gradients, and dL/dx'
               hand dL/dx' to x

one more forward per block per micro-batch (about a third more compute) for the memory of
everything inside it. The bits are the same: the same arithmetic runs twice. A block with
dropout would draw another mask the second time, so recomputation refuses p > 0.

The parameters' gradients are added by the inner backward (the engine's own, firing their
hooks), so a stage split into B and W (backward_split.py) computes a recomputed block's
weight gradients during B: W has only the blocks not recomputed.
"""

from minidp.engine.tensor import Tensor, no_grad, op

__all__ = ["recomputed"]


def recomputed(block, x: Tensor) -> Tensor:
    """block(x), keeping only x: the block runs again in backward (see the module doc)."""
    params = [p for p in block.parameters() if p.requires_grad]
    with no_grad():
        y = block(x)
    keep, needs_grad = x.data, x.requires_grad

    def backward(g):
        x_again = Tensor(keep, requires_grad=needs_grad)
        y_again = block(x_again)
        if y_again.requires_grad:
            y_again.backward(g)  # the parameters' gradients, here
        return (x_again.grad, *[None] * len(params))  # theirs are added already

    # the parameters are parents so that the op is recorded even if x needs no gradient
    return op(y.data, (x, *params), backward)
