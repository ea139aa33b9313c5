"""Parallel training strategies, each wrapping a model and talking only through minidp.comm."""

from minidp.parallel.data_parallel import DistributedDataParallel, ModelMismatch

__all__ = ["DistributedDataParallel", "ModelMismatch"]
