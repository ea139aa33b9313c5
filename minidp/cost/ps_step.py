"""The parameter server's step under BSP in the step model (minidp/cost/step.py):
`--strategy ps --servers S --consistency bsp`, W = P - S workers.

    from minidp.cost.ps_step import predict_ps
    p = predict_ps(workers=2, servers=1, params=116_480, compute=compute, net=network,
                   batch_size=16, clip=True)

The messages of one step (parallel/param_server/messages.py), Ψ parameters of b bytes,
server s holding Ψ_s (chunk_range of Ψ over S), headers of 8 float64s (64 bytes):

    worker      to every server: a PUSH header and its Ψ_s of the gradient, a PULL header:
                Ψb + 2S·64 bytes
    server s    to every worker: a REPLY header and its shard, W (64 + Ψ_s b); under BSP
                with --grad-clip the servers allreduce one float64 (the norm); once per
                run, after the last clock: the dropped-worker mask, W int64s allreduced
                among the servers, and the first server's MEMBERS, W int64s to each worker

Bytes are exact against the run's `bytes_sent_by_axis` (axis "dp": the workers split the
batch), the once-per-run part given apart (`bytes_per_run`).

Time, on a worker (BSP: every worker's step waits for every push):

    compute     forward and backward of the whole model on its B / W examples (step.py's
                scaling), no optimizer (the servers step)
    push        server s receives W pushes one after another: W (2α + (64 + Ψ_s b) β)
    server      the measured optimizer step scaled to Ψ_s, the clip's allreduce
    reply       W replies one after another: W (2α + (64 + Ψ_s b) β)

    step = (compute + push + server + reply + per call) · stretch, for the largest shard;
    exposed communication = step - compute (the worker waits through the rest)

Memory: a worker's parameters, its gradients twice (the model's and the flat vector it
pushes), no optimizer; a server's shard, its gradients twice (the sum of the pushes and
the optimizer's), and two moments of it (AdamW's; SGD with momentum holds one).
"""

from minidp import cost
from minidp.chunks import chunk_bounds
from minidp.cost.step import Compute, Network, Prediction

HEADER_BYTES = 64  # messages.Header: eight float64 fields


def shard_sizes(params: int, servers: int) -> list[int]:
    bounds = chunk_bounds(params, servers)
    return [bounds[s + 1] - bounds[s] for s in range(servers)]


def bytes_by_axis(workers, servers, params, itemsize, rank=0, clip=True) -> dict:
    """{"dp", "tp", "pp": bytes} rank `rank` sends in one step (servers: ranks W..P-1)."""
    if rank < workers:
        sent = params * itemsize + 2 * servers * HEADER_BYTES
    else:
        s = rank - workers
        sent = workers * (HEADER_BYTES + shard_sizes(params, servers)[s] * itemsize)
        if clip and servers > 1:
            sent += cost.sent("allreduce", "auto", servers, s, 1, 8).bytes
    return {"dp": sent, "tp": 0, "pp": 0}


def bytes_per_run(workers, servers, rank=0) -> int:
    """What rank `rank` sends once per run, after the last clock (the membership)."""
    if rank < workers:
        return 0
    s = rank - workers
    mask = cost.sent("allreduce", "auto", servers, s, workers, 8).bytes if servers > 1 else 0
    return mask + (workers * workers * 8 if s == 0 else 0)


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
) -> Prediction:
    """The predicted BSP step of rank `rank` (the module docstring says each term)."""
    W, S = workers, servers
    examples = chunk_bounds(batch_size, W)[1]
    scale = compute.fixed + (1 - compute.fixed) * examples / compute.examples
    forward, backward = compute.forward_s * scale, compute.backward_s * scale
    shard = max(shard_sizes(params, S))
    one_way = W * (2 * net.alpha + (HEADER_BYTES + shard * itemsize) * net.beta)
    optimizer = compute.optimizer_s * shard / compute.params
    norm = cost.time("allreduce", "auto", S, 1, 8, alpha=net.alpha, beta=net.beta) or 0.0
    norm = norm + net.per_call if clip and S > 1 else 0.0
    stretch = max(1.0, (W + S) / net.cores) if net.cores else 1.0
    compute_s = forward + backward
    step = (compute_s + 2 * one_way + optimizer + norm + net.per_call) * stretch
    on_server = rank >= W
    mine = shard_sizes(params, S)[rank - W] if on_server else params
    return Prediction(
        step_s=step,
        compute_s=compute_s * stretch,
        comm_s=(2 * one_way + norm + net.per_call) * stretch,
        exposed_comm_s=step - compute_s * stretch,
        bytes_by_axis=bytes_by_axis(W, S, params, itemsize, rank, clip),
        memory_bytes={
            "parameters": itemsize * mine,
            "gradients": 2 * itemsize * mine,
            "optimizer": 2 * itemsize * mine if on_server else 0,
            "activations_peak": 0 if on_server else activations,
        },
        forward_s=forward * stretch,
        backward_s=backward * stretch,
        optimizer_s=optimizer * stretch,
    )
