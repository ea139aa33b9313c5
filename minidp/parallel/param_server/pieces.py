"""The parameter server as pieces a script uses: ParameterServerWorker around the user's
model (ps-lite's KVWorker: Push, then Pull) and serve(), one server's loop (its KVServer).

    mpiexec -n 4 python tutorials/06_parameter_server.py    # section 4 uses it

The workers are ranks 0..W-1 of a PS group of P ranks, the servers the last S = P - W
(serve() runs one, over server.ShardServer). The model's flat parameter vector of Ψ
elements (its parameters in order) is cut into S contiguous key ranges,
chunk_range(Ψ, S, s): server s owns keys [lo_s, hi_s) and their optimizer.
One step on worker w, at its clock c:

    loss = cross_entropy(model(x_w), y_w)      # the user's forward on its n_w of B examples
    loss.backward()                            # the user's backward
    worker.push_pull(lr, loss, share=n_w / B)  # push g_w[lo_s:hi_s] to every server,
                                               # pull θ[lo_s:hi_s] for clock c + 1 into the model

The servers answer the pull as `consistency` allows (server.py): under "bsp" once every
worker's push for clock c is in, so every worker then holds the same parameters as one
process training on the whole global batch. push_pull returns the global loss of the newest
clock every worker has pushed (Σ n_w/B · loss_w, summed by the servers): under BSP clock c
itself. Messages: messages.py.

Contract: every rank of ps_group passes the same servers, consistency and timeout; each
worker's model has the same parameter shapes and dtype as the servers'; ps_group is a group
of its own (group.dup()), patient when ranks outnumber cores.

Errors are one-sided. A bad argument (to ParameterServerWorker, push_pull or serve) is a
ValueError or TypeError on the rank that was given it, raised before that rank sends
anything; no other rank is told. The others wait for it: the servers for its pushes until
`timeout`, then (BSP) raise WorkerLost naming it or (ASP / SSP) drop it; a worker for a
server that never serves, until `timeout`, then ServerLost. So give every rank the same
arguments, and let an error end the whole job (`mpiexec ... python -m mpi4py script.py`
aborts every rank on an uncaught exception) rather than catch it on one rank and go on.
"""

import math

import numpy as np

from minidp import comm
from minidp.comm import Group, p2p
from minidp.parallel.param_server import messages
from minidp.parallel.param_server.messages import Header
from minidp.parallel.param_server.server import (
    ShardServer,
    WorkerLost,
    consistency_bound,
    lost_message,
)
from minidp.tools.chunks import chunk_range
from minidp.tools.memory import nbytes


