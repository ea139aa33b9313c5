"""TrainConfig: every knob of `python -m minidp train`, with its default and its meaning.

The command line is generated from this dataclass (cli.py), so a new field is a new flag.

Default run, the arithmetic:
  GPT 2 layers x 4 heads x 64 channels, block 64 tokens   ->  ~0.1 M parameters
  global batch 16 sequences x 64 tokens                   ->  1024 tokens per step
  300 steps                                               ->  ~0.3 M tokens, well under a minute

Flags counted in steps (`--warmup`, `--prune-start`, `--prune-end`, `--prune-every`) default
to a fraction of `--steps` (their metadata's "of_steps"): 300 steps warm up for 20 and prune
from 50 to 200 every 10, 60 steps warm up for 4 and prune from 10 to 40 every 2. Left unset
they are None here, and `resolved()` fills them in; a value given is kept as it is.
"""

import math
import os
import tempfile
from dataclasses import dataclass, field, fields, replace

from minidp.memory import estimated_bytes, physical_memory_bytes
from minidp.names import ALGORITHMS, AUTO
from minidp.optim import OPTIMIZERS


class BadConfig(ValueError):
    """A flag value that cannot work: reported as one line, on rank 0, exit code 2."""


DATA_PARALLEL = ("dp", "tp", "hybrid", "zero")
"""The strategies whose ranks hold replicas (or shards) reduced by allreduce: they read the
data-parallel flags (allreduce, buckets, overlap, micro-batches); the parameter server not."""


