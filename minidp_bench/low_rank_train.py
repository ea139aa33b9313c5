"""A low-rank run: the training loop's steps for the dp recipe, the model factorized at
step steps/3 (parallel/low_rank.py's LowRankFactorization). No flag sets it (the command
line's face is at its cap), so `bench prune --structured --low-rank R` (_prune_structured.py)
and tests/test_low_rank.py call it here; not a benchmark of its own (HELPERS).

    mpiexec -n 4 python -m minidp bench prune --structured --low-rank 16,32

    final = low_rank_run(TrainConfig(steps=60), 16, comm.world())   # val_loss, parameters
"""

import numpy as np

from minidp import comm
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.engine.optim import warmup_cosine
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.parallel.low_rank import LowRankFactorization


def low_rank_run(config: TrainConfig, rank: int, group: comm.Group) -> dict:
    """training/loop.py's steps for the dp recipe (lr schedule, sampler, step), the model
    factorized to `rank` at step steps/3, in float32: the validation loss and the record
    (parameters before and after, the step it was factorized at)."""
    config = config.resolved()
    strategy = DataParallel(Task(config, np.float32), config, group)
    strategy.structured = LowRankFactorization(strategy.model, rank, config.steps // 3, group)
    sampler = DistributedSampler(
        strategy.task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
    )
    for step in range(config.steps):
        lr = warmup_cosine(step, config.lr, config.warmup, config.steps, config.min_lr_ratio)
        strategy.step(sampler.local_indices(step), lr)
    strategy.close()
    return {"val_loss": strategy.task.validation_loss(), **strategy.record()}
