"""Parallel training strategies, each wrapping a model and talking only through minidp.comm.

`STRATEGIES` maps each `--strategy` name to the class the training loop drives; every class
follows the protocol in strategy.py. A new scheme is a module here and one line in the table.
"""

from minidp.parallel.data_parallel import DistributedDataParallel, ModelMismatch
from minidp.parallel.dp_strategy import DataParallel
from minidp.parallel.strategy import StepResult, Strategy
from minidp.parallel.zero import ZeRO

STRATEGIES: dict[str, type[Strategy]] = {
    DataParallel.name: DataParallel,
    ZeRO.name: ZeRO,
}

__all__ = [
    "STRATEGIES",
    "DataParallel",
    "DistributedDataParallel",
    "ModelMismatch",
    "StepResult",
    "Strategy",
    "ZeRO",
]
