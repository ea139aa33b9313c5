"""The engine, plain: Tensor with its ops and backward (tensor.py), grad mode, the functional
ops, layers (nn.py), optimizers (optim.py), the NumPy/torch array switch (backend.py), and
the table through which the speed tricks of minidp/fast/ plug in (registry.py). No MPI here,
and no speed tricks: a reader meets every op as written, micrograd's way, on arrays.

Read in this order: tensor.py -> functional.py -> nn.py -> optim.py.
"""
