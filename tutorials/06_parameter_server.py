# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 06 · A parameter server: push, pull, shard, and how stale may a gradient be
#
# Launch line:
#
# mpiexec -n 4 python tutorials/06_parameter_server.py
#
# Data parallelism (05) keeps a whole model and optimizer on every rank and averages the
# gradients with an allreduce. A parameter server (Li et al., OSDI 2014) splits the roles:
# *servers* own the parameters and the optimizer; *workers* compute gradients, **push** them
# to the servers and **pull** fresh parameters back. Here ranks 0-2 work and rank 3 serves.
# First one step by hand, then sharding over two servers, then the three consistency
# models side by side: BSP, ASP and SSP (Ho et al., NeurIPS 2013), and last the worker and
# server as pieces around a model of your own.

# %%
import contextlib
import io
import os
import tempfile
from dataclasses import replace

import numpy as np

from minidp import Tensor, comm, cross_entropy, data, nn, optim
from minidp.cli.strategies import ParameterServer
from minidp.cli.training.config import TrainConfig
from minidp.comm import p2p
from minidp.models.tasks import Task
from minidp.parallel import ParameterServerWorker, serve
from minidp.parallel.param_server import messages
from minidp.tools.chunks import chunk_range
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0
from minidp.tools.plots import pyplot, save

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores

group = comm.world()
rank, world = group.rank, group.size
assert world == 4, "launch with mpiexec -n 4"
SERVER, WORKERS = 3, [0, 1, 2]

# %% [markdown]
# ## 1. One step by hand
# The flat parameter vector θ lives on the server. Each worker takes its third of the
# global batch, computes its mean gradient g_w, pushes it with a header (worker, clock, key
# range, its share n_w/B), and pulls θ. The server sums Σ n_w/B · g_w, the global mean
# gradient, takes one SGD step, and answers the pulls. The messages are messages.py's.

# %%
x_all, y_all, _, _ = data.classification(seed=0, dtype=np.float64)
B, lr = 30, 0.5
model = nn.MLP([32, 16, 10], rng=np.random.default_rng(0), dtype=np.float64)
params = model.parameters()
theta = np.concatenate([p.data.ravel() for p in params])
keys = [(0, theta.size)]  # one server: the whole key range

ps = group.dup()  # the PS messages on a communicator of their own
ps.patient = True  # wait by napping: 4 ranks share 2 cores here
if rank == SERVER:
    total, pulls, buf = np.zeros_like(theta), [], messages.empty_header()
    while len(pulls) < len(WORKERS):  # each worker sends a push, then a pull
        tag, h = messages.next_header(ps, buf, timeout=60)
        if tag == messages.PUSH:
            g = np.empty(h.hi - h.lo)
            messages.recv_push_data(ps, g, h.worker)
            total += h.share * g
        else:
            pulls.append(h)
    theta -= lr * total  # SGD, on the server only
    for h in pulls:
        sent = messages.reply(ps, h.worker, messages.Header(h.worker, 1, 0, theta.size, 1), theta)
        p2p.waitall(ps, sent[0], [h.worker, h.worker])
else:
    lo, hi = chunk_range(B, len(WORKERS), rank)  # this worker's slice of the batch
    cross_entropy(model(Tensor(x_all[lo:hi])), y_all[lo:hi]).backward()
    g = np.concatenate([p.grad.ravel() for p in params])
    header = messages.Header(rank, 0, 0, 0, loss=0.0, share=(hi - lo) / B, lr=lr)
    sent = messages.push(ps, [SERVER], keys, g, header, versions=[0])
    messages.pull(ps, [SERVER], keys, theta, rank, clock=1, timeout=60)
    p2p.waitall(ps, sent[0], [SERVER, SERVER])

single = nn.MLP([32, 16, 10], rng=np.random.default_rng(0), dtype=np.float64)
cross_entropy(single(Tensor(x_all[:B])), y_all[:B]).backward()
opt = optim.SGD(single.parameters(), lr=lr)
opt.step()
want = np.concatenate([p.data.ravel() for p in single.parameters()])
assert np.allclose(theta, want, rtol=1e-12, atol=1e-14), "push/pull is one SGD step"
print0("by hand: every rank's θ after one push/pull equals one process's SGD step")
ps.free()

# %% [markdown]
# ## 2. Sharding: two servers, each a contiguous key range
# Every worker pushes its whole gradient every step, so one server takes W·Ψb bytes per
# step: it grows with the workers, while a ring-allreduce rank sends 2(p-1)/p·Ψb whatever p.
# Cutting θ into S contiguous ranges (a tensor may straddle two) divides it by S.
# `ParameterServer` is the whole scheme as the training loop drives it.

# %%
BASE = TrainConfig(
    strategy="ps", model="mlp", hidden=32, batch_size=30, dtype="float64", lr=0.05,
    warmup=3, steps=30, eval_batches=1, ps_optimizer="momentum",
)  # fmt: skip