@dataclass
class TrainConfig:
    strategy: str = field(
        default="dp",
        metadata={"help": "how ranks share the work (minidp.parallel.STRATEGIES names them)"},
    )
    model: str = field(
        default="gpt", metadata={"help": "model to train", "choices": ("gpt", "mlp")}
    )
    steps: int = field(default=300, metadata={"help": "optimizer steps"})
    batch_size: int = field(
        default=16, metadata={"help": "GLOBAL batch (sequences for gpt, examples for mlp)"}
    )
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate"})
    warmup: int | None = field(
        default=None,
        metadata={"help": "linear warmup steps, then cosine decay", "of_steps": (1, 15, 0)},
    )
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr = lr * this"})
    weight_decay: float = field(
        default=0.01,
        metadata={
            "help": "weight decay as torch applies it: AdamW's decoupled (w *= 1 - lr wd), "
            "SGD's added to the gradient (g + wd w)"
        },
    )
    grad_clip: float = field(default=1.0, metadata={"help": "global-norm clip (0 = off)"})
    seed: int = field(default=1337, metadata={"help": "one seed (>= 0) for init, data and dropout"})
    dtype: str = field(
        default="float32", metadata={"help": "compute dtype", "choices": ("float32", "float64")}
    )
    log_every: int = field(default=25, metadata={"help": "log a line every N steps"})
    json: str | None = field(default=None, metadata={"help": "write JSON-lines records to FILE"})
    # model size (gpt)
    block_size: int = field(
        default=64, metadata={"models": ("gpt",), "help": "gpt context length in tokens"}
    )
    n_layer: int = field(default=2, metadata={"models": ("gpt",), "help": "gpt transformer blocks"})
    n_head: int = field(default=4, metadata={"models": ("gpt",), "help": "gpt attention heads"})
    n_embd: int = field(default=64, metadata={"models": ("gpt",), "help": "gpt channels"})
    dropout: float = field(
        default=0.0,
        metadata={
            "models": ("gpt",),
            "help": "dropout probability (> 0: each rank masks its own slice, so data "
            "parallel losses match one process in distribution, not bit for bit)",
        },
    )
    # model size (mlp on the synthetic classification set)
    hidden: int = field(default=128, metadata={"models": ("mlp",), "help": "mlp hidden width"})
    eval_batches: int = field(default=8, metadata={"help": "validation batches at the end"})
    sample_tokens: int = field(default=200, metadata={"help": "characters to generate (gpt)"})

    # data parallelism
    allreduce: str = field(
        default="auto",
        metadata={
            "help": "gradient allreduce algorithm",
            "choices": (AUTO, *ALGORITHMS["allreduce"]),
            "strategies": DATA_PARALLEL,
        },
    )
    bucket_mb: float = field(
        default=0.25,
        metadata={
            "help": "gradient bucket size in MiB",
            "strategies": DATA_PARALLEL,
        },
    )
    overlap: str = field(
        default="auto",
        metadata={
            "help": "reduce gradients during backward (on), after it (off), or on when every "
            "rank has a spare core (auto)",
            "choices": ("auto", "on", "off"),
            "strategies": DATA_PARALLEL,
        },
    )
    grad_accum: int = field(
        default=1,
        metadata={
            "help": "micro-batches per optimizer step",
            "strategies": DATA_PARALLEL,
        },
    )
    threads: int = field(
        default=0, metadata={"help": "BLAS threads per rank (0: cores / ranks on this machine)"}
    )
    trace: str | None = field(default=None, metadata={"help": "write a Chrome-trace timeline"})
    log_dir: str | None = field(default=None, metadata={"help": "one log file per rank here"})

    # Each scheme's own flags go in its section below. A field whose metadata names
    # "strategies" belongs to those: set to anything but its default with another
    # --strategy, it is a BadConfig (one line), never silently ignored.

    # the optimizer of the schemes that hold a whole copy (or a shard) of every parameter:
    # AdamW by default; momentum (SGD, momentum 0.9, torch.optim.SGD's) is the setting the
    # compression papers (DGC, PowerSGD, EF-SignSGD) were published with. ps: --ps-optimizer
    optimizer: str = field(
        default="adamw",
        metadata={
            "help": "adamw, momentum (SGD with momentum 0.9) or sgd, with --lr and "
            "--weight-decay (minidp/optim.py, OPTIMIZERS)",
            "choices": tuple(OPTIMIZERS),
            "strategies": DATA_PARALLEL,
        },
    )

    # parameter server (--strategy ps): the last S ranks serve, the others work
    servers: int = field(
        default=1,
        metadata={"help": "server ranks (the last S of the world)", "strategies": ("ps",)},
    )
    consistency: str = field(
        default="bsp",
        metadata={
            "help": "bsp (every clock together), asp (each push as it comes) or ssp:K "
            "(no worker more than K clocks ahead of the slowest)",
            "strategies": ("ps",),
        },
    )
    ps_optimizer: str = field(
        default="adamw",
        metadata={
            "help": "the servers' optimizer (momentum: SGD with momentum 0.9)",
            "choices": ("sgd", "momentum", "adamw"),
            "strategies": ("ps",),
        },
    )
    ps_slow_worker_ms: float = field(
        default=0.0,
        metadata={
            "help": "the last worker sleeps this long every step (to show ASP's gain)",
            "strategies": ("ps",),
        },
    )
    ps_timeout: float = field(
        default=60.0,
        metadata={
            "help": "seconds a server waits for a silent worker (asp/ssp: dropped; bsp: an "
            "error) and a worker for a server's reply",
            "strategies": ("ps",),
        },
    )

    # the array backend (minidp/backend.py): NumPy, or torch tensors on the CPU or a GPU
    backend: str = field(
        default="numpy",
        metadata={
            "help": "array library of the engine: numpy, or torch tensors (torch's autograd off)",
            "choices": ("numpy", "torch"),
        },
    )
    device: str = field(
        default="cpu",
        metadata={
            "with": "backend",
            "help": "device of --backend torch",
            "choices": ("cpu", "cuda"),
        },
    )

    # the rank mesh and tensor parallelism (--strategy tp, hybrid)
    #   world = dp x tp: mpiexec -n 4 ... --strategy hybrid --dp 2 --tp 2
    dp: int = field(
        default=0,
        metadata={
            "help": "data-parallel size of the mesh (0: what the world leaves, world / tp)",
            "strategies": ("hybrid",),
        },
    )
    tp: int = field(
        default=0,
        metadata={
            "help": "tensor-parallel size of the mesh (0: what the world leaves, world / dp)",
            "strategies": ("tp", "hybrid"),
        },
    )
    sequence_parallel: bool = field(
        default=False,
        metadata={
            "help": "split LayerNorm and dropout regions along the sequence over the TP group",
            "strategies": ("tp", "hybrid"),
        },
    )

    # ZeRO (--strategy zero, hybrid)
    zero_stage: int = field(
        default=0,
        metadata={
            "help": "what ZeRO shards over the data-parallel ranks: 1 the optimizer state, "
            "2 and the gradients, 3 and the parameters (0: not set)",
            "strategies": ("zero", "hybrid"),
        },
    )

    # gradient compression and pruning (--strategy dp, hybrid)
    compress: str = field(
        default="none",
        metadata={
            "help": "gradient compression NAME[:PARAM]: none, fp16, bf16, topk:DENSITY, "
            "randomk:DENSITY, sign, sign-noef, qsgd:LEVELS, powersgd:RANK "
            "(minidp/parallel/compress.py)",
            "strategies": ("dp", "hybrid"),
        },
    )
    compress_warmup: int = field(
        default=0,
        metadata={
            "with": "compress",
            "help": "the first STEPS reductions of each bucket are the plain allreduce, "
            "uncompressed, and compression starts from a zero residual after (PyTorch "
            "PowerSGD's start_powerSGD_iter)",
            "strategies": ("dp", "hybrid"),
        },
    )
    compress_on: str = field(
        default="gradient",
        metadata={
            "help": "what --compress compresses: the summed gradient, before one shared "
            "optimizer (gradient), each rank's optimizer step, lr-scaled, with error "
            "feedback on the step as in EF-SignSGD (update; minidp/parallel/compress_update.py), "
            "or each rank's momentum-SGD velocity, DGC's momentum correction and factor "
            "masking (velocity, with --optimizer momentum and --compress topk or randomk; "
            "minidp/parallel/compress_velocity.py)",
            "choices": ("gradient", "update", "velocity"),
            "strategies": ("dp",),
        },
    )

    # pruning (minidp/prune.py): default run, the arithmetic: prune from step 50 (steps/6) to
    # 200 (2 steps/3) every 10 (steps/30), 16 pruning steps on the cubic ramp; 114,688 of the
    # GPT's 116,480 values are weight matrices, so --prune 0.9 leaves ~13,000 of them sent per
    # step (11% of dense)
    prune: float = field(
        default=0.0,
        metadata={
            "help": "target sparsity of the weight matrices, in [0, 1) (0 = off; biases "
            "and LayerNorm stay dense)",
            "strategies": ("dp",),
        },
    )
    prune_start: int | None = field(
        default=None,
        metadata={
            "with": "prune",
            "help": "step the cubic pruning ramp starts",
            "strategies": ("dp",),
            "of_steps": (1, 6, 0),
        },
    )
    prune_end: int | None = field(
        default=None,
        metadata={
            "with": "prune",
            "help": "step the target sparsity is reached",
            "strategies": ("dp",),
            "of_steps": (2, 3, 0),
        },
    )
    prune_every: int | None = field(
        default=None,
        metadata={
            "with": "prune",
            "help": "steps between pruning steps",
            "strategies": ("dp",),
            "of_steps": (1, 30, 1),
        },
    )
    prune_scope: str = field(
        default="global",
        metadata={
            "with": "prune",
            "help": "one magnitude threshold over all weight matrices, or one per matrix",
            "choices": ("global", "layer"),
            "strategies": ("dp",),
        },
    )

    def default_of(self, name: str):
        """Flag `name`'s default here: a step-counted one's is its fraction of --steps."""
        meta = TrainConfig.__dataclass_fields__[name].metadata
        if "of_steps" not in meta:
            return _DEFAULTS[name]
        numerator, denominator, least = meta["of_steps"]
        return max(least, self.steps * numerator // denominator)

    def is_set(self, name: str) -> bool:
        """Whether flag `name` was given a value other than its default (resolved or not)."""
        value = getattr(self, name)
        return value is not None and value != self.default_of(name)

    def resolved(self) -> "TrainConfig":
        """This config with each step-counted flag left unset filled in from --steps. Resolve
        last: `replace(config.resolved(), steps=N)` keeps the numbers filled in for the old
        --steps (replace the unresolved config, then resolve)."""
        unset = {
            f.name: self.default_of(f.name)
            for f in fields(self)
            if "of_steps" in f.metadata and getattr(self, f.name) is None
        }
        return replace(self, **unset) if unset else self

    def applies(self, name: str) -> bool:
        """Whether field `name` means anything under this --strategy and --model (the header
        prints only those; setting one that does not is refused by validate)."""
        meta = TrainConfig.__dataclass_fields__[name].metadata
        strategies = meta.get("strategies", (self.strategy,))  # no list: every one
        models = meta.get("models", (self.model,))
        return self.strategy in strategies and self.model in models

    def header(self) -> str:
        """The config line of the run's header: the fields that apply to this --strategy and
        --model, less those of a feature left off (--prune's schedule without --prune, say)."""
        shown = []
        for f in fields(self):
            feature = f.metadata.get("with")  # the flag that turns this one's feature on
            if self.applies(f.name) and (feature is None or self.is_set(feature)):
                shown.append(f"{f.name}={getattr(self, f.name)}")
        return "config: " + " ".join(shown)

    def validate(self) -> None:
        """Raise BadConfig with one clear line for a value that cannot work.

        Range checks are written `not (0 < x < inf)` so that nan and inf fail them too.
        Output paths are checked here, before training, so a typo never costs a finished
        run's results."""
        positive = (
            "steps",
            "batch_size",
            "log_every",
            "block_size",
            "n_layer",
            "n_head",
            "n_embd",
            "hidden",
            "eval_batches",
            "grad_accum",
            "lr",
            "bucket_mb",
        )
        for name in positive:
            value = getattr(self, name)
            if not (0 < value < math.inf):
                raise BadConfig(
                    f"--{name.replace('_', '-')} must be positive and finite, got {value}"
                )
        for f in fields(self):
            if not self.applies(f.name) and self.is_set(f.name):
                whose = ("--model", f.metadata.get("models"), self.model)
                if self.strategy not in f.metadata.get("strategies", (self.strategy,)):
                    whose = ("--strategy", f.metadata["strategies"], self.strategy)
                raise BadConfig(
                    f"--{f.name.replace('_', '-')} is a flag of {whose[0]} "
                    f"{' or '.join(whose[1])}, not of {whose[0]} {whose[2]}"
                )
        if self.model == "gpt" and self.n_embd % self.n_head:
            raise BadConfig(f"--n-embd ({self.n_embd}) must divide by --n-head ({self.n_head})")
        if self.seed < 0:
            raise BadConfig(f"--seed must be >= 0, got {self.seed}")
        cores = os.cpu_count() or 1
        if self.threads > cores:
            raise BadConfig(
                f"--threads {self.threads} is more than the {cores} cores here: BLAS threads "
                "beyond them only wait for each other (0: the cores shared among the ranks)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise BadConfig(f"--dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise BadConfig(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        resolved = self.resolved()
        for name in ("threads", "warmup", "sample_tokens", "grad_clip", "weight_decay"):
            value = getattr(resolved, name)
            if not (0 <= value < math.inf):
                raise BadConfig(f"--{name.replace('_', '-')} must be >= 0 and finite, got {value}")
        if self.servers < 1:
            raise BadConfig(f"--servers must be >= 1, got {self.servers}")
        staleness_bound(self.consistency)  # raises BadConfig on a bad value
        for name in ("ps_slow_worker_ms", "ps_timeout"):
            value = getattr(self, name)
            if not (0 <= value < math.inf) or (name == "ps_timeout" and value == 0):
                raise BadConfig(f"--{name.replace('_', '-')} must be positive, got {value}")
        for flag, path in (("--json", self.json), ("--trace", self.trace)):
            if path is not None:
                if os.path.isdir(path):
                    raise BadConfig(f"{flag} {path} is a directory; give a file name")
                _check_can_write(flag, os.path.dirname(os.path.abspath(path)))
        if self.json and self.trace and os.path.realpath(self.json) == os.path.realpath(self.trace):
            raise BadConfig(
                f"--json and --trace both name {self.json}: one would overwrite the other"
            )
        self._validate_memory()
        for name in ("dp", "tp"):
            if getattr(self, name) < 0:
                raise BadConfig(f"--{name} must be >= 0 (0: what the world leaves)")
        if self.sequence_parallel and self.tp == 1:
            raise BadConfig("--sequence-parallel needs --tp > 1 (it splits over the TP group)")
        self._validate_prune()
        self._validate_backend()
        if self.compress_warmup < 0:
            raise BadConfig(f"--compress-warmup must be >= 0, got {self.compress_warmup}")
        if self.compress_on == "velocity":
            self._validate_velocity()
        if self.compress_warmup and self.compress == "none":
            raise BadConfig("--compress-warmup needs --compress: it delays the compression")
        if self.strategy == "zero" and self.zero_stage not in (1, 2, 3):
            raise BadConfig(f"--strategy zero needs --zero-stage 1, 2 or 3, got {self.zero_stage}")
        if self.strategy == "hybrid" and self.zero_stage not in (0, 1, 2, 3):
            raise BadConfig(f"--zero-stage must be 1, 2 or 3 (0: off), got {self.zero_stage}")
        if self.log_dir is not None:
            existing = os.path.abspath(self.log_dir)
            while not os.path.exists(existing):  # the directories it would create
                existing = os.path.dirname(existing)
            _check_can_write("--log-dir", existing)

    def _validate_memory(self) -> None:
        """Refuse a GPT block longer than the text, and a model and batch whose estimated size
        is past this machine's memory, before any rank allocates it (the ranks of one machine
        share it: the global batch counts)."""
        if self.model == "gpt":
            check_block_size(self.block_size)
        need = estimated_bytes(self)
        have = physical_memory_bytes()
        if have is not None and need > have:
            sizes = (
                f"--block-size {self.block_size}, --n-embd {self.n_embd}, --n-layer {self.n_layer}"
                if self.model == "gpt"
                else f"--hidden {self.hidden}"
            )
            raise BadConfig(
                f"--batch-size {self.batch_size} with {sizes} needs about {need / 2**30:,.1f} "
                f"GiB, more than the {have / 2**30:,.1f} GiB of this machine: make them smaller"
            )

    def _validate_velocity(self) -> None:
        """--compress-on velocity moves SGD's momentum before a sparsifier: one line else."""
        if self.optimizer != "momentum":
            raise BadConfig(
                "--compress-on velocity needs --optimizer momentum: it moves SGD's momentum "
                f"to each rank, before the compression (DGC), not {self.optimizer}'s"
            )
        name = self.compress.partition(":")[0]
        if name not in VELOCITY_COMPRESSORS:
            raise BadConfig(
                f"--compress-on velocity clears the coordinates it sent (DGC's momentum factor "
                f"masking): it needs --compress {' or '.join(VELOCITY_COMPRESSORS)}, not {name}"
            )

    def _validate_backend(self) -> None:
        """--backend torch runs --strategy dp only (plain or accumulating), on an installed
        torch and, for --device cuda, a visible GPU: one line otherwise."""
        from minidp.backend import BackendUnavailable, check

        try:
            check(self.backend, self.device)
        except BackendUnavailable as error:
            raise BadConfig(str(error)) from None
        if self.backend == "numpy":
            return
        if self.strategy not in TORCH_STRATEGIES:
            raise BadConfig(
                f"--strategy {self.strategy} does not run on --backend torch yet (it runs "
                f"--strategy {', '.join(TORCH_STRATEGIES)}): use --backend numpy"
            )
        given = ("prune", "compress")  # the DP hooks that do not stage through the host yet
        extras = [f for f in given if self.is_set(f)]
        if extras:
            raise BadConfig(
                f"--{extras[0]} does not run on --backend torch yet: use --backend numpy"
            )

    def _validate_prune(self) -> None:
        """--prune and its schedule (minidp/prune.py): one line for each way they fail."""
        schedule = ("prune_start", "prune_end", "prune_every", "prune_scope")
        if not 0.0 <= self.prune < 1.0:
            raise BadConfig(f"--prune must be in [0, 1), got {self.prune}")
        if not self.prune:
            given = [n for n in schedule if self.is_set(n)]
            if given:
                flags = ", ".join("--" + n.replace("_", "-") for n in given)
                raise BadConfig(f"{flags} shape the schedule of --prune SPARSITY: give --prune")
            return
        if getattr(self, "compress", "none") != "none" or self.compress_on != "gradient":
            raise BadConfig(
                "--prune together with --compress (or --compress-on update) is not yet "
                "supported: pick one"
            )
        if self.prune_scope not in ("global", "layer"):
            raise BadConfig(f"--prune-scope must be global or layer, got {self.prune_scope!r}")
        r = self.resolved()  # the schedule's unset steps follow --steps
        if r.prune_every < 1:
            raise BadConfig(f"--prune-every must be >= 1, got {r.prune_every}")
        if not 0 <= r.prune_start <= r.prune_end:
            raise BadConfig(
                f"bad pruning schedule: need 0 <= --prune-start ({r.prune_start}) <= "
                f"--prune-end ({r.prune_end})"
            )
        if r.prune_end >= r.steps:
            raise BadConfig(
                f"--prune-end {r.prune_end} is past the last step (--steps {r.steps} "
                f"runs steps 0 to {r.steps - 1}): lower --prune-end"
            )


def check_block_size(block_size: int) -> None:
    """BadConfig unless a GPT window of block_size + 1 tokens fits in both splits of the text."""
    from minidp.data import char_corpus  # cached: built once per process

    train_tokens, val_tokens, _ = char_corpus()
    shortest = min(len(train_tokens), len(val_tokens))
    if block_size >= shortest:
        raise BadConfig(
            f"--block-size {block_size} is longer than the text: the validation split has "
            f"{len(val_tokens):,} characters, so at most {shortest - 1:,}"
        )


def staleness_bound(consistency: str) -> float:
    """--consistency as the bound K on how far a worker may run ahead of the slowest:
    bsp -> 0 (and updates wait for the whole clock), ssp:K -> K, asp -> infinity."""
    from minidp.parallel.ps_server import consistency_bound  # the piece's rule

    try:
        return consistency_bound(consistency)
    except ValueError:
        raise BadConfig(
            f"--consistency {consistency!r}: choose bsp, asp or ssp:K with an integer K >= 0"
        ) from None


def _check_can_write(flag: str, directory: str) -> None:
    """BadConfig unless a file can be created in directory (tried: root passes os.access)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise BadConfig(f"{flag}: cannot write in {directory} ({error.strerror})") from None


VELOCITY_COMPRESSORS = ("topk", "randomk")  # what --compress-on velocity runs: sparsifiers
TORCH_STRATEGIES = ("dp",)  # what --backend torch runs; the rest refuse (docs/torch.md)

_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


def config_fields():
    """(name, default, type, metadata) for each TrainConfig field, in order."""
    return [(f.name, f.default, f.type, f.metadata) for f in fields(TrainConfig)]
