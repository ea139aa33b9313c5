"""`--compress` on the DP axis of `--strategy hybrid` (a 2 x 2 mesh, one launch at 4): each
TP rank's DP group compresses its own bucket, so what a compressor picks for the replicated
parameters (LayerNorms, biases) can differ by TP rank; after_sync takes TP rank 0's, and
every parameter ends bitwise equal to its replicas."""

from dataclasses import replace

import numpy as np
import pytest
from test_compress_parallel import TINY_GPT
from test_strategy import run as steps  # one step per index: the global losses

from minidp import comm
from minidp.cli.strategies.tp import Hybrid
from minidp.cli.training.config import TrainConfig
from minidp.models.tasks import Task


@pytest.mark.parallel(nprocs=[4])
@pytest.mark.timeout(180)
def test_compressed_hybrid_keeps_replicas_equal():
    base = TrainConfig(**TINY_GPT, strategy="hybrid", dp=2, tp=2)
    for spec in ("topk:0.05", "sign"):
        config = replace(base, compress=spec)
        with Hybrid(Task(config, np.float64), config, comm.world()) as strategy:
            assert np.isfinite(steps(strategy, range(3))).all()
            assert strategy.max_param_diff() == 0.0, spec
            assert strategy.record()["compression_ratio"] > 5, spec