def train(config):
    """Drive the strategy as minidp's loop does; the servers' loss of every clock."""
    strategy = ParameterServer(Task(config, np.float64), config, group)
    sampler = None
    if strategy.data_shard is not None:
        sampler = data.DistributedSampler(
            strategy.task.num_examples, config.batch_size, *strategy.data_shard, seed=0
        )
    losses = []
    for step in range(config.steps):
        lr = optim.warmup_cosine(step, config.lr, config.warmup, config.steps)
        losses.append(strategy.step(sampler.local_indices(step) if sampler else None, lr).loss)
    with contextlib.redirect_stdout(io.StringIO()):  # its traffic lines: read from the record
        strategy.gather_model()
    losses = comm.broadcast(np.array(losses), root=world - 1, group=group)  # a server's
    record = strategy.record() | {"model_bytes": sum(p.data.nbytes for p in strategy.params)}
    assert strategy.max_param_diff() == 0.0  # every worker holds the servers' parameters
    strategy.close()
    return losses, record


into = {}
for servers in (1, 2):
    _, record = train(replace(BASE, servers=servers, steps=2))
    into[servers] = max(
        r["bytes_in_per_step"] for r in record["ps_traffic"] if r["role"] == "server"
    )
    W, Psi_b = world - servers, record["model_bytes"]
    headers = into[servers] - W * Psi_b / servers  # the rest: a push's and a pull's header
    print0(
        f"{servers} server(s), {W} workers: {into[servers]:,.0f} B/step in a server = "
        f"W·Ψb/S = {W} x {Psi_b:,} / {servers} + {headers:,.0f} B of headers"
    )
    assert headers == W * 2 * messages.empty_header().nbytes  # 2 headers a worker a step
# 3 workers x the whole model, against 2 workers x half of it: 3x, but for the headers
assert 2.9 < into[1] / into[2] < 3.1

# %% [markdown]
# ## 3. BSP, ASP, SSP with one slow worker
# *BSP*: a server applies clock c once every worker's push for c is in (the same training
# as one process). *ASP*: each push is applied as it comes, and nobody waits. *SSP:K*: a
# worker may run at most K clocks ahead of the slowest. The price of not waiting is
# staleness: a gradient computed on parameters a few clocks old. Worker 2 sleeps 5 ms a step.
# Read the curves with care: under ASP/SSP each push is an optimizer step of its own (lr
# scaled by the worker's share), so momentum advances three times per clock and the stale
# runs may even drop faster per clock here; what they buy is not waiting for worker 2.

# %%
curves, histograms = {}, {}
for consistency in ("bsp", "ssp:2", "asp"):
    config = replace(BASE, consistency=consistency, ps_slow_worker_ms=5)
    curves[consistency], record = train(config)
    histograms[consistency] = {int(s): n for s, n in record["staleness_histogram"].items()}
    final = curves[consistency][-1]
    print0(f"{consistency:>5}: final loss {final:.3f}, staleness {histograms[consistency]}")
assert set(histograms["bsp"]) == {0}
assert max(histograms["ssp:2"]) <= 2
for consistency, losses in curves.items():
    assert losses[-1] < 0.6 * losses[0], f"{consistency} did not train"

plt = pyplot()
if plt is not None and rank == 0:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for consistency, losses in curves.items():
        left.plot(losses, label=consistency)
        shift = 0.25 * list(curves).index(consistency)
        s, n = zip(*sorted(histograms[consistency].items()))
        right.bar([x + shift for x in s], n, width=0.25, label=consistency)
    left.set(xlabel="clock", ylabel="global loss", title="loss per clock")
    right.set(xlabel="staleness (clocks)", ylabel="updates", title="staleness of each update")
    left.legend(), right.legend()
    out = os.environ.get("MINIDP_OUT", tempfile.gettempdir())
    save(fig, os.path.join(out, "06_parameter_server.png"))
print0("BSP has no stale update; SSP:2 none older than 2 clocks; all three train")

# %% [markdown]
# ## 4. The pieces, in a script of your own
# Section 1's messages, packaged: `ParameterServerWorker(model, ps, servers)` wraps a
# worker's model (ps-lite's KVWorker); after the user's backward, `push_pull(lr, loss,
# share)` pushes the gradient and pulls the new θ into the model. `serve(model, ps,
# workers, optimizer_class, steps, **defaults)` is a server's whole loop (ps-lite's KVServer
# with its handle). `--strategy ps` is these two driven by the training loop.

# %%
STEPS = 3
ps = group.dup()
ps.patient = True
model = nn.MLP([32, 16, 10], rng=np.random.default_rng(0), dtype=np.float64)
if rank == SERVER:
    serve(model, ps, WORKERS, optim.SGD, STEPS, consistency="bsp", lr=lr)
else:
    worker = ParameterServerWorker(model, ps, [SERVER], consistency="bsp")
    lo, hi = chunk_range(B, len(WORKERS), rank)
    for _ in range(STEPS):  # the same batch each step, as section 1
        for p in model.parameters():
            p.grad = None
        loss = cross_entropy(model(Tensor(x_all[lo:hi])), y_all[lo:hi])
        loss.backward()
        worker.push_pull(lr, loss, share=(hi - lo) / B)
single = nn.MLP([32, 16, 10], rng=np.random.default_rng(0), dtype=np.float64)
opt = optim.SGD(single.parameters(), lr=lr)
for _ in range(STEPS):  # one process, the whole batch
    opt.zero_grad()
    cross_entropy(single(Tensor(x_all[:B])), y_all[:B]).backward()
    opt.step()
got = np.concatenate([p.data.ravel() for p in model.parameters()])
want = np.concatenate([p.data.ravel() for p in single.parameters()])
assert np.allclose(got, want, rtol=1e-10, atol=1e-12), "the pieces are one process's SGD"
print0(f"pieces: {STEPS} BSP steps of 3 workers and a server equal one process's SGD")
ps.free()
