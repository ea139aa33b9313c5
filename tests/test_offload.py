"""Offload (parallel/zero/offload.py): the optimizer's state in a memory-mapped file changes
no bit of training, survives a state_dict round trip, and is reported as offloaded."""

import os
from dataclasses import replace

import numpy as np
import pytest

from minidp import comm, nn, optim
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.parallel.zero.offload import Offload


def weights(dtype=np.float32):
    rng = np.random.default_rng(0)
    return [nn.Parameter(rng.normal(size=s).astype(dtype)) for s in ((7, 5), (5,), (300, 40))]


def steps(params, opt, n=3):
    for k in range(n):
        for p in params:
            p.grad = np.cos(p.data.astype(np.float32) * (k + 1)).astype(p.dtype)
        opt.step()
    return [p.data.copy() for p in params]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offloaded_state_steps_bit_for_bit_and_lives_in_the_file(dtype):
    from minidp.engine.precision import named_dtype

    dtype = named_dtype(dtype)
    plain = steps(ps := weights(dtype), optim.AdamW(ps, lr=1e-2))
    params = weights(dtype)
    opt = optim.AdamW(params, lr=1e-2)
    offload = Offload(opt)
    try:
        got = steps(params, opt)
        for a, b in zip(plain, got, strict=True):
            np.testing.assert_array_equal(a, b)
        for state in opt.state:  # every array a view of the one file
            for key, a in state.items():
                if np.ndim(a):
                    assert np.shares_memory(a, offload.file), key
        saved = opt.state_dict()
        opt.load_state_dict(saved)  # loaded arrays go back into the file
        assert all(np.shares_memory(s["m"], offload.file) for s in opt.state)
        np.testing.assert_array_equal(opt.state[2]["v"], saved["state"][2]["v"])
        path = offload.path
    finally:
        offload.close()
    assert not os.path.exists(path) and opt.after_update is None


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_zero_3_offloaded_trains_the_same_bits_and_reports_the_bytes_offloaded():
    config = TrainConfig(
        strategy="zero", zero_stage=3, steps=3, eval_batches=1, sample_tokens=0,
        log_every=100, precision="bf16",
    )  # fmt: skip
    plain, offloaded = (train(replace(config, offload=o), comm.world()) for o in (False, True))
    for key in ("final_loss", "val_loss", "param_l2"):
        assert plain[key] == offloaded[key], key
    memory, before = offloaded["memory_bytes"], plain["memory_bytes"]
    assert memory["optimizer"] == 0 and memory["offloaded"] >= before["optimizer"]
