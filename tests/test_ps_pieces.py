"""The parameter server's pieces on a model the test builds, no TrainConfig: two workers
around an MLP (ParameterServerWorker.push_pull after their backward) and one server
(serve) under BSP with SGD train as one process on the whole global batch (float64, 1e-10),
and both workers hold the same parameters to the bit. Wrong arguments are errors naming
them."""

import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel import ParameterServerWorker, serve
from minidp.parallel.param_server.pieces import flatten
from minidp.tools.chunks import chunk_range

STEPS, BATCH, LR = 4, 9, 0.1  # 9 examples: 5 and 4 over the two workers
WORKERS, SERVERS = [0, 1], [2]


def build_model():
    return nn.MLP([6, 8, 4], rng=np.random.default_rng(0), dtype=np.float64)


def batches():
    """STEPS global batches of BATCH examples."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((STEPS, BATCH, 6))
    y = rng.integers(0, 4, size=(STEPS, BATCH))
    return x, y


def reference():
    """One process, the whole global batch, the same SGD: losses and the flat parameters."""
    model, (x, y) = build_model(), batches()
    opt = optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = cross_entropy(model(Tensor(x[step])), y[step])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, flatten(model.parameters())


@pytest.mark.parallel(nprocs=[3])
@pytest.mark.timeout(120)
def test_bsp_workers_train_as_one_process_on_the_global_batch():
    ps = comm.world().dup()  # the PS messages on a group of their own
    ps.patient = True  # 3 ranks may share fewer cores
    model, (x, y) = build_model(), batches()
    if ps.rank in SERVERS:
        losses = serve(model, ps, WORKERS, optim.SGD, STEPS, consistency="bsp", lr=LR)
    else:
        worker = ParameterServerWorker(model, ps, SERVERS, consistency="bsp")
        lo, hi = chunk_range(BATCH, len(WORKERS), ps.rank)  # this worker's slice
        losses = []
        for step in range(STEPS):
            for p in model.parameters():
                p.grad = None
            loss = cross_entropy(model(Tensor(x[step, lo:hi])), y[step, lo:hi])
            loss.backward()
            losses.append(worker.push_pull(LR, loss, share=(hi - lo) / BATCH))
    got = flatten(model.parameters())
    every = comm.allgather(got, group=comm.world())  # before any assert: no rank waits alone
    ps.free()
    want_losses, want = reference()
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())
    np.testing.assert_array_equal(every[WORKERS[0]], every[WORKERS[1]])  # the same bits


def test_wrong_arguments_are_errors_naming_them():
    model, world = build_model(), comm.world()  # one rank: no room for worker and server
    with pytest.raises(TypeError, match="model"):
        ParameterServerWorker(object(), world, [1])
    with pytest.raises(ValueError, match="consistency 'ssp'"):
        ParameterServerWorker(model, world, [1], consistency="ssp")
    with pytest.raises(ValueError, match="timeout"):
        ParameterServerWorker(model, world, [1], timeout=0.0)
    with pytest.raises(TypeError, match="ps_group"):
        ParameterServerWorker(model, None, [1])
    with pytest.raises(ValueError, match="servers must be the last ranks of ps_group"):
        ParameterServerWorker(model, world, [0])
    with pytest.raises(ValueError, match="workers must be ranks 0..W-1"):
        serve(model, world, [1], optim.SGD, 3, lr=LR)
    with pytest.raises(TypeError, match="optimizer_class"):
        serve(model, world, [0], None, 3)
    with pytest.raises(ValueError, match="steps"):
        serve(model, world, [0], optim.SGD, 0, lr=LR)
    with pytest.raises(ValueError, match="grad_clip"):
        serve(model, world, [0], optim.SGD, 3, grad_clip=-1.0, lr=LR)
    with pytest.raises(ValueError, match="ps_group's ranks after workers"):
        serve(model, world, [0], optim.SGD, 3, lr=LR)  # no rank left to serve
    with pytest.raises(TypeError, match="model_or_flat_params"):
        serve("model", world, [0], optim.SGD, 3, lr=LR)
