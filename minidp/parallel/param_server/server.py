"""One parameter server: a shard of the parameters, its optimizer, and the workers' clocks.

The server answers messages as they come (messages.py says what each carries):

    PUSH (w, c, version, grad)   BSP: keep it; once every live worker's push for clock c is
                                 in, g = Σ_w (n_w / B) g_w in worker order, clip by the
                                 global norm (the servers agree on it: one allreduce of a
                                 float among them), one optimizer step with the clock's lr
                                 ASP / SSP: one optimizer step at once with g_w and lr·n_w/B
                                 (the worker clipped g_w itself: the whole gradient is there)
    PULL (w, c)                  answered once  complete >= c - K  (BSP: K = 0; ASP: K = ∞;
                                 the last pull, c = steps, waits for every push: K = 0;
                                 a dropped worker's pulls are answered at once, telling
                                 it to stop)

where complete = min over live workers of the clocks they pushed: every update of a clock
below it is in. Ho et al. (NeurIPS 2013, "More effective distributed ML via a stale
synchronous parallel parameter server") call this bounded staleness: a worker at clock c
computes on parameters holding every update of clocks < c - K.

Staleness of an applied update = its clock c - version, the `complete` of the parameters
it was computed on (they hold every worker's updates of clocks below it): the clocks of
the others' updates it may have missed. 0 under BSP, at most K under SSP (the pull rule),
unbounded under ASP.

Under ASP one clock of W pushes moves the parameters about as far as one BSP step (each
takes lr scaled by its worker's share of the batch); SGD's momentum and Adam's moments
advance once per push, so they see W times as many steps.

A push whose (worker, clock) is already in is a resend: received and dropped (ps-lite's
dedup). A live worker that is silent for `timeout` seconds while the server waits for it
is an error under BSP (the server tells every waiting worker, so each rank raises naming
it) and is dropped with a warning under ASP / SSP, training going on without it: its pushes
are ignored and, if it still lives, its next reply tells it to stop. The server looks for
silence at least once a second even while other workers keep it busy. Every
server sees the silence; the first (rank n_workers) says it, once, and the others keep
quiet (their WorkerLost is `reported_elsewhere`), so `S` servers print one line, not S.
"""

import math
import sys
import time

import numpy as np

from minidp.comm import p2p
from minidp.engine.tensor import Tensor
from minidp.parallel.across_ranks import clip_global_norm
from minidp.parallel.param_server import messages
from minidp.parallel.param_server.messages import DROPPED, PULL, PUSH, Header
from minidp.tools.log import JobError
from minidp.tools.memory import nbytes, optimizer_bytes


def consistency_bound(consistency: str) -> float:
    """The bound K on how far a worker may run ahead of the slowest: "bsp" -> 0 (and
    updates wait for the whole clock), "ssp:K" -> K, "asp" -> infinity."""
    if consistency == "bsp":
        return 0
    if consistency == "asp":
        return math.inf
    name, _, k = str(consistency).partition(":")
    if name == "ssp" and k.isdigit():
        return int(k)
    raise ValueError(
        f"consistency {consistency!r}: choose 'bsp', 'asp' or 'ssp:K' with an integer K >= 0"
    )


class WorkerLost(JobError):
    """Under BSP, a worker went silent: no clock can complete without it. The server that
    saw it says so; the workers it tells raise it with `reported_elsewhere=True`."""


