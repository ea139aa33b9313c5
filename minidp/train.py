"""The training loop: `python -m minidp train` (see config.py for every flag).

    python -m minidp                             # the tiny GPT on one process
    mpiexec -n 4 python -m minidp                # the same job, data parallel over 4 ranks
    python -m minidp --model mlp --steps 200     # an MLP on the synthetic clusters

It reads top to bottom: build the data, the model and the optimizer from one seed (so every
rank holds the same model); wrap the model for data parallelism; then for each step take
this rank's slice of the global batch, forward, backward (gradients are averaged across the
ranks while backward runs), clip, step, log. With one process the same code trains alone.
"""

import contextlib
import json
import math
import os
import time
from dataclasses import asdict

import numpy as np

from minidp import comm, data, nn, optim
from minidp.autograd import Tensor, no_grad
from minidp.chunks import chunk_range
from minidp.config import BadConfig, TrainConfig
from minidp.info import blas_info, mpi_library
from minidp.log import RankLog, print0
from minidp.parallel import DistributedDataParallel
from minidp.trace import Timeline


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


class Task:
    """A model with its data: how to read a batch and how to score it."""

    def __init__(self, config: TrainConfig, dtype):
        self.config = config
        if config.model == "gpt":
            self.train_tokens, self.val_tokens, self.tokenizer = data.char_corpus()
            self.gpt_config = nn.GPTConfig(
                vocab_size=self.tokenizer.vocab_size,
                block_size=config.block_size,
                n_layer=config.n_layer,
                n_head=config.n_head,
                n_embd=config.n_embd,
                dropout=config.dropout,
            )
            self.model = nn.GPT(self.gpt_config, seed=config.seed, dtype=dtype)
            self.num_examples = len(self.train_tokens) - config.block_size  # window starts
            self.unit = "tokens"
            self.items_per_example = config.block_size
        else:
            self.x_train, self.y_train, self.x_val, self.y_val = data.classification(
                seed=config.seed, dtype=dtype
            )
            sizes = [self.x_train.shape[1], config.hidden, config.hidden, 10]
            self.model = nn.MLP(sizes, rng=np.random.default_rng(config.seed), dtype=dtype)
            self.num_examples = len(self.x_train)
            self.unit = "examples"
            self.items_per_example = 1

    def batch(self, indices: np.ndarray, split: str = "train"):
        """(inputs, targets) for the examples at `indices`."""
        if self.config.model == "gpt":
            tokens = self.train_tokens if split == "train" else self.val_tokens
            return data.lm_batch(tokens, indices, self.config.block_size)
        if split == "train":
            return Tensor(self.x_train[indices]), self.y_train[indices]
        return Tensor(self.x_val[indices]), self.y_val[indices]

    def loss(self, inputs, targets) -> Tensor:
        return nn.cross_entropy(self.model(inputs), targets)

    def validation_loss(self) -> float:
        """Mean loss over `eval_batches` fixed batches of the validation split."""
        rng = np.random.default_rng(self.config.seed + 1)
        limit = (
            len(self.val_tokens) - self.config.block_size
            if self.config.model == "gpt"
            else len(self.x_val)
        )
        self.model.eval()
        with no_grad():
            losses = [
                self.loss(*self.batch(rng.integers(0, limit, self.config.batch_size), "val")).item()
                for _ in range(self.config.eval_batches)
            ]
        self.model.train()
        return float(np.mean(losses))

    def sample(self) -> str | None:
        if self.config.model != "gpt" or self.config.sample_tokens == 0:
            return None
        prompt = np.array([self.tokenizer.encode("\n")])
        out = self.model.generate(
            prompt, self.config.sample_tokens, np.random.default_rng(self.config.seed)
        )
        return self.tokenizer.decode(out[0, 1:])


def param_l2(model: nn.Module) -> float:
    """Global L2 norm of all parameters (float64 accumulation)."""
    return math.sqrt(sum(float(np.vdot(p.data, p.data)) for p in model.parameters()))


def max_param_difference(model: nn.Module, group: comm.Group) -> float:
    """max over parameters of (largest - smallest value across ranks): 0.0 when in sync."""
    flat = np.concatenate([p.data.ravel() for p in model.parameters()]).astype(np.float64)
    high = comm.allreduce(flat, op="max", group=group)
    low = comm.allreduce(flat, op="min", group=group)
    return float((high - low).max())


