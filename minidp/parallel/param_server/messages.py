"""The parameter server's messages: push, pull and reply, each a tagged header and a payload.

Kept apart from the scheme (strategies/ps.py), as picotron keeps its messaging apart. Every
message is two point-to-point messages from minidp.comm.p2p on the PS group: a header of
eight float64 fields, then the payload, each on its own tag:

    header  worker | clock | lo | hi | version | loss | share | lr      (float64; the
            integers in it are exact below 2**53)

    worker ──PUSH header──► server     clock c, key range [lo, hi), version = the clock of
           ──PUSH_DATA────►            the parameters the gradient was computed on, the
                                       worker's local loss, its share n_r / B and lr
    worker ──PULL header──► server     "send me [lo, hi) once I may compute clock c"
    server ──REPLY header─► worker     version = clocks complete on that server; loss = the
           ──REPLY_DATA───►            global loss of the newest complete clock; the shard;
                                       share = DROPPED when this server has dropped the worker
                                       (it stops: no more pushes, no more pulls)
    server ──MEMBERS──────► worker     after the last clock, from the first server to each
                                       live worker: 1 for each worker the servers dropped
    worker ──BYE──────────► server     a dropped worker that still runs, as it ends

Two messages from one sender on one tag never overtake each other (MPI's order), and the
server receives a header's payload from that sender at once, so a payload is never taken
for another. Pushes and pulls to different servers are posted together (Isend / Irecv),
so they proceed concurrently. Cost of a step, per worker, with S servers and Ψ parameters
of b bytes: 2S headers and Ψb bytes up, S headers and Ψb bytes down; per server, from W
workers: W·Ψb/S bytes in and W·Ψb/S out, the bottleneck that sharding divides by S.
"""

from typing import NamedTuple

import numpy as np

from minidp.comm import p2p
from minidp.comm.errors import CollectiveTimeout

PUSH, PUSH_DATA, PULL, REPLY, REPLY_DATA, MEMBERS, BYE = range(7101, 7108)
DROPPED = -1.0  # a reply's share: this server dropped the worker
FIELDS = ("worker", "clock", "lo", "hi", "version", "loss", "share", "lr")


class Header(NamedTuple):
    worker: int
    clock: int
    lo: int
    hi: int
    version: int = 0
    loss: float = 0.0
    share: float = 0.0
    lr: float = 0.0

    def pack(self) -> np.ndarray:
        return np.array(self, dtype=np.float64)

    @classmethod
    def unpack(cls, buf: np.ndarray) -> "Header":
        w, c, lo, hi, v = (int(x) for x in buf[:5])
        return cls(w, c, lo, hi, v, float(buf[5]), float(buf[6]), float(buf[7]))


class ServerLost(CollectiveTimeout):
    """A server did not answer within the timeout: it died or hangs (a timeout: the command
    line says it in one line, as it does a collective's)."""


def empty_header() -> np.ndarray:
    return np.empty(len(FIELDS), dtype=np.float64)


# ---- worker side ----------------------------------------------------------------------------
def push(group, servers: list[int], shards, grad: np.ndarray, header: Header, versions) -> list:
    """Post the push of `grad` to every server (its key range [lo, hi) of the flat vector,
    versions[i]: the clock of the parameters server i last sent): returns [requests,
    buffers], to wait for before grad is written again."""
    requests, kept = [], []
    for server, (lo, hi), version in zip(servers, shards, versions):
        h = header._replace(lo=lo, hi=hi, version=version).pack()
        kept.append(h)
        requests += [
            p2p.isend(group, h, server, PUSH),
            p2p.isend(group, grad[lo:hi], server, PUSH_DATA),
        ]
    return [requests, kept]


def pull(
    group, servers: list[int], shards, params: np.ndarray, worker: int, clock: int, timeout: float
) -> list[Header]:
    """Ask every server for its shard for clock `clock`; receive them into params[lo:hi]
    (the receives are posted before the requests go out). Returns the servers' reply headers;
    ServerLost when one has not answered within `timeout` seconds."""
    replies = [empty_header() for _ in servers]
    requests, peers = [], []
    for server, (lo, hi), reply in zip(servers, shards, replies):
        requests += [
            p2p.irecv(group, reply, server, REPLY),
            p2p.irecv(group, params[lo:hi], server, REPLY_DATA),
        ]
        peers += [server, server]
    asks = [Header(worker, clock, lo, hi).pack() for lo, hi in shards]
    for server, ask in zip(servers, asks):
        requests.append(p2p.isend(group, ask, server, PULL))
        peers.append(server)
    try:
        p2p.waitall_within(group, requests, peers, timeout)
    except CollectiveTimeout:
        late = [s for i, s in enumerate(servers) if not requests[2 * i].Test()]
        for request, _ in group.receiving.values():  # no reply may land later
            request.Cancel()
            group.abandoned.append(request)
        group.receiving.clear()
        raise ServerLost(
            f"worker {worker} (rank {group.rank}): no reply from server rank(s) "
            f"{late or servers} within {timeout:g} s to the pull for clock {clock}: "
            "a server died or hangs"
        ) from None
    return [Header.unpack(r) for r in replies]


