"""The cost model on a model the user built: `model_shapes` (tied and frozen parameters, the
model's own, FSDP's units) and `cost.compute.measure`, checked against minidp's GPT, whose
shapes gpt_shapes writes by hand, and against the bytes DDP and FSDP send on such a model.
"""

import numpy as np
import pytest
from test_fsdp import Net, mlp_batch

from minidp import Tensor, comm, cost, cross_entropy, nn, optim
from minidp.cost.calls import LOSS, NORM, data_parallel, gpt_shapes, model_shapes
from minidp.cost.compute import measure
from minidp.cost.step import Layout, Network, predict
from minidp.parallel import DistributedDataParallel, FullyShardedDataParallel
from minidp.tools.chunks import chunk_range


def test_a_gpt_built_is_shaped_as_its_configuration_says():
    config = nn.GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)
    built, written = model_shapes(nn.GPT(config)), gpt_shapes(2, 32, 50, 16)
    assert (built.params, built.units, built.dims) == (written.params, written.units, written.dims)


def test_a_users_model_counts_a_tied_weight_once_and_no_frozen_one():
    """Net: fc3 reuses fc2's weight (81), fc2's bias is frozen; `scale` (4) and `unused` (7)
    are the model's own. Units as FSDP makes them: the model's own first (scale, unused,
    the tied weight), then fc1, fc3 (its bias), fc4."""
    shapes = model_shapes(Net())
    assert sum(shapes.params) == 204 and len(shapes.params) == 8
    assert shapes.units == [4 + 7 + 81, 6 * 9 + 9, 9, 9 * 4 + 4]
    assert (9, 9) in shapes.dims and (9,) in shapes.dims and len(shapes.dims) == 8
    assert shapes.frozen == 9  # fc2's bias: on every rank, whole, under any scheme


def test_measure_times_a_step_and_leaves_the_model_as_it_was():
    model = Net()
    before = [p.data.copy() for p in model.parameters()]
    trainable = [p for p in model.parameters() if p.requires_grad]
    x, y = mlp_batch(0)
    batches = [(Tensor(x[:5]), y[:5]), (Tensor(x[5:]), y[5:])]
    opt = optim.AdamW(trainable, lr=0.1)
    compute = measure(trainable, lambda a, b: cross_entropy(model(a), b), batches, opt, clip=1.0)
    assert compute.examples == len(x) and compute.params == 204
    assert min(compute.forward_s, compute.backward_s, compute.optimizer_s) > 0
    assert all(np.array_equal(p.data, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    step = predict(
        Layout("zero", dp=4, zero_stage=3), model_shapes(model), compute,
        Network(2e-6, 1e-10, 1e-10), batch_size=len(x), itemsize=8,
    )  # fmt: skip
    units = model_shapes(model).units
    chunks = sum(chunk_range(u, 4, 0)[1] - chunk_range(u, 4, 0)[0] for u in units)
    assert step.memory_bytes["parameters"] == 8 * (chunks + 9)  # + the frozen bias, whole


def sent_by_collective(calls, p: int, rank: int) -> dict:
    """{collective: bytes} this rank sends for `calls` (cost.sent, exact)."""
    total: dict = {}
    for c in calls:
        sent = cost.sent(c.collective, c.algo, p, rank, c.n, c.itemsize).bytes
        total[c.collective] = total.get(c.collective, 0) + sent
    return total


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(120)
def test_ddp_and_fsdp_on_a_users_model_send_the_bytes_the_model_predicts():
    """One step of DDP (ring) and of FSDP (full: ZeRO stage 3) around Net, a tied weight and
    a frozen bias in it: the bytes each collective sent on this rank are those of the step
    model's calls from model_shapes, the loop's own loss and clip left out."""
    group = comm.world()
    p, r = group.size, group.rank
    x, y = mlp_batch(0)
    lo, hi = chunk_range(len(x), p, r)
    shapes = model_shapes(Net())
    ddp = DistributedDataParallel(Net(), group.dup(), bucket_cap_mb=0.0005, algo="ring")
    cross_entropy(ddp(Tensor(x[lo:hi])), y[lo:hi]).backward()
    ddp.finish_gradient_sync()
    layout = Layout("dp", dp=p, algo="ring", bucket_mb=0.0005, shm=False)
    calls = [c for c in data_parallel(layout, shapes, 8) if c is not LOSS]
    groups = (ddp.comm_group, ddp.group)  # the buckets; the reached flags' max-allreduce
    counted = sum(g.counters["allreduce"]["bytes_sent"] for g in groups)
    assert {"allreduce": counted} == sent_by_collective(calls, p, r)

    with FullyShardedDataParallel(Net(), group.dup(), "full", algo="ring") as fsdp:
        fsdp.set_batch_share(hi - lo, len(x))
        cross_entropy(fsdp(Tensor(x[lo:hi])), y[lo:hi]).backward()
        fsdp.finish_gradient_sync()
        layout = Layout("zero", dp=p, zero_stage=3, algo="ring")
        calls = [c for c in data_parallel(layout, shapes, 8) if c not in (LOSS, NORM)]
        ops = ("allgather", "reduce_scatter")
        counted = {op: fsdp.comm_group.counters[op]["bytes_sent"] for op in ops}
        assert counted == sent_by_collective(calls, p, r)