def bytes_sent(group: comm.Group) -> int:
    """Data bytes this rank sent on `group` (not the MINIDP_CHECKS fingerprints)."""
    return sum(c["bytes_sent"] for name, c in group.counters.items() if name != "checks")


def train_step(
    ddp: DistributedDataParallel,
    task: Task,
    opt: optim.Optimizer,
    local: np.ndarray,
    global_batch: int,
    grad_accum: int = 1,
    grad_clip: float = 0.0,
    timeline: Timeline | None = None,
) -> tuple[float, float]:
    """One optimizer step of data-parallel training on this rank's examples `local`.

    The local slice is cut into `grad_accum` micro-batches; all but the last run under
    `no_sync()`, so gradients are reduced once per step. Returns (global batch loss, this
    rank's loss). The optimizer step is skipped when the loss is not finite."""
    timeline = timeline or Timeline(enabled=False)
    ddp.zero_grad()
    ddp.set_batch_share(len(local), global_batch)
    local_loss = 0.0
    for k in range(grad_accum):
        lo, hi = chunk_range(len(local), grad_accum, k)
        with ddp.no_sync() if k < grad_accum - 1 else contextlib.nullcontext():
            with timeline.span("forward"):  # weight (m_k / n_r): the sum is the local mean
                loss = task.loss(*task.batch(local[lo:hi])) * ((hi - lo) / len(local))
            with timeline.span("backward"):
                loss.backward()
        local_loss += loss.item()
    with timeline.span("gradient sync wait"):
        ddp.finish_gradient_sync()
    # the global batch's mean loss: sum over ranks of (n_r / B) * (this rank's mean)
    step_loss = float(comm.allreduce(np.array([local_loss * ddp.share]), group=ddp.group)[0])
    if np.isfinite(step_loss):
        with timeline.span("optimizer"):
            if grad_clip:
                optim.clip_grad_norm(ddp.parameters(), grad_clip)
            opt.step()
    return step_loss, local_loss


