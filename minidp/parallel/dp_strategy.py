"""`--strategy dp`: data parallelism as the training loop drives it (strategy.py).

Every rank holds the whole model and an optimizer of its own (--optimizer: AdamW by
default), and reads its slice of the global batch (its data-parallel coordinate is its
rank). One step, on this rank's examples:

    zero the gradients; weight = n_r / B
    for each of the K micro-batches:           # all but the last under no_sync()
        loss_k = mean loss of micro-batch k * (m_k / n_r)     # the K sum to the local mean
        backward                                # buckets reduced as they fill (overlap)
    finish the gradient sync                    # every rank now holds the mean gradient
    global loss = allreduce(n_r / B * local loss)
    clip by the global norm; optimizer step     # skipped when the loss is not finite

Replicas stay identical bit for bit, so the norm of the gradient and of the parameters are
the same on every rank: each computes them alone, with nothing to gather.

What plugs in: `--compress` and `--prune` replace the bucket allreduce through DDP's
communication hook (compress.py, prune_comm.py); `--compress-on update` runs the optimizer
before the reduction instead (compress_update.py), `--compress-on velocity` momentum SGD's
velocity, DGC's momentum correction (compress_velocity.py). TensorParallel and Hybrid
(tp_strategy.py) derive from this class, with their own `model`, `dp_group`, `loss`,
`after_sync` and `clip_gradients`; ZeRO shares `forward_backward`.
"""

import contextlib

import numpy as np

from minidp import comm, optim
from minidp.chunks import chunk_range
from minidp.config import BadConfig
from minidp.memory import activation_bytes, nbytes, optimizer_bytes
from minidp.parallel.compress import compression_line, compression_record, make_compressor
from minidp.parallel.compress_update import update_step
from minidp.parallel.compress_velocity import MomentumCorrection, velocity_step
from minidp.parallel.data_parallel import DistributedDataParallel
from minidp.parallel.prune_comm import attach_pruner
from minidp.parallel.strategy import (
    StepResult,
    Strategy,
    bytes_sent,
    clip_global_norm,
    global_l2,
    global_loss,
    replica_spread,
)

OVERLAP = {"auto": "auto", "on": True, "off": False}  # --overlap -> DDP's overlap=


def check_micro_batches(config, dp_size: int) -> None:
    """BadConfig unless every rank's slice has at least --grad-accum examples (found alike on
    every rank, before any message)."""
    B, K = config.batch_size, config.grad_accum
    if B // dp_size < K:
        raise BadConfig(
            f"--batch-size {B} over {dp_size} ranks leaves {B // dp_size} "
            f"examples per rank, fewer than --grad-accum {K} micro-batches"
        )


def micro_batches(local: np.ndarray, K: int, reducer, sync: bool = True):
    """(indices, weight m_k / n_r, context) for each of the K micro-batches of this rank's
    slice: all but the last under `reducer.no_sync()`, so the last backward reduces them all
    (the last too when not `sync`: nothing is reduced)."""
    for k in range(K):
        lo, hi = chunk_range(len(local), K, k)
        last = k == K - 1 and sync
        sync_k = contextlib.nullcontext() if last else reducer.no_sync()
        yield local[lo:hi], (hi - lo) / len(local), sync_k


def forward_backward(strategy, local: np.ndarray, reducer, sync: bool = True) -> float:
    """Forward and backward of each micro-batch of `local` (micro_batches), the reduction
    left to `reducer`'s hooks; returns this rank's mean loss. The first call measures the
    graph's activations into `strategy.activations_peak` (every step is alike)."""
    span, local_loss, K = strategy.timeline.span, 0.0, strategy.config.grad_accum
    for indices, weight, sync_k in micro_batches(local, K, reducer, sync):
        with sync_k:
            with span("forward"):  # weight (m_k / n_r): the K losses sum to the local mean
                loss = strategy.loss(indices) * weight
            if strategy._measure:
                strategy.activations_peak = max(strategy.activations_peak, activation_bytes(loss))
            with span("backward"):
                loss.backward()
        local_loss += loss.item()
    strategy._measure = False
    return local_loss


