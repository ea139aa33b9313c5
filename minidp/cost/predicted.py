"""A prediction made on the ranks of a run: `python -m minidp predict` under mpiexec, and
the final `--json` record of a command-line run, beside what it measured (the command line
hands `in_record` to the training loop as one of its `adds`: cli/training/loop.py).

    on_group(config, group, network)   collective: (Prediction, Layout, Network)
    in_record(config, group, step_s)   collective, with --json: for_run's fields, or {}
    for_run(config, group, step_s, n)  collective: the record's predicted_* fields, {} if
                                       the step model does not cover the run

On the run's own ranks the model sees what the run saw: every rank measures its compute at
once (the sharing of cores is in the measurement), the per-call cost is timed on the group
(`per_call_seconds`), DDP's buckets go through shared memory only where the run's do (on one
machine, no emulated network), overlap="auto" is decided as the run decides it
(comm_thread.overlap_helps), and an emulated network (MINIDP_NET_*, comm/netem.py) adds its
α and β to the calibrated ones.
"""

import time

import numpy as np

from minidp import comm
from minidp.cli.training.config import BadConfig
from minidp.comm import netem
from minidp.cost.predict import (
    DEFAULT_NETWORK,
    layout_of,
    load_network,
    prediction_record,
    run_prediction,
)
from minidp.cost.step import Compute, Network


def per_call_seconds(group, calls: int = 20) -> float:
    """Collective: what one collective call costs on `group` between stretches of work, as
    a step's are: `calls` rounds of ~1 ms of matmuls then a 1-element allreduce, less the
    same matmuls alone (the caller subtracts the α-β time). Ranks that share cores with
    each other or with other work wait there for a peer not yet scheduled; the mean, not the
    median, as a step pays every wait."""
    a, x = np.ones((96, 96)), np.zeros(1)

    def work():
        for _ in range(8):
            a @ a

    def rounds(sync: bool) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            work()
            if sync:
                comm.allreduce(x, group=group)
        return time.perf_counter() - start

    comm.allreduce(x, group=group)  # every rank here
    alone = rounds(sync=False)
    comm.allreduce(x, group=group)
    synced = rounds(sync=True)
    return max(0.0, synced - alone) / calls


def on_group(config, group, network: Network):
    """Collective: (Prediction, Layout, Network) for `config` on the ranks of `group`, each
    measuring its compute at once (sharing the cores as a run would: no stretch) and the
    per-call cost timed on the group; BadConfig (alike on every rank) if not covered."""
    from minidp import cost
    from minidp.parallel.data_parallel.comm_thread import overlap_helps
    from minidp.tools.info import cores_per_rank

    world = group.size
    layout = layout_of(config, world)  # before any message
    emulated = netem.network()
    if emulated is not None:  # the emulated wire's cost on top of the calibrated one
        alpha, beta = network.alpha + emulated.latency_s, network.beta + emulated.seconds_per_byte
        network = network._replace(alpha=alpha, beta=beta)
    shm = emulated is None and (world == 1 or comm.on_one_machine(group))  # as DDP decides
    overlap = overlap_helps(layout.dp)[0] if config.overlap == "auto" else layout.overlap
    layout = layout._replace(shm=shm, overlap=overlap)
    if world > 1:
        measured = per_call_seconds(group)
        model = cost.time("allreduce", "auto", world, 1, 8, alpha=network.alpha, beta=network.beta)
        network = network._replace(per_call=max(0.0, measured - model))
    threads = config.threads or max(1, int(cores_per_rank()))
    measured = None
    if layout.tp > 1 and layout.pp == layout.cp == 1:  # the TP model itself, on these ranks
        measured = tensor_parallel_compute(config, group, layout, threads)
    prediction, layout = run_prediction(
        config, world, cores=0, network=network, threads=threads, layout=layout,
        rank=group.rank, measured=measured,
    )  # fmt: skip
    return prediction, layout, network