class ParameterServerWorker:
    """Push this worker's gradients and pull the servers' parameters into `model`."""

    def __init__(
        self, model, ps_group: Group, servers: list[int], consistency: str = "bsp",
        timeout: float = 60.0,
    ):  # fmt: skip
        if not hasattr(model, "parameters"):
            raise TypeError(f"model must be a minidp.nn.Module, got {type(model).__name__}")
        consistency_bound(consistency)
        check_timeout(timeout)
        check_roles(ps_group, servers, "servers")
        if ps_group.rank in servers:
            raise ValueError(f"ps_group rank {ps_group.rank} is one of servers {servers}")
        self.model, self.ps, self.servers = model, ps_group, list(servers)
        self.consistency, self.timeout = consistency, timeout
        self.params = model.parameters()
        if not self.params:
            raise ValueError("model has no parameters to push")
        self.flat = flatten(self.params)
        self.grad = np.zeros_like(self.flat)  # the push buffer
        self.shards = [chunk_range(self.flat.size, len(servers), s) for s in range(len(servers))]
        self.versions = [0] * len(servers)  # the clock of the parameters each server last sent
        self.clock = 0
        self.stopped = False  # a server dropped this worker (too slow): it pushes no more

    def push_pull(self, lr: float, loss, share: float) -> float:
        """After backward: push every parameter's .grad (None: zeros) with this worker's
        `loss` (a float or a Tensor) and `share` (its n_w / B of the global batch), lr the
        servers' learning rate for this clock; pull the new parameters into the model.
        Returns the global loss (before any clock is complete: this worker's own). After
        it, `stopped` is True when a server has dropped this worker: it pushes no more."""
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1]: this worker's n_w / B, got {share}")
        if not math.isfinite(lr):
            raise ValueError(f"lr must be finite, got {lr}")
        local_loss = float(loss.item() if hasattr(loss, "item") else loss)
        offset = 0
        for p in self.params:  # unused parameters get a zero gradient
            n = p.data.size
            self.grad[offset : offset + n] = 0 if p.grad is None else p.grad.ravel()
            offset += n
        ps, servers = self.ps, self.servers
        header = Header(ps.rank, self.clock, 0, 0, 0, local_loss, share, lr)
        sent = messages.push(ps, servers, self.shards, self.grad, header, self.versions)
        try:
            replies = messages.pull(
                ps, servers, self.shards, self.flat, ps.rank, self.clock + 1, 2 * self.timeout
            )
        except messages.ServerLost:  # or the servers finished without this dropped worker
            if not messages.dropped_by_servers(ps, servers[0]):
                raise
            ps.abandoned += sent[0]  # its pushes, never received: MPI may still read them
            self.stopped = True
            return local_loss
        for server, r in zip(servers, replies):
            if r.version < 0:  # a server's word that a worker went silent (BSP)
                message = lost_message(-1 - r.version, server, self.timeout)
                raise WorkerLost(message, reported_elsewhere=True)  # the server says it
        p2p.waitall(ps, sent[0], [None] * len(sent[0]))
        self.stopped = any(r.share == messages.DROPPED for r in replies)
        self.versions = [r.version for r in replies]
        load_flat(self.params, self.flat)
        self.clock += 1
        return replies[0].loss if replies[0].version > 0 else local_loss

    def memory_bytes(self, activations_peak: int = 0) -> dict[str, int]:
        """By category: the model, its gradients and the push buffer, the pulled copy."""
        return {
            "parameters": nbytes(p.data for p in self.params),
            "gradients": nbytes([self.grad, *(p.grad for p in self.params)]),
            "optimizer": 0,
            "activations_peak": activations_peak,
            "buffers": self.flat.nbytes,
        }

    def state_dict(self) -> dict:
        """The clock of the parameters each server last sent (the model's own state, whole
        on every worker, is the model's state_dict)."""
        return {"versions": list(self.versions)}

    def load_state_dict(self, state: dict, clock: int) -> None:
        """Back at `clock`, the model loaded: what it pushes next and what it holds."""
        self.versions, self.clock = list(state["versions"]), clock
        self.flat[...] = flatten(self.params)


def traffic(ps_group: Group, group: Group, ranks: list[int], servers, steps: int) -> list[dict]:
    """Collective over `group` (whose members are world `ranks`): what each rank sent and
    received on the PS messages' group, per step, with its role."""
    counters = ps_group.counters.get("p2p", {"bytes_sent": 0, "bytes_recv": 0})
    mine = np.array([counters["bytes_sent"], counters["bytes_recv"]], dtype=np.int64)
    every, n = comm.allgather(mine, group=group).reshape(-1, 2), max(1, steps)
    return [
        {
            "rank": r,
            "role": "server" if r in servers else "worker",
            "bytes_out_per_step": int(out) / n,
            "bytes_in_per_step": int(into) / n,
        }
        for r, (out, into) in zip(ranks, every)
    ]


def gather_shards(group: Group, servers: list[int], shards, server, like: np.ndarray):
    """Collective over `group` (the ranks still in the job, `servers` their ranks there):
    the whole flat vector on every rank, each key range broadcast from its server;
    `server` this rank's ShardServer (None on a worker), `like` an array of the dtype."""
    full = np.empty(shards[-1][1], dtype=like.dtype)
    for (lo, hi), root in zip(shards, servers):
        if group.rank == root:
            full[lo:hi] = server.param.data
        comm.broadcast(full[lo:hi], root=root, group=group)
    return full


