"""minidp: distributed training from scratch, in NumPy and mpi4py, small enough to read."""

__version__ = "0.1.0"
