"""The torch backend and the PyTorch reference at 2 ranks (issue 13): minidp's DP on NumPy,
minidp's DP on torch tensors (buckets staged through host buffers) and PyTorch DDP over gloo
give single-process training's losses over 20 steps (float64: 1e-10 relative; float32:
1e-4), and the torch replicas end identical. One launch checks them all.

It is marked torch: without torch it is skipped at collection, in the parent, so no parallel
child is launched (a child must never skip, and an ImportError there would fail the run).
"""

from dataclasses import replace

import numpy as np
import pytest

from minidp import comm
from minidp.cli.training.config import TrainConfig
from minidp.engine import backend

TINY = dict(
    n_layer=1, n_embd=16, n_head=2, block_size=8, seed=5, batch_size=4, warmup=2, lr=1e-2,
    threads=1, steps=20, bucket_mb=0.01,
)  # fmt: skip


@pytest.mark.torch
@pytest.mark.parallel(nprocs=[2])
def test_dp_on_numpy_on_torch_and_pytorch_ddp_match_one_process():
    from minidp_bench.torch_train import minidp_losses, train_reference

    world = comm.world()
    for dtype, rtol in (("float64", 1e-10), ("float32", 1e-4)):
        config = TrainConfig(dtype=dtype, **TINY)
        alone, _ = minidp_losses(config, world.split(world.rank))  # one process: the reference
        numpy_dp, _ = minidp_losses(config, world)
        # on torch: overlap (buckets staged from the communication thread), 2 micro-batches
        on_torch = replace(config, backend="torch", overlap="on", grad_accum=2)
        torch_dp, run = minidp_losses(on_torch, world)
        assert len(run.strategy.ddp.buckets) > 1
        assert run.strategy.max_param_diff() == 0.0  # replicas bitwise identical on torch too
        assert run.strategy.ddp.tricks["host_stage"] is False  # CPU tensors: the plain way
        ddp, _ = train_reference(config, world)
        backend.use("numpy")
        np.testing.assert_allclose(numpy_dp, alone, rtol=rtol)
        np.testing.assert_allclose(torch_dp, alone, rtol=rtol)
        np.testing.assert_allclose(ddp, alone, rtol=rtol)