# ---- server side ----------------------------------------------------------------------------
def next_header(group, buf: np.ndarray, timeout: float):
    """Wait (patiently) for the next PUSH or PULL header from any worker; receive it into buf.
    Returns (tag, Header), or None when nothing came within `timeout` seconds."""
    arrival = p2p.probe(group, p2p.ANY_SOURCE, p2p.ANY_TAG, timeout)
    if arrival is None:
        return None
    if arrival.tag not in (PUSH, PULL):
        raise RuntimeError(f"parameter server: unexpected tag {arrival.tag} from {arrival.source}")
    p2p.recv_any(group, buf, arrival.source, arrival.tag)
    return arrival.tag, Header.unpack(buf)


def recv_push_data(group, buf: np.ndarray, worker_rank: int) -> None:
    """The payload of the PUSH header just received from `worker_rank`."""
    p2p.waitall(group, [p2p.irecv(group, buf, worker_rank, PUSH_DATA)], [worker_rank])


def tell_members(group, dropped: np.ndarray) -> None:
    """The first server, after the last clock: the dropped-worker mask (int64, 1 = dropped)
    to every worker, waiting only for the sends to live ones (a dropped one may be dead:
    its send is left to MPI, the request kept)."""
    requests = [p2p.isend(group, dropped, w, MEMBERS) for w in range(len(dropped))]
    live = [w for w in range(len(dropped)) if not dropped[w]]
    p2p.waitall(group, [requests[w] for w in live], live)
    group.abandoned += [requests[w] for w in range(len(dropped)) if dropped[w]]


def dropped_by_servers(group, first_server: int) -> bool:
    """Whether the servers have said (MEMBERS, already here) that this worker was dropped."""
    arrival = p2p.probe(group, first_server, MEMBERS, timeout=0)
    if arrival is None:
        return False
    dropped = np.empty(arrival.nbytes // 8, np.int64)
    p2p.recv_any(group, dropped, first_server, MEMBERS)
    return bool(dropped[group.rank])


def hear_members(group, dropped: np.ndarray, first_server: int, timeout: float) -> None:
    """A live worker, after its last pull: the mask the first server sends, into `dropped`."""
    try:
        p2p.waitall_within(
            group, [p2p.irecv(group, dropped, first_server, MEMBERS)], [first_server], timeout
        )
    except CollectiveTimeout:
        raise ServerLost(
            f"worker rank {group.rank}: server rank {first_server} did not say which workers "
            f"are still in the job within {timeout:g} s after the last clock"
        ) from None


def say_bye(group, first_server: int, timeout: float) -> None:
    """A dropped worker, as it ends: BYE to the first server (which may have stopped
    listening: then the send is left to MPI)."""
    request = p2p.isend(group, np.zeros(1, np.int64), first_server, BYE)
    try:
        p2p.waitall_within(group, [request], [first_server], timeout)
    except CollectiveTimeout:
        group.abandoned.append(request)


def hear_byes(group, workers: list[int], timeout: float) -> list[int]:
    """The first server: wait up to `timeout` for each of `workers` (dropped ones) to say
    BYE; return those that did not (dead, stopped, or slower than that)."""
    bufs = [np.zeros(1, np.int64) for _ in workers]
    requests = [p2p.irecv(group, b, w, BYE) for b, w in zip(bufs, workers)]
    try:
        p2p.waitall_within(group, requests, list(workers), timeout)
        return []
    except CollectiveTimeout:
        silent = [w for w, r in zip(workers, requests) if not r.Test()]
        for request, _ in group.receiving.values():  # no BYE may land later
            request.Cancel()
            group.abandoned.append(request)
        group.receiving.clear()
        return silent


def reply(group, worker_rank: int, header: Header, shard: np.ndarray) -> list:
    """Post the reply to a pull: header and a snapshot of the shard (updates may follow
    before the send completes). Returns [requests, buffers] to keep until they are done."""
    h, snapshot = header.pack(), shard.copy()
    requests = [
        p2p.isend(group, h, worker_rank, REPLY),
        p2p.isend(group, snapshot, worker_rank, REPLY_DATA),
    ]
    return [requests, [h, snapshot]]
