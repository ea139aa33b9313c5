"""The engine's speed tricks, apart from the engine: each computes what the plain path does
(bit for bit, or within the reassociation its module states) and plugs in through the
engine's table (minidp/engine/registry.py), filled in here when minidp is imported.

    fused.py            LayerNorm (alone, or with the Linear after it), a Linear with the
                        residual add, GELU and the embedding's backward, one op each
    fused_attention.py  causal self-attention as one op
    weight_grads.py     deferred weight gradients (gradient accumulation's products stacked)
    allocator.py        the C allocator kept from returning a step's memory (the CLI sets it)

`python -m minidp bench fused`, `bench deferral` and `bench memory` say what each buys;
tests/test_fast_table.py checks every entry of the table against the plain path.
"""

from minidp.engine.registry import FAST
from minidp.fast import fused, fused_attention, weight_grads

FAST.update(
    row_sums=fused.row_sums,
    weight_gradient=weight_grads.weight_gradient,
    layer_norm=fused.layer_norm,
    embedding=fused.embedding,
    gelu=fused.gelu,
    layer_norm_linear=fused.layer_norm_linear,
    linear_residual=fused.linear_residual,
    attention=fused_attention.causal_self_attention,
)
