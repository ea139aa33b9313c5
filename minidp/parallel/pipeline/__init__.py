"""Pipeline parallelism: a model cut into stages across ranks, micro-batches flowing
through them (GPipe, 1F1B, interleaved 1F1B, zero bubble).

Read in this order: communications.py (activations forward and gradients back, as autograd
ops), split.py (a user's GPT or MLP cut into parts), recompute.py (a block run again in
backward instead of keeping its activations), backward_split.py (backward as B and W),
stage.py (`PipelineStage`: the actions a schedule calls).
"""
