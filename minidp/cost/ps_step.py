"""The parameter server's step in the step model (minidp/cost/step.py): `--strategy ps
--servers S --consistency bsp|asp|ssp:K`, W = P - S workers.

    from minidp.cost.ps_step import predict_ps
    p = predict_ps(workers=2, servers=1, params=116_480, compute=compute, net=network,
                   batch_size=16, clip=True, bound=math.inf)        # ASP; None: BSP

The messages of one step (parallel/param_server/messages.py), Ψ parameters of b bytes,
server s holding Ψ_s (chunk_range of Ψ over S), headers of 8 float64s (64 bytes):

    worker      to every server: a PUSH header and its Ψ_s of the gradient, a PULL header:
                Ψb + 2S·64 bytes
    server s    to every worker: a REPLY header and its shard, W (64 + Ψ_s b); under BSP
                with --grad-clip the servers allreduce one float64 (the norm); once per
                run, after the last clock: the dropped-worker mask, W int64s allreduced
                among the servers, and the first server's MEMBERS, W int64s to each worker

The same under ASP and SSP: a worker pushes once and pulls once per step, and each pull is
answered once, only later or sooner; the one difference is the norm's allreduce, which only
BSP has (ASP/SSP workers clip their own gradient, on their own). Bytes are exact against
the run's `bytes_sent_by_axis` (axis "dp": the workers split the batch), the once-per-run
part given apart (`bytes_per_run`).

Time, on a worker, with one message m = 2α + (64 + Ψ_s b)β (a header and the largest
shard: that server is the last to answer) and u = the measured optimizer step scaled to
Ψ_s (the servers step, not the workers):

    compute     forward and backward of the whole model on its B / W examples (step.py's
                scaling), no optimizer

    BSP         every worker waits for every push: the server receives W pushes one after
                another, steps once (u, and the clip's allreduce), sends W replies
                    step = compute + 2W·m + u + norm + per call
    ASP         no wait for the others: a worker's push, the server's update with it alone,
                the reply: compute + 2m + u. But the server serves one push at a time,
                each costing it 2m + u (receive, update, reply), so W workers cannot step
                faster than it serves them:
                    step = max(compute + 2m + u, W (2m + u)) + per call
                with compute on this worker's own examples
    SSP:K       a worker may be K clocks ahead of the slowest, never more. With equal
      K >= 1    workers the bound never binds in steady state: the step is ASP's. With
                unequal shares (B / W not whole) the slowest sets everyone's pace over a
                run: compute is the largest share's (rank 0's: chunk_bounds gives it the
                extra examples)
      K = 0     every pull waits for every push, as BSP; each push is its own update,
                applied as it comes, so only the last one's is in the wait (ssp:0
                measured as bsp: docs/cost_model.md):
                    step = compute + 2W·m + u + per call

    a sleeper   --ps-slow-worker-ms: the last worker sleeps slow_s before each forward,
                a slow worker on purpose. Under ASP it slows that worker alone (its
                compute + slow_s); under BSP and SSP:0 every clock waits for its push, and
                under SSP:K the others run at most K clocks ahead, so over a run its pace
                is everyone's: compute = max(compute, the sleeper's compute + slow_s).
                The sleep frees its core: ranks sharing cores stretch the compute, not it

    step = that · stretch (ranks sharing cores); exposed communication = step - compute
    (the worker waits through the rest)

Staleness (the record's `staleness_histogram`: an update's clock minus the clocks complete
in the parameters it was computed on), under ASP and SSP:K >= 1 (BSP, SSP:0: none):

    equal workers    taking turns, each push misses the W - 1 others' made between its
                     pull and it (ps-lite's delay, in updates); in clocks, the reply to the
                     last of a turn holds the whole clock (its next push: 0), the others'
                     miss one (1): a mean of (W - 1) / W
    unequal ones     (B / W not whole: a worker with fewer examples steps every t_w, the
                     slowest every t_s) the faster drift ahead: at its clock c a worker is
                     about c (1 - t_w / t_s) clocks ahead of the slowest (at least 1, at
                     most K: SSP's bound), so under ASP staleness grows with the run

    mean = Σ over workers but the slowest, clocks c = 1 .. n-1, of
           min(K, max(1, ⌈c (1 - t_w / t_s)⌉)), over W·n updates        (`mean_staleness`)

with t_w each worker's own step (`paces`: ASP's, while the workers and not the server set
the pace). Ranks outnumbering cores do not take turns (the scheduler lets one run ahead a
while): there the measured mean is higher.

Memory: a worker's parameters, its gradients twice (the model's and the flat vector it
pushes), no optimizer; a server's shard, the pushes it holds (BSP: one per worker until
the clock is complete; ASP/SSP: one, applied at once) and two moments of the shard
(AdamW's; SGD with momentum holds one).
"""

