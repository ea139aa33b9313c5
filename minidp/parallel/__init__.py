"""The pieces a user wraps around their own model, one folder per scheme, each talking to
other ranks only through minidp.comm and taking plain arguments (never the command line's).

    data_parallel/     plain.py (one allreduce per parameter) -> ddp.py (buckets, overlap)
                       -> its speed tricks beside it: shm_arena, coalesce, gil, host_stage
    zero/              plain.py (stage 3, one layer whole at a time) -> optimizer.py (stage 1,
                       ZeroRedundancyOptimizer) -> flat.py -> grads.py
                       -> stage3.py -> sharded.py -> fsdp.py (stages 2 and 3 as a piece)
    tensor_parallel/   communications.py (Megatron's f and g) -> layers.py -> vocab.py -> gpt.py
                       -> mesh_gpt.py (MeshGPT: a GPT on a mesh's TP and CP axes, EP inside)
    param_server/      messages.py -> server.py -> pieces.py (the worker and the server loop)
    pipeline/          plain.py (GPipe, one stage per rank, blocking messages) -> schedules
                       as checked data (actions, schedules, lowering, validate,
                       dry_run, simulate, diagram) -> the stage (communications, split,
                       recompute, backward_split, stage.py: PipelineStage) -> executor.py
                       -> mesh_stages.py (MeshStages: a GPT's stages on a mesh, TP and CP)
    compression/       base.py (error feedback) -> cast, sparse, quant, lowrank -> table.py;
                       update.py and velocity.py (the optimizer-side placements)
    pruning.py         the DDP hook that reduces only the kept gradients
                       (the masks: minidp.models.prune)
    checkpoint/        tree.py (a state as arrays and JSON, no pickle) -> shards.py -> store.py
                       (save, load, latest; the manifest last; manifest.py: replicated state
                       written once) -> reshard.py (another layout)
    context_parallel/  layout.py (contiguous, zig-zag) -> online_softmax.py -> ring.py (ring
                       attention) and ulysses.py (all-to-all to heads) -> gpt.py
                       (ContextParallel: a GPT with its sequence split over a group), stages.py
    experts/           communications.py (the all-to-all op) -> groups.py (EP inside DP)
                       -> dispatch.py -> plain.py (ExpertParallel; the MoE layer: models/moe/)
    mesh.py            the rank grid and one group per axis; across_ranks.py, same_model.py

The `--strategy` recipes that assemble these pieces from flags live in minidp.cli.strategies.
"""

from minidp.parallel.amp import GradScaler
from minidp.parallel.compression.table import (
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
from minidp.parallel.compression.update import CompressedUpdate, LocalGradients
from minidp.parallel.compression.velocity import MomentumCorrectedSGD, MomentumCorrection
from minidp.parallel.context_parallel import (
    ContextParallel,
    ContextParallelAttention,
    RingWork,
    SequenceLayout,
    ring_attention,
    ring_bytes,
    ulysses_attention,
    ulysses_bytes,
)
from minidp.parallel.data_parallel.ddp import DistributedDataParallel
from minidp.parallel.data_parallel.plain import SimpleDistributedDataParallel
from minidp.parallel.experts import ExpertParallel, expert_groups
from minidp.parallel.mesh import Mesh
from minidp.parallel.param_server.pieces import ParameterServerWorker, serve
from minidp.parallel.pipeline.executor import run_schedule, split_batch
from minidp.parallel.pipeline.plain import SimpleGPipe
from minidp.parallel.pipeline.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubbleH1,
    build_schedule,
)
from minidp.parallel.pipeline.split import split_model
from minidp.parallel.pipeline.stage import PipelineStage
from minidp.parallel.pruning import masked_allreduce_hook
from minidp.parallel.same_model import ModelMismatch
from minidp.parallel.tensor_parallel.gpt import TensorParallelGPT
from minidp.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
)
from minidp.parallel.tensor_parallel.vocab import (
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from minidp.parallel.zero.fsdp import FullyShardedDataParallel
from minidp.parallel.zero.optimizer import ZeroRedundancyOptimizer
from minidp.parallel.zero.plain import SimpleZeRO3

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "ColumnParallelLinear",
    "CompressedUpdate",
    "Compressor",
    "ContextParallel",
    "ContextParallelAttention",
    "DistributedDataParallel",
    "ExpertParallel",
    "FullyShardedDataParallel",
    "GradScaler",
    "LocalGradients",
    "Mesh",
    "ModelMismatch",
    "MomentumCorrectedSGD",
    "MomentumCorrection",
    "ParallelAttention",
    "ParallelMLP",
    "ParameterServerWorker",
    "PipelineStage",
    "PowerSGD",
    "RandomK",
    "RingWork",
    "RowParallelLinear",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleZeroBubbleH1",
    "SequenceLayout",
    "Sign",
    "SignNoEF",
    "SimpleDistributedDataParallel",
    "SimpleGPipe",
    "SimpleZeRO3",
    "TensorParallelGPT",
    "TopK",
    "VocabParallelEmbedding",
    "ZeroRedundancyOptimizer",
    "build_schedule",
    "expert_groups",
    "masked_allreduce_hook",
    "ring_attention",
    "ring_bytes",
    "run_schedule",
    "serve",
    "split_batch",
    "split_model",
    "ulysses_attention",
    "ulysses_bytes",
    "vocab_parallel_cross_entropy",
]
