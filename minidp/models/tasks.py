"""Task: a model together with its data, what the command line's training loop trains.

    task = Task(config, np.float64)         # builds the model from config.seed
    task = Task(config, np.float64, deferred=True)    # its weights as recipes, no values
                                            # (deferred_init: ZeRO-3 draws each rank's shard)
    inputs, targets = task.batch(indices)   # the examples at these positions of the data
    loss = task.loss(inputs, targets)       # mean cross-entropy over them

Two tasks: "gpt", the tiny character-level GPT on the docstring corpus (an example is a
window of block_size tokens, so indices are window starts), and "mlp", an MLP on the
synthetic classification clusters. Every rank builds the same task from the same seed, so
every rank starts with the same model; which examples a rank reads is the strategy's choice.
`config` is anything with TrainConfig's fields (cli/training/config.py): model, seed,
block_size, n_layer, n_head, n_embd, dropout, experts, moe_top_k, capacity_factor,
moe_every, aux_loss_coef, hidden, backend, device, threads, batch_size, eval_batches,
sample_tokens.

With experts (a mixture-of-experts GPT, models/moe/), a training forward's loss adds the
load-balancing loss, and `expert_load` sums the router's counts over the training forwards
(models/moe/load.py's record, with "slots": S a layer, the all-to-alls' width; None without
experts); validation scores the cross-entropy alone.
"""

import numpy as np

from minidp.engine import backend, nn
from minidp.engine.deferred import deferred_init
from minidp.engine.precision import to_half
from minidp.engine.tensor import Tensor, no_grad
from minidp.models import data
from minidp.models.gpt import GPT, GPTConfig
from minidp.models.moe import add_loads, expert_load, load_balancing_loss, moe_layers
from minidp.tools.chunks import chunk_range
from minidp.tools.info import cores_per_rank


class TextTooShort(ValueError):
    """A GPT window longer than the corpus's validation split."""


class Task:
    """A model with its data: how to read a batch and how to score it."""

    def __init__(self, config, dtype, deferred: bool = False):
        self.config = config
        self.experts = config.model == "gpt" and config.experts > 0
        self.expert_load: dict | None = None  # summed over training forwards (experts)
        threads = config.threads or max(1, int(cores_per_rank()))
        backend.use(config.backend, config.device, threads)  # the model is built on the host
        if config.model == "gpt":
            self.train_tokens, self.val_tokens, self.tokenizer = data.char_corpus()
            shortest = min(len(self.train_tokens), len(self.val_tokens))
            if config.block_size >= shortest:  # before the model's T x T mask exists
                raise TextTooShort(
                    f"block_size {config.block_size} is longer than the text: at most "
                    f"{shortest - 1:,}"
                )
            self.gpt_config = GPTConfig(
                vocab_size=self.tokenizer.vocab_size,
                block_size=config.block_size,
                n_layer=config.n_layer,
                n_head=config.n_head,
                n_embd=config.n_embd,
                dropout=config.dropout,
                n_experts=config.experts,
                top_k=config.moe_top_k,
                capacity_factor=config.capacity_factor,
                moe_every=config.moe_every,
                aux_loss_coef=config.aux_loss_coef,
            )
            with deferred_init(deferred):
                self.model = GPT(self.gpt_config, seed=config.seed, dtype=dtype)
            self.model.recompute = config.recompute  # every block run again in backward
            self.num_examples = len(self.train_tokens) - config.block_size  # window starts
            self.unit = "tokens"
            self.items_per_example = config.block_size
        else:
            self.x_train, self.y_train, self.x_val, self.y_val = data.classification(
                seed=config.seed, dtype=dtype
            )
            sizes = [self.x_train.shape[1], config.hidden, config.hidden, 10]
            with deferred_init(deferred):
                self.model = nn.MLP(sizes, rng=np.random.default_rng(config.seed), dtype=dtype)
            self.num_examples = len(self.x_train)
            self.unit = "examples"
            self.items_per_example = 1
        to_half(self.model, config.precision)  # --precision bf16, fp16: 16-bit weights
        backend.move_model(self.model)  # then moved (--backend torch; nothing for numpy)

    def batch(self, indices: np.ndarray, split: str = "train"):
        """(inputs, targets) for the examples at `indices`."""
        if self.config.model == "gpt":
            tokens = self.train_tokens if split == "train" else self.val_tokens
            return data.lm_batch(tokens, indices, self.config.block_size)
        x, y = (self.x_train, self.y_train) if split == "train" else (self.x_val, self.y_val)
        return Tensor(backend.to_backend(x[indices], self.config.backend)), y[indices]

    def loss(self, inputs, targets, net=None) -> Tensor:
        """The mean cross-entropy of task.model, or of `net` (the model placed otherwise,
        parallel/tensor_parallel/mesh_gpt.py's MeshGPT: its `loss`, its MoE layers in
        `net.model`), plus, training with experts, their load-balancing loss."""
        model = self.model if net is None else net.model
        if net is None:
            loss = nn.cross_entropy(model(inputs), targets)
        else:
            loss = net.loss(inputs, targets)
        if self.experts and model.training:  # the router's balance, and its counts
            slots = [m.load.slots for _, m in moe_layers(model)]  # S a layer: its bytes
            load = {**expert_load(model), "slots": slots}
            self.expert_load = add_loads(self.expert_load, load)
            loss = loss + load_balancing_loss(model)
        return loss

    def validation_loss(self, part: tuple[int, int] = (0, 1)) -> float:
        """Mean loss over `eval_batches` fixed batches of the validation split. `part` (c,
        C): only slice c of C of each batch, its mean weighted by its share of the batch:
        the C parts sum to the whole mean (a sharded model's ranks each take one)."""
        rng = np.random.default_rng(self.config.seed + 1)
        limit = (
            len(self.val_tokens) - self.config.block_size
            if self.config.model == "gpt"
            else len(self.x_val)
        )
        B = self.config.batch_size
        lo, hi = chunk_range(B, part[1], part[0])
        self.model.eval()
        with no_grad():
            losses = []
            for _ in range(self.config.eval_batches):
                mine = rng.integers(0, limit, B)[lo:hi]  # share len/B: 1.0 when whole
                losses.append(self.loss(*self.batch(mine, "val")).item() * (len(mine) / B))
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


def vocabulary(task) -> str | None:
    """The GPT's symbols in token order (None for the MLP): another text, another model (a
    checkpoint saves them; resuming and a distillation's teacher compare them)."""
    tokenizer = getattr(task, "tokenizer", None)
    return None if tokenizer is None else "".join(tokenizer.decode(range(tokenizer.vocab_size)))
