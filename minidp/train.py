"""The training loop: `python -m minidp train` (see config.py for every flag).

    python -m minidp --steps 300                 # the tiny GPT on the docstring corpus
    python -m minidp --model mlp --steps 200     # an MLP on the synthetic clusters

It reads top to bottom: build the data, the model and the optimizer from one seed; then for
each step take the global batch from the sampler, forward, backward, clip, step, log.
"""

import json
import math
import time
from dataclasses import asdict

import numpy as np

from minidp import data, nn, optim
from minidp.autograd import Tensor, no_grad
from minidp.config import TrainConfig
from minidp.log import print0


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


def blas_summary() -> str:
    from minidp.bench._common import blas_info

    return blas_info()


def train(config: TrainConfig) -> dict:
    """Train as `config` says; print progress; return the final record."""
    dtype = np.dtype(config.dtype)
    task = Task(config, dtype)
    model = task.model
    opt = optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sampler = data.DistributedSampler(task.num_examples, config.batch_size, seed=config.seed)
    records: list[dict] = []

    print0(
        f"minidp train | model {config.model} ({model.num_parameters():,} parameters) | "
        f"world size 1 | numpy {np.__version__} | {blas_summary()}"
    )
    print0("config: " + " ".join(f"{k}={v}" for k, v in asdict(config).items()))

    items_per_step = config.batch_size * task.items_per_example
    start = window_start = time.perf_counter()
    for step in range(config.steps):
        opt.lr = optim.warmup_cosine(
            step, config.lr, config.warmup, config.steps, config.min_lr_ratio
        )
        loss = task.loss(*task.batch(sampler.local_indices(step)))
        if not np.isfinite(loss.item()):
            raise TrainingDiverged(
                f"loss is {loss.item()} at step {step}: try a lower --lr "
                f"(now {config.lr}) or --dtype float64"
            )
        opt.zero_grad()
        loss.backward()
        if config.grad_clip:
            optim.clip_grad_norm(model.parameters(), config.grad_clip)
        opt.step()

        last = step == config.steps - 1
        if step % config.log_every == 0 or last:
            now = time.perf_counter()
            steps_in_window = (
                step % config.log_every + 1 if last else min(step + 1, config.log_every)
            )
            rate = items_per_step * steps_in_window / (now - window_start)
            window_start = now
            print0(
                f"step {step:5d} | loss {loss.item():.4f} | lr {opt.lr:.2e} | "
                f"{rate:,.0f} {task.unit}/s"
            )
            records.append(
                {"step": step, "loss": loss.item(), "lr": opt.lr, f"{task.unit}_per_s": rate}
            )

    elapsed = time.perf_counter() - start
    val_loss = task.validation_loss()
    final = {
        "final_loss": loss.item(),
        "val_loss": val_loss,
        "steps": config.steps,
        "world_size": 1,
        "strategy": "single",
        "param_l2": param_l2(model),
        "time_s": elapsed,
        "model": config.model,
        "dtype": config.dtype,
    }
    print0(
        f"done: {config.steps} steps in {elapsed:.1f}s | final loss {final['final_loss']:.4f} | "
        f"validation loss {val_loss:.4f} | param L2 {final['param_l2']:.6f}"
    )
    sample = task.sample()
    if sample is not None:
        print0("sample:\n" + sample)
    if config.json:
        with open(config.json, "w") as f:
            for record in [*records, final]:
                f.write(json.dumps(record) + "\n")
    return final
