"""The engine, plain: Tensor and backward (tensor.py) with its ops (tensor_ops.py), grad mode,
the functional ops, layers (nn.py), optimizers (optim.py), the NumPy/torch array switch
(backend.py). No MPI here, and no speed tricks: a reader meets every op as written,
micrograd's way, on arrays. The speed tricks of minidp/fast/ plug in through one table,
registry.py, which the engine consults and never fills.

Read in this order: tensor.py -> tensor_ops.py -> functional.py -> nn.py -> optim.py.
"""
