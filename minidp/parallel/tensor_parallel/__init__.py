"""Tensor parallelism (Megatron-LM): communications.py (f and g, the sequence-parallel pairs,
as autograd ops), layers.py (column- and row-parallel linears, the parallel MLP and
attention), vocab.py (the vocabulary-parallel embedding and cross-entropy), gpt.py
(TensorParallelGPT: a user's nn.GPT cut for a TP group, a tied head included), replicated.py
(what a TP model does not split: its gradients alike, the norm), plan.py (PyTorch's
parallelize_module with ColwiseParallel and RowwiseParallel on a model you built, and
gather_full).
"""

from minidp.parallel.tensor_parallel.plan import (
    ColwiseParallel,
    RowwiseParallel,
    gather_full,
    parallelize_module,
)

__all__ = ["ColwiseParallel", "RowwiseParallel", "gather_full", "parallelize_module"]
