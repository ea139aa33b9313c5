"""Context parallelism: the sequence axis cut over the ranks of a group.

Read in this order:

    layout.py          which positions each rank holds: contiguous, or zig-zag (2C chunks,
                       rank i holding i and 2C-1-i) for an even causal workload
    online_softmax.py  attention one key block at a time: the running max and log-sum-exp
                       merge, and the block's backward from the log-sum-exp
    ring.py            ring attention: K/V blocks round the ring by isend/irecv, overlapped
                       with the block's compute; backward sends dK/dV round with them
    ulysses.py         DeepSpeed-Ulysses: all-to-all to a head split, plain attention on the
                       whole sequence, all-to-all back
    gpt.py             ContextParallel: a GPT with its sequence split over the group (its
                       positions embedded, its attention swapped, the loss and gradients
                       summed over the group)
    stages.py          StagesOverCP: the same changes on a pipeline's stages (the first's
                       embed, the last's loss), for MeshStages on a mesh with cp > 1
"""

from minidp.parallel.context_parallel.gpt import ContextParallel, ContextParallelAttention
from minidp.parallel.context_parallel.layout import SequenceLayout
from minidp.parallel.context_parallel.ring import RingWork, ring_attention, ring_bytes
from minidp.parallel.context_parallel.stages import StagesOverCP
from minidp.parallel.context_parallel.ulysses import ulysses_attention, ulysses_bytes

__all__ = [
    "ContextParallel",
    "ContextParallelAttention",
    "SequenceLayout",
    "StagesOverCP",
    "RingWork",
    "ring_attention",
    "ring_bytes",
    "ulysses_attention",
    "ulysses_bytes",
]
