"""`--strategy ps`: a parameter server (Li et al., OSDI 2014), driven by the training loop.

    mpiexec -n 4 python -m minidp --strategy ps --servers 1 [--consistency bsp|asp|ssp:K]

Roles: of P ranks the last S serve and the first W = P - S work, so rank 0 is a worker (it
prints, and runs validation and the sample). The pieces (parallel/param_server/): each
worker is a ParameterServerWorker around the task's model (push its gradient, pull the
shards), each server a ShardServer over its key range of the flat parameter vector, with
the optimizer (--ps-optimizer) and the lr the worker sends; this recipe builds them from the
flags and drives them step by step. A worker's step: forward and backward on its slice of
the global batch, clip its own gradient (ASP/SSP; under BSP the servers clip the global
one), push and pull. It returns the global loss of the newest clock every worker has pushed
(BSP: this clock's, the same on every rank; ASP/SSP: it may lag). A server's step serves
until its clock is complete. After the last clock the ranks still in the job (membership.py:
a dropped worker is not) gather the servers' shards into every rank's model, and
max_param_diff is the largest difference between what the workers pulled and that.
docs/parameter_server.md has the protocol, the staleness and the measured tables.
"""

import functools
import time

import numpy as np

from minidp import comm
from minidp.cli.strategies.protocol import StepResult, Strategy
from minidp.cli.training.config import BadConfig, staleness_bound
from minidp.engine import optim
from minidp.models import data
from minidp.parallel.across_ranks import bytes_sent, clip_global_norm, global_l2, stand_in
from minidp.parallel.param_server.membership import NONE_DROPPED, account, live_group
from minidp.parallel.param_server.pieces import (
    ParameterServerWorker,
    flatten,
    gather_shards,
    load_flat,
    traffic,
)
from minidp.parallel.param_server.server import ShardServer
from minidp.tools.chunks import chunk_range
from minidp.tools.log import print0
from minidp.tools.memory import activation_bytes