def serve(
    model_or_flat_params,
    ps_group: Group,
    workers: list[int],
    optimizer_class,
    steps: int,
    consistency: str = "bsp",
    grad_clip: float = 0.0,
    timeout: float = 60.0,
    server_group: Group | None = None,
    **optimizer_defaults,
) -> list[float]:
    """Run this rank's server for `steps` clocks of ParameterServerWorker.push_pull: its key
    range of the flat parameter vector (a model's parameters in order, or a flat array),
    optimizer_class(params, **optimizer_defaults) over it. workers: ranks 0..W-1 of
    ps_group; the servers are the other ranks, this one owning chunk_range(Ψ, S, rank - W).
    grad_clip: under BSP the servers clip the global gradient by its global norm (with more
    than one server, server_group, the servers' own group, agrees on it); under ASP/SSP each
    worker clips its own gradient before push_pull. Returns each clock's global loss; afterwards
    model_or_flat_params holds the trained values in this server's key range."""
    workers = list(workers)
    if not workers or workers != list(range(len(workers))):
        raise ValueError(f"workers must be ranks 0..W-1 of ps_group, got {workers}")
    if not callable(optimizer_class):
        raise TypeError(f"optimizer_class must be an optimizer class, got {optimizer_class!r}")
    consistency_bound(consistency)
    check_timeout(timeout)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")
    if not grad_clip >= 0:
        raise ValueError(f"grad_clip must be >= 0 (0: off), got {grad_clip}")
    params = None
    if hasattr(model_or_flat_params, "parameters"):
        params = model_or_flat_params.parameters()
        flat = flatten(params)
    elif isinstance(model_or_flat_params, np.ndarray) and model_or_flat_params.ndim == 1:
        flat = model_or_flat_params
    else:
        raise TypeError(
            "model_or_flat_params must be a minidp.nn.Module or a 1-D numpy array, got "
            f"{type(model_or_flat_params).__name__}"
        )
    servers = list(range(len(workers), ps_group.size if isinstance(ps_group, Group) else 0))
    check_roles(ps_group, servers, "ps_group's ranks after workers")
    if ps_group.rank not in servers:
        raise ValueError(f"ps_group rank {ps_group.rank} is one of workers {workers}")
    if grad_clip and consistency == "bsp" and len(servers) > 1 and server_group is None:
        raise ValueError("server_group (the servers' group) is needed to clip with >1 server")
    s = ps_group.rank - len(workers)
    lo, hi = chunk_range(flat.size, len(servers), s)
    server = ShardServer(
        ps_group, lo, hi, flat, len(workers), optimizer_class, optimizer_defaults, steps,
        consistency, grad_clip, timeout, server_group,
    )  # fmt: skip
    losses = [server.serve_until(clock, clock == steps - 1) for clock in range(steps)]
    flat[lo:hi] = server.param.data
    if params is not None:  # the shard back into the model's parameters
        load_flat(params, flat)
    return losses


def check_roles(ps_group, ranks, name: str) -> None:
    """TypeError/ValueError unless `ranks` (named `name`) are the last ranks of ps_group,
    leaving at least one other: workers are ranks 0..W-1 (the servers index them so)."""
    if not isinstance(ps_group, Group):
        raise TypeError(f"ps_group must be a minidp.comm.Group, got {type(ps_group).__name__}")
    ranks = list(ranks)
    P, S = ps_group.size, len(ranks)
    if not 0 < S < P or ranks != list(range(P - S, P)):
        raise ValueError(
            f"{name} must be the last ranks of ps_group, leaving workers 0..W-1 "
            f"(ps_group has {P} ranks), got {ranks}"
        )


def check_timeout(timeout: float) -> None:
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")


def flatten(params) -> np.ndarray:
    """The flat parameter vector: every parameter's data, in order, in one fresh array."""
    return np.concatenate([p.data.ravel() for p in params])


def load_flat(params, flat: np.ndarray) -> None:
    """Copy a flat parameter vector into the parameters, in order."""
    offset = 0
    for p in params:
        p.data[...] = flat[offset : offset + p.data.size].reshape(p.data.shape)
        offset += p.data.size
