"""Parallel training strategies, each wrapping a model and talking only through minidp.comm.

The pieces a user wraps around their own model are exported here too: DDP, FSDP, ZeRO's
optimizer, the tensor-parallel layers, and the gradient compressors (compress_base.py), each
a DDP communication hook: `ddp.register_comm_hook(PowerSGD(rank=2))`.

`STRATEGIES` maps each `--strategy` name to the class the training loop drives; every class
follows the protocol in strategy.py, most as a short recipe handed to the one step skeleton
(step.py). A new scheme is a module here and one line in the table.
"""

from minidp.parallel.compress import (
    BF16,
    FP16,
    QSGD,
    Compressor,
    PowerSGD,
    RandomK,
    Sign,
    SignNoEF,
    TopK,
)
from minidp.parallel.data_parallel import DistributedDataParallel, ModelMismatch
from minidp.parallel.ddp_plain import SimpleDistributedDataParallel
from minidp.parallel.dp_strategy import DataParallel
from minidp.parallel.fsdp import FullyShardedDataParallel
from minidp.parallel.mesh import Mesh
from minidp.parallel.param_server import ParameterServer
from minidp.parallel.ps_pieces import ParameterServerWorker, serve
from minidp.parallel.strategy import StepResult, Strategy
from minidp.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
)
from minidp.parallel.tp_gpt import TensorParallelGPT
from minidp.parallel.tp_strategy import Hybrid, TensorParallel
from minidp.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from minidp.parallel.zero import ZeRO
from minidp.parallel.zero_optimizer import ZeroRedundancyOptimizer

STRATEGIES: dict[str, type[Strategy]] = {
    DataParallel.name: DataParallel,
    ParameterServer.name: ParameterServer,
    ZeRO.name: ZeRO,
    TensorParallel.name: TensorParallel,
    Hybrid.name: Hybrid,
}

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "STRATEGIES",
    "ColumnParallelLinear",
    "Compressor",
    "DataParallel",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "Hybrid",
    "Mesh",
    "ModelMismatch",
    "ParallelAttention",
    "ParallelMLP",
    "ParameterServer",
    "ParameterServerWorker",
    "PowerSGD",
    "RandomK",
    "RowParallelLinear",
    "Sign",
    "SignNoEF",
    "SimpleDistributedDataParallel",
    "StepResult",
    "Strategy",
    "TensorParallel",
    "TensorParallelGPT",
    "TopK",
    "VocabParallelEmbedding",
    "ZeRO",
    "ZeroRedundancyOptimizer",
    "serve",
    "vocab_parallel_cross_entropy",
]
