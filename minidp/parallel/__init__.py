"""Parallel training strategies, each wrapping a model and talking only through minidp.comm.

`STRATEGIES` maps each `--strategy` name to the class the training loop drives; every class
follows the protocol in strategy.py. A new scheme is a module here and one line in the table.
"""

from minidp.parallel.data_parallel import DistributedDataParallel, ModelMismatch
from minidp.parallel.dp_strategy import DataParallel
from minidp.parallel.param_server import ParameterServer
from minidp.parallel.strategy import StepResult, Strategy

STRATEGIES: dict[str, type[Strategy]] = {
    DataParallel.name: DataParallel,
    ParameterServer.name: ParameterServer,
}

__all__ = [
    "STRATEGIES",
    "DataParallel",
    "DistributedDataParallel",
    "ModelMismatch",
    "ParameterServer",
    "StepResult",
    "Strategy",
]
