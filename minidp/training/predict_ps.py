"""`python -m minidp predict` for the parameter server under BSP: `--strategy ps --servers S
--consistency bsp`, fed to minidp/cost/ps_step.py.

    python -m minidp predict --strategy ps --servers 1 --world 3

As predict.py does for the others: the whole model's forward, backward and optimizer step
measured here on one worker's examples (B / W); the optimizer's time scaled to the largest
shard (the servers step it). ASP and SSP are refused: their step is not one of BSP's.
"""

import numpy as np

from minidp.chunks import chunk_bounds
from minidp.cost.ps_step import predict_ps
from minidp.cost.step import Layout
from minidp.training.config import BadConfig
from minidp.training.tasks import Task


def ps_layout(config, world: int) -> Layout:
    """The Layout of a parameter-server run on `world` ranks; BadConfig if not covered."""
    if config.consistency != "bsp":
        raise BadConfig(f"predict covers --strategy ps under --consistency bsp only; got "
                        f"{config.consistency}")  # fmt: skip
    if not 1 <= config.servers < world:
        raise BadConfig(f"--servers {config.servers} in a world of {world}: 1 to {world - 1}")
    if config.ps_slow_worker_ms:
        raise BadConfig("predict does not model --ps-slow-worker-ms")
    return Layout("ps", dp=world - config.servers, servers=config.servers,
                  clip=config.grad_clip > 0)  # fmt: skip


def run_ps_prediction(config, layout: Layout, *, network, threads: int, rank: int = 0):
    """The Prediction for rank `rank` of a BSP parameter-server run; compute measured here."""
    from threadpoolctl import threadpool_limits

    from minidp.training.predict import activation_estimate, measure_compute

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
    )