class DataParallel(Strategy):
    """DistributedDataParallel and an optimizer over `group`, with gradient accumulation.

    The optimizer is the config's (--optimizer, AdamW by default, with its lr and weight
    decay) unless `optimizer` is given.
    A scheme that data-parallelizes something else passes `model` (default: task.model) and
    `dp_group` (default: group), and overrides `loss`, `after_sync` and `clip_gradients`."""

    name = "dp"

    def __init__(
        self,
        task,
        config,
        group: comm.Group,
        timeline=None,
        optimizer=None,
        *,
        model=None,
        dp_group: comm.Group | None = None,
    ):
        super().__init__(task, config, group, timeline)
        self.model = task.model if model is None else model
        self.dp_group = dp_group = dp_group or group
        check_micro_batches(config, dp_group.size)
        try:  # --compress: a bad value is found alike on every rank, before any message
            self.compressor = make_compressor(
                config.compress, config.allreduce, config.seed, config.compress_warmup
            )
        except ValueError as error:
            raise BadConfig(str(error)) from None
        self.ddp = DistributedDataParallel(
            self.model,
            dp_group,
            bucket_cap_mb=config.bucket_mb,
            algo=config.allreduce,
            overlap=OVERLAP[config.overlap],
            timeline=self.timeline,
        )
        self.steps_done = 0
        self.optimizer_from_config = optimizer is None  # else the caller's, named by no flag
        self.optimizer = optimizer or optim.make_optimizer(
            config.optimizer, self.model.parameters(), config.lr, config.weight_decay
        )
        self.momentum_correction = None  # --compress-on velocity: DGC's u_w, then C
        if config.compress_on == "velocity":
            momentum = self.optimizer.hyper["momentum"]
            self.momentum_correction = MomentumCorrection(self.compressor, momentum)
            self.ddp.register_comm_hook(self.momentum_correction)
        elif self.compressor is not None:
            self.ddp.register_comm_hook(self.compressor)
        self.pruning = attach_pruner(self.ddp, self.optimizer, config)  # None: no --prune
        self.data_shard = (dp_group.rank, dp_group.size)
        self.activations_peak = 0  # measured on the first step (every step is alike)
        self._measure = True

    def step(self, local: np.ndarray, lr: float) -> StepResult:
        if self.config.compress_on == "update":  # the optimizer before the reduction
            return update_step(self, local, lr)
        if self.config.compress_on == "velocity":  # momentum on each rank, before C
            return velocity_step(self, local, lr)
        ddp, span = self.ddp, self.timeline.span
        self.optimizer.lr = lr
        if self.pruning is not None:  # on the schedule's steps: new masks, before forward
            self.pruning.begin_step()
        ddp.zero_grad()
        ddp.set_batch_share(len(local), self.config.batch_size)
        local_loss = self.backward(local)
        self.steps_done += 1
        with span("gradient sync wait"):
            ddp.finish_gradient_sync()
            self.after_sync()
        step_loss = global_loss(local_loss, ddp.share, self.dp_group)
        if np.isfinite(step_loss):
            with span("optimizer"):
                if self.config.grad_clip:
                    self.clip_gradients()
                self.optimizer.step()
        return StepResult(step_loss, local_loss)

    def backward(self, local: np.ndarray, sync: bool = True) -> float:
        """Forward and backward over the K micro-batches of this rank's examples: all but
        the last under no_sync(), the last too unless `sync`. Returns the local mean loss."""
        return forward_backward(self, local, self.ddp, sync)

    def loss(self, indices: np.ndarray):
        """The mean loss over these examples (a Tensor, to backpropagate)."""
        return self.task.loss(*self.task.batch(indices))

    def after_sync(self) -> None:
        """After the data-parallel gradient sync, before clipping (nothing to do here)."""

    def clip_gradients(self) -> None:
        """Replicas: the local gradient norm is the global one."""
        clip_global_norm(self.ddp.parameters(), self.config.grad_clip)

    # ---- what the loop reports -------------------------------------------------------------
    def param_l2(self) -> float:
        return global_l2([p.data for p in self.ddp.parameters()])

    def max_param_diff(self) -> float:
        return replica_spread([p.data for p in self.ddp.parameters()], self.group)

    def bytes_sent_by_axis(self) -> dict[str, int]:
        return {"dp": bytes_sent(self.ddp.comm_group, self.group)}

    @property
    def comm_seconds(self) -> float:
        return self.ddp.comm_seconds

    @property
    def exposed_seconds(self) -> float:
        return self.ddp.exposed_seconds

    def memory_bytes(self) -> dict[str, int]:
        return {
            "parameters": nbytes(p.data for p in self.ddp.parameters()),
            "gradients": nbytes(b.data for b in self.ddp.buckets),
            "optimizer": optimizer_bytes(self.optimizer),
            "activations_peak": self.activations_peak,
            "buffers": self.group.scratch.nbytes
            + self.ddp.comm_group.scratch.nbytes
            + (self.compressor.nbytes() if self.compressor else 0)  # residuals, warm start
            + (self.momentum_correction.nbytes() if self.momentum_correction else 0)  # u_w
            + (nbytes(self.pruning.pruner.masks) if self.pruning else 0)  # 1 byte per weight
            + self.ddp.stage.nbytes(),  # host copies of torch buckets (host_stage.py)
        }

    def describe(self) -> str:
        ddp, config = self.ddp, self.config
        return (
            f"allreduce {config.allreduce} | buckets {len(ddp.buckets)} of <= "
            f"{config.bucket_mb} MiB | overlap {'on' if ddp.overlap else 'off'} "
            f"({ddp.overlap_reason}) | grad accumulation {config.grad_accum} | "
            f"compress {config.compress}"
            + (f" on the {config.compress_on}" if config.compress_on != "gradient" else "")
            + (f" after {config.compress_warmup} steps" if config.compress_warmup else "")
        ) + (f" | {self.pruning.pruner.describe()}" if self.pruning else "")

    def record(self) -> dict:
        return {
            "allreduce": self.config.allreduce,
            "optimizer": self.config.optimizer if self.optimizer_from_config else None,
            "overlap": self.ddp.overlap,
            "buckets": len(self.ddp.buckets),
            "compress_on": self.config.compress_on,
            **self._compression(),
            **(self.pruning.record() if self.pruning else {}),
            **self.ddp.stage.record(),  # --backend torch: the host staging copies
        }

    def summary(self) -> str:
        return compression_line(self._compression()) if self.compressor is not None else ""

    def _compression(self) -> dict:
        sent = bytes_sent(self.ddp.comm_group)  # the comm group carries the buckets only
        return compression_record(
            self.config.compress,
            self.compressor,
            self.ddp.buckets,
            sent,
            self.steps_done,
            self.dp_group.size,
        )

    # ---- resuming -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.compressor is not None:  # error-feedback residuals are training state
            state["compressor"] = self.compressor.state_dict()
        if self.momentum_correction is not None:  # DGC's u_w
            state["velocity"] = self.momentum_correction.state_dict()
        if self.pruning is not None:  # the masks and the schedule's step
            state["prune"] = self.pruning.pruner.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
        if self.momentum_correction is not None:
            self.momentum_correction.load_state_dict(state["velocity"])
        if self.pruning is not None:
            self.pruning.pruner.load_state_dict(state["prune"])

    def close(self) -> None:
        self.ddp.close()
