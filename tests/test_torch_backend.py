"""The torch backend and the PyTorch reference (issue 13), serial: with the same weights and
data, minidp on NumPy, minidp on torch tensors and plain PyTorch give the same losses over
20 steps (float64: 1e-10 relative; float32: 1e-4); the shim's ops match NumPy's, gradients
included; staging copies are counted; a missing torch or GPU is one line, exit code 2.

No GPU is needed: the CUDA path differs from `--device cpu` only in the device the tensors
and host buffers live on (pinned memory), so these run it with --device cpu.
"""

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from minidp import Tensor, comm, functional
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.comm.trace import Timeline
from minidp.engine import backend

try:
    import torch
except Exception:  # the tests marked torch skip at collection (conftest.py)
    torch = None

TINY = dict(
    n_layer=1, n_embd=16, n_head=2, block_size=8, hidden=16, seed=3, batch_size=4,
    warmup=2, lr=1e-2, threads=1,
)  # fmt: skip
STEPS = 20


@pytest.fixture(autouse=True)
def numpy_afterwards():
    """Each test leaves the process on the NumPy backend, as it found it."""
    yield
    backend.use("numpy")


def one_rank():
    world = comm.world()
    return world.split(world.rank)


@pytest.mark.torch
@pytest.mark.parametrize(
    ("model", "dtype", "rtol"), [("gpt", "float64", 1e-10), ("mlp", "float32", 1e-4)]
)
def test_numpy_torch_and_pytorch_give_the_same_losses(model, dtype, rtol):
    from minidp.models.torch_ref import minidp_state
    from minidp_bench.torch_train import minidp_losses, train_reference

    config = TrainConfig(model=model, dtype=dtype, steps=STEPS, **TINY)
    group = one_rank()
    numpy_losses, numpy_run = minidp_losses(config, group)
    torch_losses, torch_run = minidp_losses(replace(config, backend="torch"), group)
    reference_losses, net = train_reference(config)
    assert numpy_losses[-1] < numpy_losses[0]  # it trains
    np.testing.assert_allclose(torch_losses, numpy_losses, rtol=rtol)
    np.testing.assert_allclose(reference_losses, numpy_losses, rtol=rtol)
    # and the final parameters (the torch backend's come back as NumPy in state_dict)
    want = numpy_run.task.model.state_dict()
    for name, value in torch_run.task.model.state_dict().items():
        np.testing.assert_allclose(value, want[name], rtol=100 * rtol, atol=100 * rtol)
    for name, value in minidp_state(net).items():
        np.testing.assert_allclose(value, want[name], rtol=100 * rtol, atol=100 * rtol)


@pytest.mark.torch
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize(("dtype", "rtol"), [("float64", 1e-10), ("float32", 1e-4)])
def test_the_same_losses_on_cuda(dtype, rtol):
    """The GPU check: minidp on CUDA tensors and PyTorch on CUDA against minidp on NumPy."""
    from minidp_bench.torch_train import minidp_losses, train_reference

    config = TrainConfig(model="gpt", dtype=dtype, steps=STEPS, **TINY)
    group = one_rank()
    numpy_losses, _ = minidp_losses(config, group)
    cuda = replace(config, backend="torch", device="cuda")
    cuda_losses, run = minidp_losses(cuda, group)
    assert run.task.model.parameters()[0].data.device.type == "cuda"
    np.testing.assert_allclose(cuda_losses, numpy_losses, rtol=rtol)
    np.testing.assert_allclose(train_reference(config, device="cuda")[0], numpy_losses, rtol=rtol)


