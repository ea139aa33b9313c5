"""Mixed precision on the torch backend (engine/casts.py, backend_torch's host views): bf16
and fp16 training on torch tensors against the same run on NumPy, the dtypes each piece
holds, the loss scaler skipping a step on inf, bfloat16 reaching MPI as its own 16-bit
words, and a 2-rank command-line run in bf16 that ends near fp32.

Why the torch run is close to NumPy's and not equal: on NumPy a product of float32
activations and a 16-bit weight runs in float32 (NumPy's promotion); on torch it runs in the
16-bit dtype (torch.autocast's rule: the activations rounded to 16 bits first). The losses
differ by a fraction of one rounding of that format, its unit roundoff u: 2^-8 for
bfloat16 (7 stored bits), 2^-11 for float16 (10). The tolerance is u; measured 2026-12-06
over 20 steps, the largest relative difference was 6.4e-4 (bf16) and 2.4e-5 (fp16).
"""

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from test_torch_backend import numpy_afterwards, one_rank  # noqa: F401  (the fixture: autouse)

from minidp import comm, functional, nn, optim
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.engine import backend
from minidp.parallel import amp

try:
    import torch
except Exception:  # the tests marked torch skip at collection (conftest.py)
    torch = None

TINY = dict(
    n_layer=1, n_embd=16, n_head=2, block_size=8, seed=3, batch_size=4, warmup=2, lr=1e-2,
    threads=1,
)  # fmt: skip
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def tiny_gpt_on_torch(precision: str):
    backend.use("torch")
    cfg = nn.GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = amp.to_half(nn.GPT(cfg, seed=0), precision)
    backend.move_model(model)
    return model


IDX = np.random.default_rng(1).integers(0, 17, size=(4, 8))


def loss_of(model):
    logits = model(IDX)
    return nn.cross_entropy(logits.reshape(-1, 17), IDX.reshape(-1))


@pytest.mark.torch
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_torch_trains_as_numpy_does_within_one_rounding(precision):
    from minidp_bench.torch_train import minidp_losses

    config = TrainConfig(precision=precision, steps=20, **TINY)
    on_numpy, _ = minidp_losses(config, one_rank())
    on_torch, run = minidp_losses(replace(config, backend="torch"), one_rank())
    assert on_torch[-1] < on_torch[0]  # it trains
    np.testing.assert_allclose(on_torch, on_numpy, rtol=UNIT_ROUNDOFF[precision])


@pytest.mark.torch
def test_the_dtypes_on_torch_weights_products_and_the_float32_rest():
    model = tiny_gpt_on_torch("bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    block = model.blocks[0]
    x = model.embed(IDX)  # the table widened: float32 rows, the residual stream float32
    assert x.dtype == torch.float32
    assert block.ln1(x).dtype == torch.float32  # LayerNorm in float32
    assert block.attn.qkv(block.ln1(x)).dtype == torch.bfloat16  # products in 16 bits
    assert functional.softmax(block.attn.qkv(x)).dtype == torch.float32  # softmax in float32
    assert block(x).dtype == torch.float32  # residual + 16-bit branch: float32
    loss = loss_of(model)
    assert loss.dtype == torch.float32  # the loss in float32
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    loss.backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}  # 16-bit gradients
    opt.step()
    for p, state in zip(model.parameters(), opt.state):
        assert state["master"].dtype == state["m"].dtype == state["v"].dtype == torch.float32
        assert torch.equal(p.data, state["master"].to(torch.bfloat16))  # rounded back


@pytest.mark.torch
def test_the_scaler_skips_a_step_whose_fp16_gradients_overflow_on_torch():
    model = tiny_gpt_on_torch("fp16")
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.data.clone() for p in model.parameters()]
    scaler = amp.GradScaler(init_scale=2.0**40)  # the gradients times 2^40: inf in float16
    scaler.scale(loss_of(model)).backward()
    assert scaler.unscale_(opt) and not scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**39 and scaler.skipped == 1
    assert all(torch.equal(p.data, was) for p, was in zip(model.parameters(), before))
    opt.zero_grad()
    scaler = amp.GradScaler(init_scale=2.0**8)  # in range: the step runs
    scaler.scale(loss_of(model)).backward()
    assert not scaler.unscale_(opt) and scaler.step(opt)
    assert not all(torch.equal(p.data, was) for p, was in zip(model.parameters(), before))


@pytest.mark.torch
def test_bfloat16_reaches_mpi_as_its_own_16_bit_words():
    import ml_dtypes

    from minidp.engine import backend_torch

    t = torch.tensor([1.0, -2.5, 3.140625, 1e-30], dtype=torch.bfloat16)
    host = backend_torch.host_view(t)
    assert host.dtype == ml_dtypes.bfloat16 and host.__array_interface__["data"][0] == t.data_ptr()
    np.testing.assert_array_equal(host.view(np.int16), t.view(torch.int16).numpy())
    back = backend_torch.from_host(host)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr()
    total = comm.allreduce(host.copy(), group=one_rank())  # a collective takes it as it is
    assert total.dtype == ml_dtypes.bfloat16


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_two_ranks_on_torch_in_bf16_end_near_fp32(tmp_path):
    """The command line at 2 ranks, on torch in bf16, against fp32 on NumPy in this process
    (the same data whatever the layout); every replica identical, gradients sent in 16 bits."""
    steps, flags = 30, dict(TINY, eval_batches=2, sample_tokens=0, log_every=100)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    out = tmp_path / "bf16.json"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "minidp", "--backend", "torch"]
    cmd += ["--precision", "bf16", "--steps", str(steps), "--json", str(out), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    job = subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=env)
    assert job.returncode == 0, job.stderr
    final = json.loads(out.read_text().splitlines()[-1])
    fp32 = train(TrainConfig(steps=steps, **flags), one_rank())
    assert final["max_param_diff"] == 0.0 and final["world_size"] == 2
    assert abs(final["val_loss"] / fp32["val_loss"] - 1) < 0.02, (final["val_loss"], fp32)
    params = final["memory_bytes"]["parameters"] // 2  # 2 bytes each
    assert final["memory_bytes"]["gradients"] == 2 * params
    # a 2-rank ring sends each rank's whole gradient once a step: 2 bytes a parameter (and
    # the loss's scalars); widened to float32 it would be 4
    assert 2 * params * steps <= final["bytes_sent_by_axis"]["dp"] < 2.5 * params * steps


@pytest.mark.torch
def test_precision_runs_on_torch_and_what_does_not_is_one_line():
    from minidp.cli.training.config import BadConfig
    from minidp.parallel.zero.offload import Offload

    TrainConfig(precision="bf16", backend="torch", steps=1).validate()  # refused no more
    with pytest.raises(BadConfig, match="--strategy zero does not run on --backend torch"):
        TrainConfig(precision="bf16", backend="torch", strategy="zero", steps=1).validate()
    model = tiny_gpt_on_torch("bf16")
    with pytest.raises(TypeError, match="offload runs on the NumPy backend only"):
        Offload(optim.AdamW(model.parameters(), lr=1e-2))
