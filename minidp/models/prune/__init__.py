"""Pruning a model's weights, without MPI: magnitude.py (the masks, global or per layer, the
cubic schedule, MagnitudePruner) and functions.py (torch.nn.utils.prune's names on your own
model). Data parallelism's side, reducing only the kept gradients: minidp/parallel/pruning.py.
"""