import math

from minidp import cost
from minidp.cost.step import Compute, Network, Prediction
from minidp.tools.chunks import chunk_bounds
from minidp.tools.meter import AXES

HEADER_BYTES = 64  # messages.Header: eight float64 fields


def shard_sizes(params: int, servers: int) -> list[int]:
    bounds = chunk_bounds(params, servers)
    return [bounds[s + 1] - bounds[s] for s in range(servers)]


def bytes_by_axis(workers, servers, params, itemsize, rank=0, clip=True) -> dict:
    """{axis: bytes} rank `rank` sends in one step, all on dp (servers: ranks W..P-1);
    clip: the servers allreduce the norm (BSP with --grad-clip; never under ASP/SSP)."""
    if rank < workers:
        sent = params * itemsize + 2 * servers * HEADER_BYTES
    else:
        s = rank - workers
        sent = workers * (HEADER_BYTES + shard_sizes(params, servers)[s] * itemsize)
        if clip and servers > 1:
            sent += cost.sent("allreduce", "auto", servers, s, 1, 8).bytes
    return {**dict.fromkeys(AXES, 0), "dp": sent}


def bytes_per_run(workers, servers, rank=0) -> int:
    """What rank `rank` sends once per run, after the last clock (the membership)."""
    if rank < workers:
        return 0
    s = rank - workers
    mask = cost.sent("allreduce", "auto", servers, s, workers, 8).bytes if servers > 1 else 0
    return mask + (workers * workers * 8 if s == 0 else 0)


def share(compute: Compute, examples: int) -> float:
    """The fraction of the measured forward and backward that `examples` examples take
    (step.py's scaling: the fixed part whole, the rest in proportion)."""
    return compute.fixed + (1 - compute.fixed) * examples / compute.examples


def examples_of(rank: int, workers: int, batch_size: int, bound: float | None) -> int:
    """The examples whose compute sets rank `rank`'s step: under ASP a worker's own share,
    else the largest (BSP waits for it; SSP's slowest sets the pace; a server's clock)."""
    chunks = chunk_bounds(batch_size, workers)
    own = rank < workers and bound == math.inf
    return chunks[rank + 1] - chunks[rank] if own else chunks[1]


def paces(
    p: Prediction, workers: int, batch_size: int, rank: int, bound: float, slow_s: float = 0.0
) -> list:
    """Each worker's own step under ASP/SSP, from rank `rank`'s prediction `p`: its compute
    scaled to each worker's share (the last worker's sleep, slow_s, added to its own), the
    messages and update alike; the server's step for all when the server sets the pace."""
    rest = p.comm_s + p.optimizer_s
    used = examples_of(rank, workers, batch_size, bound)
    chunks = chunk_bounds(batch_size, workers)
    work = p.forward_s + p.backward_s  # on `used` examples
    own = [work * (chunks[w + 1] - chunks[w]) / used + rest for w in range(workers)]
    own[-1] += slow_s  # --ps-slow-worker-ms: the last worker sleeps every step
    if p.step_s > (p.compute_s + rest) * (1 + 1e-9):  # the server's pace: everyone's
        return [max(p.step_s, mine) for mine in own]  # (the sleeper's, if slower still)
    return own