def tensor_parallel_compute(config, group, layout, threads: int) -> Compute:
    """Collective: a TP rank's own compute, measured on the model the run trains (the
    TensorParallelGPT over this mesh's TP group) in the run's micro-batches, its time inside
    the TP collectives taken out. Returned as already split (`fixed` 1: cost/step.py divides
    nothing by tp again): the work TP keeps whole on every rank (LayerNorms, residuals, the
    loss's own parts) is in it."""
    from threadpoolctl import threadpool_limits

    from minidp.cost.predict_compute import Alone, measure_compute
    from minidp.models.tasks import Task
    from minidp.parallel.mesh import Mesh
    from minidp.parallel.tensor_parallel.gpt import TensorParallelGPT

    task = Task(config, np.dtype(config.dtype))
    examples = -(-config.batch_size // layout.dp)  # rank 0's, on every rank alike
    mesh = Mesh(dp=layout.dp, tp=layout.tp, group=group)
    try:
        tp = mesh.tp_group
        model = TensorParallelGPT(task.model, tp, sequence_parallel=config.sequence_parallel)
        with threadpool_limits(limits=threads, user_api="blas"):
            run = Alone(task, model)
            compute = measure_compute(
                run, config, examples, micro=config.grad_accum, inside=lambda: tp.seconds
            )
    finally:
        mesh.close()
    return compute._replace(fixed=1.0)


def shared_network(group) -> Network:
    """Collective: rank 0's calibration (runs/calibration.json) on every rank; the built-in
    defaults if it has none, or one it cannot read (a run never fails for its prediction)."""
    numbers = np.zeros(5)
    if group.rank == 0:
        try:
            network, _ = load_network(None, 0)
        except (BadConfig, OSError, ValueError, KeyError, TypeError):
            network = Network(**DEFAULT_NETWORK)
        numbers[:] = network.alpha, network.beta, network.gamma, network.per_call, network.delta
    alpha, beta, gamma, per_call, delta = comm.broadcast(numbers, root=0, group=group)
    return Network(alpha, beta, gamma, 0, per_call, delta)


def in_record(config, group, measured_step_s: float | None) -> dict:
    """Collective, with --json: the final record's prediction beside the run's measured
    mean step (after the first of this launch), which the command line adds through the
    training loop's `adds` (training/loop.py); {} without --json or a steady step. The
    predicted bytes cover every step, as bytes_sent_by_axis does across a resume on the same
    layout (on another, those counts mix the two layouts': docs/checkpoints.md)."""
    if not config.json or measured_step_s is None:
        return {}
    return for_run(config, group, measured_step_s, config.steps)


def for_run(config, group, measured_step_s: float, steps: int) -> dict:
    """Collective: the final record's prediction of a training run, made on its ranks after
    its last step (on_group); {} for a strategy the model does not cover."""
    try:
        layout_of(config, group.size)  # the same verdict on every rank, before any message
    except BadConfig:
        return {}
    prediction, _, network = on_group(config, group, shared_network(group))
    record = prediction_record(prediction, measured_step_s)
    record["predicted_per_call_s"] = network.per_call
    by_axis = prediction.bytes_by_axis  # beside the run's bytes_sent_by_axis: the run's steps
    record["predicted_bytes_by_axis"] = {axis: b * steps for axis, b in by_axis.items()}
    if config.strategy == "ps":  # and, once per run, the servers' membership messages
        from minidp.cli.training.config import staleness_bound
        from minidp.cost.ps_step import bytes_per_run, mean_staleness, paces

        workers = group.size - config.servers
        record["predicted_bytes_by_axis"]["dp"] += bytes_per_run(
            workers, config.servers, group.rank
        )
        bound = staleness_bound(config.consistency)  # beside the record's histogram; bsp: 0
        slow, batch = config.ps_slow_worker_ms / 1e3, config.batch_size
        each = paces(prediction, workers, batch, group.rank, bound, slow) if bound else []
        record["predicted_staleness_mean"] = mean_staleness(each, config.steps, bound)
    return record
