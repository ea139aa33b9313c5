"""`python -m minidp predict` for the parameter server: `--strategy ps --servers S
--consistency bsp|asp|ssp:K`, fed to minidp/cost/ps_step.py.

    python -m minidp predict --strategy ps --servers 1 --world 3 [--consistency asp]

As predict.py does for the others: the whole model's forward, backward and optimizer step
measured here on one worker's examples (B / W); the optimizer's time scaled to the largest
shard (the servers step it); --ps-slow-worker-ms, the last worker's sleep, added as
ps_step.py says.
"""

import numpy as np

from minidp.cli.training.config import BadConfig, staleness_bound
from minidp.cost.ps_step import predict_ps
from minidp.cost.step import Layout
from minidp.models.tasks import Task
from minidp.tools.chunks import chunk_bounds


def ps_layout(config, world: int) -> Layout:
    """The Layout of a parameter-server run on `world` ranks; BadConfig if not covered."""
    staleness_bound(config.consistency)  # a bad --consistency: one line
    if not 1 <= config.servers < world:
        raise BadConfig(f"--servers {config.servers} in a world of {world}: 1 to {world - 1}")
    return Layout("ps", dp=world - config.servers, servers=config.servers,
                  clip=config.grad_clip > 0, consistency=config.consistency)  # fmt: skip


def run_ps_prediction(config, layout: Layout, *, network, threads: int, rank: int = 0):
    """The Prediction for rank `rank` of a parameter-server run; compute measured here."""
    from threadpoolctl import threadpool_limits

    from minidp.cost.predict_compute import measure_compute
    from minidp.tools.memory import activation_estimate

    task = Task(config, np.dtype(config.dtype))
    examples = chunk_bounds(config.batch_size, layout.dp)[1]
    with threadpool_limits(limits=threads, user_api="blas"):
        compute = measure_compute(task, config, examples)
    return predict_ps(
        workers=layout.dp,
        servers=layout.servers,
        params=compute.params,
        compute=compute,
        net=network,
        batch_size=config.batch_size,
        clip=layout.clip,
        itemsize=np.dtype(config.dtype).itemsize,
        activations=activation_estimate(config, examples, 1),
        rank=rank,
        bound=None if config.consistency == "bsp" else staleness_bound(config.consistency),
        slow_s=config.ps_slow_worker_ms / 1e3,
    )
