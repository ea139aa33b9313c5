"""`python -m minidp predict` for the pipeline: `--strategy pp`, and `--strategy hybrid
--dp D --tp T --pp P [--cp C] [--zero-stage 1] [--recompute]`, fed to cost/pp_step.py.

    python -m minidp predict --strategy pp --world 4 --n-layer 4 --schedule gpipe
    mpiexec -n 2 python -m minidp --strategy pp --micro-batches 4 --json F   # F: predicted_*

As predict.py does for the others: the whole model's forward, backward and optimizer step
measured here on one replica's examples (B / dp), and on half of them for the part that
does not shrink with the work (`fixed_part`: each micro-batch pays every op's own cost
again); the GPT's sizes from its configuration; one stage's activations of one micro-batch
from memory.activation_estimate on the first stage's blocks.
"""

from dataclasses import replace

import numpy as np

from minidp.cost.pp_step import micro_rows, predict_pipeline
from minidp.cost.step import Layout, fixed_part
from minidp.models.tasks import Task
from minidp.tools.chunks import chunk_bounds


def uses_pipeline(config) -> bool:
    return config.strategy == "pp" or (config.strategy == "hybrid" and config.pp > 1)


def pipeline_layout(config, world: int) -> Layout:
    """The Layout of a pipeline run on `world` ranks; BadConfig (one line) if not covered."""
    from minidp.cli.strategies.pp import pipeline_mesh

    dp, tp, pp = pipeline_mesh(config, world)
    return Layout(
        config.strategy,
        dp=dp,
        tp=tp,
        pp=pp,
        zero_stage=config.zero_stage,
        recompute=config.recompute,
        algo=config.allreduce,
        bucket_mb=config.bucket_mb,
        schedule=config.schedule,
        micro_batches=config.micro_batches,
        virtual=config.virtual,
        clip=config.grad_clip > 0,
        cp=config.cp if config.strategy == "hybrid" else 1,  # StagesOverCP inside each stage
        cp_algo=config.cp_algo,
    )


def run_pipeline_prediction(config, layout: Layout, *, network, threads: int, rank: int = 0):
    """The Prediction for mesh rank `rank` of a pipeline run; compute measured here."""
    from threadpoolctl import threadpool_limits

    from minidp.cost.predict_compute import measure_compute
    from minidp.tools.memory import activation_estimate

    task = Task(config, np.dtype(config.dtype))
    examples = chunk_bounds(config.batch_size, layout.dp)[1]  # the first replica's
    with threadpool_limits(limits=threads, user_api="blas"):
        compute = measure_compute(task, config, examples)
        if examples >= 2:  # the part a smaller micro-batch does not shorten
            half = measure_compute(task, config, examples // 2)
            compute = compute._replace(fixed=fixed_part(compute, half))
    itemsize = np.dtype(config.dtype).itemsize
    gpt = (config.n_layer, config.n_embd, task.model.config.vocab_size, config.block_size)
    stages = layout.pp * layout.virtual
    first_blocks = chunk_bounds(config.n_layer, stages)[1]
    rows = micro_rows(layout, config.batch_size, 0)[0]
    activations = activation_estimate(replace(config, n_layer=first_blocks), rows, layout.tp)
    if config.recompute:  # each block keeps its input only (recompute.py), and the output
        activations = (first_blocks + 1) * rows * config.block_size * config.n_embd * itemsize
    return predict_pipeline(
        layout,
        gpt,
        compute,
        network,
        batch_size=config.batch_size,
        itemsize=itemsize,
        activations=activations,
        rank=rank,
    )