def _graph(xp_array):
    """Many of the engine's ops on one input, reduced to a scalar: a loss to backpropagate."""
    x = Tensor(xp_array, requires_grad=True)
    y = (x.transpose(1, 0, 2) * 2.0 - 1.0).sigmoid() + x.max(axis=1, keepdims=True) ** 2
    y = functional.concatenate([y, x[np.array([0, 0, 1])]], axis=0)  # a repeated fancy index
    parts = functional.split(y, [1, 3], axis=2)
    z = functional.stack([parts[0], parts[2][..., :1]], axis=0).sum(axis=(0, 3))
    w = functional.where(z.data > 0.5, z, z * 0.5).log_softmax(axis=-1).mean()
    m = x.masked_fill(np.array([True, False, True, False]), 0.0).tanh().gelu().exp().log()
    loss = w + (m + 1.0).sqrt().mean() + functional.cross_entropy(x[0], np.array([1, 0, 3]))
    loss = loss + (x.max(axis=2) * x[:, :, 0]).sum() * 0.1  # no keepdims this time
    loss.backward()
    return loss.item(), x.grad


@pytest.mark.torch
def test_the_torch_shim_computes_what_numpy_does_gradients_included():
    rng = np.random.default_rng(0)
    a = rng.random((3, 3, 4)) + 0.1
    want_loss, want_grad = _graph(a)
    backend.use("torch")
    loss, grad = _graph(torch.from_numpy(a.copy()))
    assert isinstance(grad, torch.Tensor) and not grad.requires_grad  # torch autograd: off
    np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.torch
def test_staging_copies_are_counted_and_drawn(monkeypatch):
    from minidp.parallel.data_parallel import ddp as data_parallel
    from minidp_bench.torch_train import MinidpRun

    monkeypatch.setitem(data_parallel.TRICKS, "host_stage", True)  # CUDA's way, on the CPU

    config = TrainConfig(model="mlp", steps=2, backend="torch", **TINY)
    timeline = Timeline(enabled=True)
    run = MinidpRun(config, one_rank(), timeline)
    run.step(0)
    run.step(1)
    record = run.strategy.record()
    run.close()
    params, buckets = run.task.model.parameters(), run.strategy.ddp.buckets
    # the first broadcast (to and from the host, per parameter), then every bucket twice a step
    assert record["stage_copies"] == 2 * len(params) + 2 * 2 * len(buckets)
    names = [e["name"] for e in timeline.events]
    assert names.count("stage to host bucket 0") == 2 and "stage to device bucket 0" in names


@pytest.mark.torch
def test_a_missing_torch_or_gpu_is_one_line(monkeypatch):
    if not torch.cuda.is_available():
        with pytest.raises(BadConfig, match="--device cuda: no CUDA device"):
            TrainConfig(backend="torch", device="cuda").validate()
    with pytest.raises(BadConfig, match="--strategy zero does not run on --backend torch"):
        TrainConfig(backend="torch", strategy="zero", zero_stage=1).validate()
    with pytest.raises(BadConfig, match="--prune does not run on --backend torch"):
        TrainConfig(backend="torch", prune=0.5, steps=300).validate()
    with pytest.raises(BadConfig, match="--device cuda needs --backend torch"):
        TrainConfig(device="cuda").validate()
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(BadConfig, match="torch is not installed; a CPU build: pip install torch"):
        TrainConfig(backend="torch").validate()


def test_the_command_line_says_it_in_one_line_and_exits_2(tmp_path):
    """With torch unimportable (a stand-in package that raises), the CLI refuses cleanly."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no torch here')\n")
    import os

    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-m", "minidp", "--backend", "torch", "--steps", "1"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install torch" in lines[0], out.stderr


@pytest.mark.torch
def test_bench_compare_smoke(tmp_path, capsys):
    import json

    from minidp_bench import compare

    out = tmp_path / "rows.jsonl"
    tiny = "--n-embd 16 --n-layer 1 --n-head 2 --block-size 8 --batch-size 4 --iters 1"
    argv = [*tiny.split(), "--warmup", "0", "--device", "cpu", "--json", str(out)]
    assert compare.main([*argv, "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["contender"] for r in rows] == [*compare.SINGLE, *compare.PARALLEL]
    assert all(r["ms_per_step"] > 0 for r in rows) and rows[0]["vs_minidp"] == 1.0
    assert rows[4]["stage_ms"] == 0  # CPU tensors: buckets handed to MPI as views, no staging
    assert "pytorch DDP" in capsys.readouterr().out
