"""Pruning a model's weights, without MPI: magnitude.py (the masks, global or per layer, the
cubic schedule, MagnitudePruner) and functions.py (torch.nn.utils.prune's names on your own
model). Data parallelism's side, reducing only the kept gradients: minidp/parallel/pruning.py.
Models that are really smaller: structured.py (whole heads and MLP channels scored, masked
or sliced away) and low_rank.py (a Linear as two thin ones from a truncated SVD); their
data-parallel sides: minidp/parallel/structured_pruning.py, low_rank.py.
"""