def mean_staleness(paces: list, steps: int, bound: float | None = None) -> float:
    """The staleness histogram's predicted mean (clocks) over `steps` clocks of workers that
    step every paces[w] seconds; bound None (BSP), K (SSP:K) or math.inf (ASP). The module
    docstring says why."""
    if not bound:
        return 0.0
    slowest = max(paces)
    last = paces.index(slowest)  # its pushes come last: every one sees the whole clock
    total = 0
    for w, t in enumerate(paces):
        if w != last:
            ahead = 1 - t / slowest
            total += sum(min(bound, max(1, math.ceil(c * ahead))) for c in range(1, steps))
    return total / (len(paces) * steps)


def predict_ps(
    *,
    workers: int,
    servers: int,
    params: int,
    compute: Compute,
    net: Network,
    batch_size: int,
    clip: bool,
    itemsize: int = 4,
    activations: int = 0,
    rank: int = 0,
    bound: float | None = None,
    slow_s: float = 0.0,
) -> Prediction:
    """The predicted step of rank `rank`; bound: None for BSP, K for SSP:K, math.inf for
    ASP (the module docstring says each term). clip: the servers' norm allreduce (BSP).
    slow_s: the last worker sleeps this long every step (--ps-slow-worker-ms)."""
    W, S = workers, servers
    scale = share(compute, examples_of(rank, W, batch_size, bound))
    forward, backward = compute.forward_s * scale, compute.backward_s * scale
    chunks = chunk_bounds(batch_size, W)
    sleeper = (compute.forward_s + compute.backward_s) * share(compute, chunks[W] - chunks[W - 1])
    shard = max(shard_sizes(params, S))
    message = 2 * net.alpha + (HEADER_BYTES + shard * itemsize) * net.beta
    update = compute.optimizer_s * shard / compute.params
    norm = cost.time("allreduce", "auto", S, 1, 8, alpha=net.alpha, beta=net.beta) or 0.0
    norm = norm + net.per_call if clip and S > 1 and bound is None else 0.0
    stretch = max(1.0, (W + S) / net.cores) if net.cores else 1.0
    own = (forward + backward) * stretch  # the compute that sets this rank's step
    if slow_s and bound == math.inf:  # ASP: each at its own pace; the sleeper's is its own
        own += slow_s if rank == W - 1 else 0.0
    elif slow_s:  # BSP, SSP: the clock (or, over a run, the pace) waits for the sleeper
        own = max(own, sleeper * stretch + slow_s)  # the sleep frees its core: not stretched
    if not bound:  # BSP, SSP:0: W pushes, one update (SSP:0: the last push's), W replies
        messages, optimizer = 2 * W * message, update
        step = own + (messages + optimizer + norm) * stretch  # (no norm but BSP's)
    else:  # ASP, SSP:K>=1: the worker's own round trip, or the server's pace
        messages, optimizer = 2 * message, update
        step = max(own + (messages + optimizer) * stretch, W * (messages + optimizer) * stretch)
    step, compute_s = step + net.per_call * stretch, own
    on_server = rank >= W
    mine = shard_sizes(params, S)[rank - W] if on_server else params
    held = (W if bound is None else 1) if on_server else 2  # pushes held; a worker's two
    return Prediction(
        step_s=step,
        compute_s=compute_s,
        comm_s=(messages + norm + net.per_call) * stretch,
        exposed_comm_s=step - compute_s,
        bytes_by_axis=bytes_by_axis(W, S, params, itemsize, rank, clip and bound is None),
        memory_bytes={
            "parameters": itemsize * mine,
            "gradients": held * itemsize * mine,
            "optimizer": 2 * itemsize * mine if on_server else 0,
            "activations_peak": 0 if on_server else activations,
        },
        forward_s=forward * stretch,
        backward_s=backward * stretch,
        optimizer_s=optimizer * stretch,
    )