class ParameterServer(Strategy):
    """Servers own shards of the parameters and the optimizer; workers push and pull."""

    name = "ps"

    def __init__(self, task, config, group: comm.Group, timeline=None):
        super().__init__(task, config, group, timeline)
        check_config(config, group.size, task.num_examples)  # every rank, before any message
        P, S = group.size, config.servers
        staleness_bound(config.consistency)  # a bad --consistency: one line, before any message
        self.n_workers = W = P - S
        self.servers = list(range(W, P))
        self.is_server = group.rank >= W
        self.params = task.model.parameters()
        flat = flatten(self.params)
        self.shards = [chunk_range(flat.size, S, s) for s in range(S)]
        self.ps = group.dup()  # the PS messages, counted apart; patient: ranks > cores
        self.ps.patient, self.ps.timeout = True, config.ps_timeout
        self.server_group = group.split(0 if self.is_server else None)
        self.histogram = np.zeros(config.steps + 1, dtype=np.int64)  # staleness 0..steps
        self.mismatch, self.traffic, self.clock = 0.0, [], 0
        self.steps_run = 0  # by this object: its counters' steps, after a resume too
        self.drops = dict(NONE_DROPPED)  # gather_model's account: who was dropped, when
        self.live_ranks = list(range(P))  # after the last clock: those still in the job
        self.staleness = self.histogram  # this rank's until gather_model sums them
        self.activations_peak, self._measure = 0, True
        if self.is_server:
            lo, hi = self.shards[group.rank - W]
            optimizer_class, defaults = ps_optimizer(config)
            self.server = ShardServer(
                self.ps, lo, hi, flat, W, optimizer_class, defaults, config.steps,
                config.consistency, config.grad_clip, config.ps_timeout, self.server_group,
                self.histogram,
            )  # fmt: skip
            for p in self.params:  # the shard is a copy: free the whole model's arrays
                p.data = stand_in(p)  # (read-only stand-ins until gather_model)
        else:
            self.data_shard = (group.rank, W)
            self.worker = ParameterServerWorker(
                task.model, self.ps, self.servers, config.consistency, config.ps_timeout
            )
            self.flat, self.grad = self.worker.flat, self.worker.grad  # pulled, pushed
            self.slow = config.ps_slow_worker_ms / 1e3 if group.rank == W - 1 else 0.0

    # ---- one step -----------------------------------------------------------------------
    def step(self, local: np.ndarray | None, lr: float) -> StepResult:
        last = self.clock == self.config.steps - 1
        self.steps_run += 1
        if self.is_server:
            loss = self.server.serve_until(self.clock, last)
            self.clock += 1
            if self.server.bsp and not last:  # every worker holds the next clock's shard:
                self.server.serve_pulls(self.clock)  # a collective between steps is safe
            self.keep_live_ranks(last)
            return StepResult(loss, 0.0)
        if self.worker.stopped:  # a server dropped this worker: it trains no more
            self.clock += 1
            self.keep_live_ranks(last)
            return StepResult(self.last_loss, 0.0)
        task, span, config = self.task, self.timeline.span, self.config
        if self.slow:
            time.sleep(self.slow)
        with span("forward"):
            loss = task.loss(*task.batch(local))
        if self._measure:
            self.activations_peak, self._measure = activation_bytes(loss), False
        for p in self.params:
            p.grad = None
        with span("backward"):
            loss.backward()
        if config.grad_clip and config.consistency != "bsp":  # the servers clip under BSP
            clip_global_norm(self.params, config.grad_clip)  # this worker's own gradient
        local_loss, share = loss.item(), len(local) / config.batch_size
        start = time.perf_counter()
        with span("push and pull"):
            step_loss = self.worker.push_pull(lr, local_loss, share)
        self.comm_seconds += time.perf_counter() - start
        self.exposed_seconds = self.comm_seconds
        self.clock += 1
        self.last_loss = step_loss
        self.keep_live_ranks(last)
        return StepResult(step_loss, local_loss)

    def keep_live_ranks(self, last: bool) -> None:
        """After the last clock: self.group made of the ranks still in the job (a dropped
        worker is not: membership.py), for every collective that follows."""
        if last:
            self.group, self.live_ranks = live_group(
                self.group, self.ps, self.n_workers, server=getattr(self, "server", None),
                stopped=not self.is_server and self.worker.stopped,
                server_group=self.server_group, timeout=2 * self.config.ps_timeout,
            )  # fmt: skip

    # ---- after training -------------------------------------------------------------------
    def gather_model(self) -> None:
        """Collective over the live ranks: every shard broadcast from its server; the traffic
        and histogram. A dropped worker keeps what it last pulled."""
        stopped, W = not self.is_server and self.worker.stopped, self.n_workers
        server, timeout = getattr(self, "server", None), self.config.ps_timeout
        self.drops = account(
            self.group, self.ps, W, self.live_ranks, server=server, stopped=stopped, timeout=timeout
        )
        if stopped:
            return
        roots = [self.live_ranks.index(s) for s in self.servers]
        full = gather_shards(self.group, roots, self.shards, server, self.params[0].data)
        if self.is_server:  # fresh arrays in place of the stand-ins
            for p in self.params:
                p.data = np.empty(p.shape, p.dtype)
        else:
            self.mismatch = float(np.max(np.abs(self.flat - full), initial=0.0))
        load_flat(self.params, full)
        self.staleness = comm.allreduce(self.histogram, group=self.group)  # every server's
        self.traffic = traffic(self.ps, self.group, self.live_ranks, self.servers, self.steps_run)
        say = functools.partial(print0, rank=self.group.rank)
        say("staleness histogram (clocks: updates): " + staleness_line(self.staleness))
        for t in self.traffic:
            say(
                f"  {t['role']} rank {t['rank']}: {t['bytes_in_per_step']:,.0f} B in, "
                f"{t['bytes_out_per_step']:,.0f} B out per step"
            )

    def param_l2(self) -> float:
        return global_l2([p.data for p in self.params])

    def max_param_diff(self) -> float:
        return float(comm.allreduce(np.array([self.mismatch]), op="max", group=self.group)[0])

    def bytes_sent_by_axis(self) -> dict[str, int]:
        """Push, pull and the servers' norm: the data-parallel axis of the mesh contract
        (the workers split the global batch); the record's ps_traffic splits it by role."""
        groups = [self.ps] + ([self.server_group] if self.is_server else [])
        return {"dp": bytes_sent(*groups)}

    def memory_bytes(self) -> dict[str, int]:
        if self.is_server:  # the shard, and the released model's stand-ins
            return self.server.memory_bytes(released=[p.data for p in self.params])
        return self.worker.memory_bytes(self.activations_peak)

    def describe(self) -> str:
        W, S = self.n_workers, len(self.servers)
        keys = ", ".join(f"[{lo}:{hi})" for lo, hi in self.shards)

        def ranks(lo: int, hi: int) -> str:
            return f"rank {lo}" if lo == hi else f"ranks {lo}-{hi}"

        return (
            f"parameter server | workers {ranks(0, W - 1)} | servers {ranks(W, W + S - 1)} "
            f"(keys {keys}) | consistency {self.config.consistency} | "
            f"optimizer {self.config.ps_optimizer} on the servers"
        )

    def record(self) -> dict:
        """The staleness histogram (one count per update per server: a push to S servers is S
        updates) and, after gather_model, each rank's PS traffic."""
        counts = {str(s): int(n) for s, n in enumerate(self.staleness) if n}
        return {
            "consistency": self.config.consistency,
            "servers": len(self.servers),
            "staleness_histogram": counts,
            "ps_traffic": self.traffic,
            **self.drops,  # resends dropped; workers dropped, when, and those that never ended
        }

    # ---- resuming (saves run under BSP only: every rank at the same clock) ---------------
    def state_dict(self) -> dict:
        state = {"clock": self.clock, "histogram": self.histogram.copy()}
        if self.is_server:  # its model is released: the shard is its state
            return state | self.server.state_dict(self.clock)
        return state | {"model": self.task.model.state_dict(), **self.worker.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.clock = state["clock"]
        self.histogram[...] = state["histogram"]
        if self.is_server:
            self.server.load_state_dict(state, self.clock)
        else:
            self.task.model.load_state_dict(state["model"])
            self.worker.load_state_dict(state, self.clock)

    def close(self) -> None:
        if self.server_group is not None and self.server_group.broken != "freed":
            self.server_group.free()
        if self.ps.broken != "freed":
            self.ps.free()


def check_config(config, world_size: int, num_examples: int) -> None:
    """BadConfig (one line) for what this world cannot run: on every rank alike, servers
    included, which read no data and so never see the loop's check of the batch. (Data
    parallelism's flags set under --strategy ps are refused by TrainConfig.validate, which
    the command line runs; a script that calls train() without it has them ignored.)"""
    P, S = world_size, config.servers
    if S >= P:
        raise BadConfig(f"--servers {S} leaves no worker in a world of {P} ranks: at most {P - 1}")
    try:  # the workers' sampler, as the loop builds it on each of them
        data.DistributedSampler(num_examples, config.batch_size, 0, P - S, seed=config.seed)
    except ValueError as error:
        raise BadConfig(f"--batch-size {config.batch_size}: {error}") from None


def staleness_line(histogram: np.ndarray) -> str:
    """'0: 120 | 1: 30 | 3: 2': the staleness values that occurred and their counts."""
    return " | ".join(f"{s}: {int(n)}" for s, n in enumerate(histogram) if n) or "none"


def ps_optimizer(config) -> tuple[type, dict]:
    """--ps-optimizer as (optimizer_class, defaults): the servers' (and a reference run's)."""
    return {
        "sgd": (optim.SGD, {"lr": config.lr}),
        "momentum": (optim.SGD, {"lr": config.lr, "momentum": 0.9}),
        "adamw": (optim.AdamW, {"lr": config.lr, "weight_decay": config.weight_decay}),
    }[config.ps_optimizer]