class ShardServer:
    """Keys [lo, hi) of the flat parameter vector, served to workers 0..n_workers-1 (their
    ranks in the PS group `ps`) for `steps` clocks, with optimizer_class(**defaults) over the
    shard. server_group: the servers' group, for clipping by the global norm (None: one
    server); histogram: the staleness counts to add to (length steps + 1)."""

    def __init__(
        self, ps, lo: int, hi: int, flat: np.ndarray, n_workers: int, optimizer_class,
        optimizer_defaults: dict, steps: int, consistency: str = "bsp", grad_clip: float = 0.0,
        timeout: float = 60.0, server_group=None, histogram: np.ndarray | None = None,
    ):  # fmt: skip
        self.ps, self.lo, self.hi, self.steps = ps, lo, hi, steps
        self.bound, self.bsp = consistency_bound(consistency), consistency == "bsp"
        self.grad_clip, self.timeout, self.server_group = grad_clip, timeout, server_group
        if histogram is None:
            histogram = np.zeros(steps + 1, dtype=np.int64)
        self.histogram = histogram
        self.param = Tensor(flat[lo:hi].copy())
        self.optimizer = optimizer_class([self.param], **optimizer_defaults)
        self.live = list(range(n_workers))
        self.done = [0] * n_workers  # pushes received from each worker: its clock
        self.heard = [time.monotonic()] * n_workers
        self.inbox = [np.empty_like(self.param.data) for _ in range(n_workers if self.bsp else 1)]
        self.pushed: dict[int, list] = {}  # clock -> [(worker, share, loss, lr, version)]
        self.complete, self.losses = 0, []  # losses[c]: clock c's global loss
        self.pending: list[Header] = []  # pulls not yet allowed
        self.outbox: list = []  # replies in flight: [requests, buffers]
        self.answered = [0] * n_workers  # the clock of each worker's last answered pull
        self.duplicates, self.dropped = 0, []
        self.dropped_at: dict[int, int] = {}  # dropped worker -> clocks complete then
        self.looked = time.monotonic()  # the last look for silent workers
        self.header = messages.empty_header()
        self.scratch = np.empty_like(self.param.data)

    # ---- the loop ---------------------------------------------------------------------------
    def memory_bytes(self, released=()) -> dict[str, int]:
        """By category: the shard (with `released`, the model's stand-ins), the workers'
        gradients waiting in its inbox, its optimizer, its scratch."""
        return {
            "parameters": nbytes([self.param.data, *released]),
            "gradients": nbytes(self.inbox),
            "optimizer": optimizer_bytes(self.optimizer),
            "activations_peak": 0,
            "buffers": self.scratch.nbytes,
        }

    def serve_until(self, clock: int, last: bool) -> float:
        """Serve until clock `clock` is complete (and, when `last`, every live worker holds
        the final shard); return that clock's global loss."""
        while self.complete <= clock:
            self.serve_one()
        if last:  # every live worker gets the final shard (a dropped one has stopped)
            self.serve_pulls(self.steps)
            self.settle_outbox(set(self.dropped))
        return self.losses[clock]

    def settle_outbox(self, gone: set) -> None:
        """Wait for every reply sent, but those to the workers `gone` (dropped, or silent:
        maybe stopped): a reply too big to go eagerly would wait for that worker to receive
        it, so those sends are left to MPI (kept referenced in `abandoned`)."""
        for requests, (header, _) in self.outbox:
            if int(header[0]) in gone:  # a reply header's first field: the worker it goes to
                self.ps.abandoned += requests
            else:
                p2p.waitall(self.ps, requests, [None] * len(requests))
        self.outbox = []

    def serve_pulls(self, clock: int) -> None:
        """Serve until every live worker's pull for `clock` (or a later one) is answered."""
        while min((self.answered[w] for w in self.live), default=clock) < clock:
            self.serve_one()

    def serve_one(self) -> None:
        wait = min(1.0, self.timeout)  # look for silence this often, busy or not: the
        if time.monotonic() - self.looked > wait:  # others' pushes must not hide a silent one
            self.look_for_silence()
        got = messages.next_header(self.ps, self.header, wait)
        if got is None:
            self.look_for_silence()
            return
        tag, h = got
        self.heard[h.worker] = time.monotonic()
        if tag == PUSH:
            self.on_push(h)
        elif tag == PULL:
            self.pending.append(h)
        self.answer_pulls()

    def on_push(self, h: Header) -> None:
        w = h.worker
        resent = h.clock < self.done[w]
        ignored = resent or w not in self.live  # a dropped worker's pushes are ignored too
        buf = self.scratch if ignored else self.inbox[w if self.bsp else 0]
        messages.recv_push_data(self.ps, buf, w)
        self.duplicates += resent
        if ignored:
            return
        self.done[w] = h.clock + 1
        self.pushed.setdefault(h.clock, []).append((w, h.share, h.loss, h.lr, h.version))
        if not self.bsp:
            self.record_staleness(h.clock - h.version)
            if math.isfinite(h.loss):
                self.apply(buf, h.lr * h.share)
        self.advance()

    def advance(self) -> None:
        """Close every clock that each live worker has pushed: its loss (and BSP's update)."""
        while self.live and min(self.done[w] for w in self.live) > self.complete:
            c = self.complete
            reports = sorted(r for r in self.pushed.pop(c) if r[0] in self.live)
            loss = sum(share * local for _, share, local, _, _ in reports)
            loss /= sum(share for _, share, _, _, _ in reports)
            if self.bsp:
                for _, _, _, _, version in reports:
                    self.record_staleness(c - version)  # 0: BSP has no other
                self.apply_clock(reports, loss)
            self.losses.append(loss)
            self.complete += 1

    def apply_clock(self, reports, loss: float) -> None:
        """BSP: the global mean gradient, in worker order; clipped by the global norm."""
        g = self.scratch
        g[...] = 0
        for w, share, _, _, _ in reports:
            g += share * self.inbox[w]
        # every server computes the same loss, so all skip together (no reduction hangs)
        if not math.isfinite(loss):
            return
        if self.grad_clip:  # the norm over every server's shard: one allreduce
            self.param.grad = g
            clip_global_norm([self.param], self.grad_clip, self.server_group)
        self.apply(g, reports[0][3])

    def apply(self, g: np.ndarray, lr: float) -> None:
        self.param.grad = g
        self.optimizer.lr = lr
        self.optimizer.step()
        self.param.grad = None

    def record_staleness(self, s: int) -> None:
        self.histogram[min(max(s, 0), len(self.histogram) - 1)] += 1

    # ---- pulls ------------------------------------------------------------------------------
    def answer_pulls(self) -> None:
        last_clock = self.steps
        waiting = []
        for h in self.pending:
            if h.clock >= last_clock:  # the last pull: once every push is in
                wait = self.complete < last_clock
            else:  # a dropped worker is answered at once
                wait = h.worker in self.live and self.complete < h.clock - self.bound
            if wait:
                waiting.append(h)
                continue
            self.send_reply(h, self.complete)
            self.answered[h.worker] = h.clock
        self.pending = waiting
        self.outbox = [sent for sent in self.outbox if not _done(sent[0])]

    def send_reply(self, h: Header, version: int) -> None:
        loss = self.losses[self.complete - 1] if self.complete else math.nan
        stop = DROPPED if h.worker in self.dropped else 0.0  # told to stop
        reply = Header(h.worker, h.clock, self.lo, self.hi, version, loss, stop)
        self.outbox.append(messages.reply(self.ps, h.worker, reply, self.param.data))

    # ---- resuming ---------------------------------------------------------------------------
    # Taken between clocks under BSP, every worker at the same clock and no message in flight.
    def state_dict(self, clock: int) -> dict:
        """This server's state at `clock` (after serving the workers' pulls for it, still
        coming): its shard, optimizer, and the clocks it has seen."""
        self.serve_pulls(clock)
        return {
            "shard": self.param.data.copy(),
            "optimizer": self.optimizer.state_dict(),
            "done": list(self.done),
            "complete": self.complete,
            "losses": list(self.losses),
        }

    def load_state_dict(self, state: dict, clock: int) -> None:
        self.param.data[...] = state["shard"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.done, self.complete, self.losses = (
            list(state["done"]),
            state["complete"],
            state["losses"],
        )
        self.answered = [clock] * len(self.done)

    # ---- silence ----------------------------------------------------------------------------
    def look_for_silence(self) -> None:
        """A live worker we wait for (no pull pending, not finished) silent past the timeout."""
        now, timeout = time.monotonic(), self.timeout
        self.looked = now
        speaks = self.ps.rank == len(self.done)  # the first server (rank n_workers) says it
        asking = {h.worker for h in self.pending}
        for w in list(self.live):
            finished = self.answered[w] >= self.steps
            if w in asking or finished or now - self.heard[w] <= timeout:
                continue
            if self.bsp:
                for h in self.pending:  # tell every waiting worker who stopped
                    self.send_reply(h, -1 - w)
                self.settle_outbox({w})  # its last reply may be waiting for it
                message = lost_message(w, self.ps.rank, timeout)
                raise WorkerLost(message, reported_elsewhere=not speaks)
            self.live.remove(w)
            self.dropped.append(w)
            self.dropped_at[w] = self.complete
            if speaks:
                print(
                    f"minidp: warning: server rank {self.ps.rank}: worker {w} sent nothing for "
                    f"{timeout:g} s; dropped, training goes on with {len(self.live)} workers",
                    file=sys.stderr,
                    flush=True,
                )
            self.advance()
            self.answer_pulls()


def lost_message(worker: int, server_rank: int, timeout: float) -> str:
    return (
        f"worker {worker} (rank {worker}) sent nothing to server rank {server_rank} for "
        f'{timeout:g} s: under consistency="bsp" no clock can complete without it'
    )


def _done(requests) -> bool:
    return all(r.Test() for r in requests)
