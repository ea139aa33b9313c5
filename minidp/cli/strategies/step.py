"""The step skeleton from the flags: parallel/step.py's `Step` (the one training step every
recipe runs: micro-batches under no_sync, the sync, the global loss, the finite check,
clip, the optimizer, hooks) with --batch-size, --grad-accum and --grad-clip, and the check
that every rank's slice has its --grad-accum micro-batches.
"""

from minidp import comm
from minidp.cli.training.config import BadConfig
from minidp.parallel.amp import GradScaler
from minidp.parallel.step import Step


def check_micro_batches(config, dp_size: int) -> None:
    """BadConfig unless every rank's slice has at least --grad-accum examples (found alike on
    every rank, before any message)."""
    B, K = config.batch_size, config.grad_accum
    if B // dp_size < K:
        raise BadConfig(
            f"--batch-size {B} over {dp_size} ranks leaves {B // dp_size} "
            f"examples per rank, fewer than --grad-accum {K} micro-batches"
        )


OVERLAP = {"auto": "auto", "on": True, "off": False}  # --overlap -> the pieces' overlap=


def step_from(config, loss, sync, optimizer, dp_group: comm.Group, timeline, clip, *, job, **hooks):
    """The skeleton with the config's global batch, --grad-accum, --grad-clip (`clip` runs
    only where --grad-clip is set) and --precision fp16's loss scaler, whose overflow every
    rank of `job` (the recipe's whole group) agrees on; `hooks`: Step's before, after_sync,
    after_step."""
    return Step(
        *(loss, sync, optimizer),
        batch_size=config.batch_size,
        grad_accum=config.grad_accum,
        dp_group=dp_group,
        timeline=timeline,
        clip=clip if config.grad_clip else None,
        scaler=scaler_from(config, job),
        **hooks,
    )


def scaler_from(config, job: comm.Group) -> GradScaler | None:
    """--precision fp16: a loss scaler (torch's defaults) agreed over `job`; else None."""
    return GradScaler(group=job) if config.precision == "fp16" else None