def blas_threads_per_rank(requested: int) -> int:
    """`requested`, or the cores shared fairly among the ranks on this machine.

    Ranks that outnumber cores must not each start a pool of spinning BLAS threads: with 4
    ranks on 2 cores that alone made training 15x slower here."""
    if requested:
        return requested
    local = next(
        (
            int(os.environ[k])
            for k in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
            if k in os.environ
        ),
        1,
    )
    return max(1, (os.cpu_count() or 1) // local)


def train(config: TrainConfig, group: comm.Group | None = None) -> dict:
    """Train as `config` says over `group` (default: every rank); print progress from rank 0;
    return the final record."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=blas_threads_per_rank(config.threads), user_api="blas"):
        return _train(config, group or comm.world())


def _train(config: TrainConfig, group: comm.Group) -> dict:
    rank, world = group.rank, group.size
    B, K = config.batch_size, config.grad_accum
    if B // world < K:
        raise BadConfig(
            f"--batch-size {B} over {world} ranks leaves {B // world} examples "
            f"per rank, fewer than --grad-accum {K} micro-batches"
        )
    task = Task(config, np.dtype(config.dtype))
    try:
        sampler = data.DistributedSampler(task.num_examples, B, rank, world, seed=config.seed)
    except ValueError as error:  # e.g. a batch larger than the data set: the same on all ranks
        raise BadConfig(f"--batch-size {B}: {error}") from None
    timeline = Timeline(enabled=config.trace is not None)
    ddp = DistributedDataParallel(
        task.model,
        group,
        bucket_cap_mb=config.bucket_mb,
        algo=config.allreduce,
        overlap=not config.no_overlap,
        timeline=timeline,
    )
    opt = optim.AdamW(ddp.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    log = RankLog(config.log_dir, rank)

    print0(
        f"minidp train | model {config.model} ({task.model.num_parameters():,} parameters) | "
        f"strategy {config.strategy} | world size {world} | numpy {np.__version__} | "
        f"{blas_info()}"
    )
    print0(
        f"MPI: {mpi_library()} | allreduce "
        f"{config.allreduce} | buckets {len(ddp.buckets)} of <= {config.bucket_mb} MiB | "
        f"overlap {'on' if ddp.overlap else 'off'} | grad accumulation {K}"
    )
    print0("config: " + " ".join(f"{k}={v}" for k, v in asdict(config).items()))

    records: list[dict] = []
    items_per_step = B * task.items_per_example
    window = {"start": time.perf_counter(), "comm": 0.0, "exposed": 0.0, "bytes": 0, "steps": 0}
    start = time.perf_counter()
    try:  # the communication thread stops and the log closes whatever happens
        for step in range(config.steps):
            opt.lr = optim.warmup_cosine(
                step, config.lr, config.warmup, config.steps, config.min_lr_ratio
            )
            local = sampler.local_indices(step)
            step_loss, local_loss = train_step(
                ddp, task, opt, local, B, K, config.grad_clip, timeline
            )
            if not np.isfinite(step_loss):
                raise TrainingDiverged(
                    f"loss is {step_loss} at step {step}: try a lower --lr "
                    f"(now {config.lr}) or --dtype float64"
                )
            log.write(
                f"step {step} local_examples {len(local)} local_loss {local_loss:.6f} "
                f"global_loss {step_loss:.6f}"
            )

            window["steps"] += 1
            if step % config.log_every == 0 or step == config.steps - 1:
                now = time.perf_counter()
                n, elapsed = window["steps"], now - window["start"]
                comm_s, exposed_s = (
                    ddp.comm_seconds - window["comm"],
                    ddp.exposed_seconds - window["exposed"],
                )
                sent = bytes_sent(ddp.comm_group) - window["bytes"]
                rate = items_per_step * n / elapsed
                print0(
                    f"step {step:5d} | loss {step_loss:.4f} | lr {opt.lr:.2e} | "
                    f"{rate:,.0f} {task.unit}/s | comm {1e3 * comm_s / n:.1f} ms/step "
                    f"({100 * comm_s / elapsed:.0f}%, exposed {1e3 * exposed_s / n:.1f} ms) | "
                    f"{sent / n / 1e6:.2f} MB sent/rank/step"
                )
                records.append(
                    {
                        "step": step,
                        "loss": step_loss,
                        "lr": opt.lr,
                        f"{task.unit}_per_s": rate,
                        "comm_s_per_step": comm_s / n,
                        "exposed_comm_s_per_step": exposed_s / n,
                        "bytes_sent_per_step": sent / n,
                    }
                )
                window = {
                    "start": now,
                    "comm": ddp.comm_seconds,
                    "exposed": ddp.exposed_seconds,
                    "bytes": bytes_sent(ddp.comm_group),
                    "steps": 0,
                }
    finally:
        ddp.close()
        log.close()
    elapsed = time.perf_counter() - start
    val_loss = task.validation_loss()  # identical on every rank: the models are identical
    final = {
        "final_loss": step_loss,
        "val_loss": val_loss,
        "steps": config.steps,
        "world_size": world,
        "strategy": config.strategy,
        "param_l2": param_l2(task.model),
        "max_param_diff": max_param_difference(task.model, group),
        "time_s": elapsed,
        "comm_s": ddp.comm_seconds,
        "exposed_comm_s": ddp.exposed_seconds,
        "bytes_sent_per_rank": bytes_sent(ddp.comm_group),
        "model": config.model,
        "dtype": config.dtype,
        "allreduce": config.allreduce,
    }
    print0(
        f"done: {config.steps} steps in {elapsed:.1f}s | final loss {step_loss:.4f} | "
        f"validation loss {val_loss:.4f} | param L2 {final['param_l2']:.6f}"
    )
    print0(
        f"max |param difference| across ranks: {final['max_param_diff']:.3g} | comm "
        f"{final['comm_s']:.2f}s (exposed {final['exposed_comm_s']:.2f}s) | "
        f"{final['bytes_sent_per_rank'] / 1e6:.1f} MB sent per rank"
    )
    if rank == 0:
        sample = task.sample()
        if sample is not None:
            print0("sample:\n" + sample)
        if config.json:
            with open(config.json, "w") as f:
                for record in [*records, final]:
                    f.write(json.dumps(record) + "\n")
    if config.trace:
        timeline.save(config.trace, group)
        print0(f"timeline: {config.trace} (open in ui.perfetto.dev)")
    return final
