"""Tensor parallelism (Megatron-LM): communications.py (f and g, the sequence-parallel pairs,
as autograd ops), layers.py (column- and row-parallel linears, the parallel MLP and
attention), vocab.py (the vocabulary-parallel embedding and cross-entropy), gpt.py
(TensorParallelGPT: a user's nn.GPT cut for a TP group, a tied head included).
"""
