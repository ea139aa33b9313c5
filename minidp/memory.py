"""Counting memory from the arrays themselves: what a rank holds, by category.

Every strategy reports `memory_bytes()` in the same categories, so schemes can be compared
rank by rank (ZeRO's point is that some of these shrink with the number of ranks):

    parameters        the model's weights this rank holds
    gradients         their gradients (data parallelism: the flat buckets)
    optimizer         the optimizer's state (Adam: two moments per parameter)
    activations_peak  what the graph of one micro-batch's forward keeps for backward
    buffers           communication scratch space (the groups' reusable buffers)

Counted from `ndarray.nbytes` (a torch tensor's `.nbytes` alike), never estimated from shapes
and dtypes by hand. One caveat, said once: `activation_bytes` counts the output array of every
op in the graph; arrays that an op's backward closure keeps besides its output (a dropout
mask, a softmax) are not seen, so it is a lower bound on what backward holds. Nor are the
rows a weight keeps during gradient accumulation (autograd.defer_weight_grads): at most
its gradient's size per weight, from the first micro-batch to the last.
"""

from minidp.backend import base_of

CATEGORIES = ("parameters", "gradients", "optimizer", "activations_peak", "buffers")


def nbytes(arrays) -> int:
    """Bytes of the distinct arrays among `arrays` (None skipped; a view counts its base once)."""
    seen: dict[int, int] = {}
    for a in arrays:
        if a is None:
            continue
        base = base_of(a)  # NumPy's .base, torch's ._base
        seen[id(base)] = base.nbytes
    return sum(seen.values())


def optimizer_bytes(optimizer) -> int:
    """Bytes of an optimizer's per-parameter state (minidp.optim keeps it in `.state`)."""
    return nbytes(v for state in optimizer.state for v in state.values())


def activation_bytes(loss) -> int:
    """Bytes of the op outputs in the graph behind `loss` (leaves, such as parameters and
    inputs, are not activations): what one forward keeps alive until its backward. An output
    that is a view (a reshape, a transpose, an identity op) shares its base's bytes, counted
    once."""
    outputs, leaves, seen, stack = [], set(), set(), [loss]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node._parents:  # an op's output, not a leaf
            outputs.append(node.data)
            stack.extend(node._parents)
        else:
            leaves.add(id(base_of(node.data)))
    return nbytes(a for a in outputs if id(base_of(a)) not in leaves)
