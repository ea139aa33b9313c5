"""The flag checks: every value of a TrainConfig that cannot work, refused as one line.

`check_config(config)` (TrainConfig.validate) raises BadConfig naming the flag, before any
rank builds a model or sends a message, so a bad value never costs a run. It reads as the
list of the checks, in the order they run: the sizes and rates, whether each flag set belongs
to this --strategy and --model, the other ranges, the parameter server's, the output files,
memory, the mesh, --prune, --backend, --compress, --zero-stage, --log-dir.

Range checks are written `not (0 < x < inf)` so that nan and inf fail them too. The checks
read a config's fields and its `applies`, `is_set`, `resolved` (config.py); this module does
not import config.py, which imports it.
"""

import math
import os
import tempfile
from dataclasses import fields

from minidp.memory import estimated_bytes, physical_memory_bytes


class BadConfig(ValueError):
    """A flag value that cannot work: reported as one line, on rank 0, exit code 2."""


VELOCITY_COMPRESSORS = ("topk", "randomk")  # what --compress-on velocity runs: sparsifiers
TORCH_STRATEGIES = ("dp",)  # what --backend torch runs; the rest refuse (docs/torch.md)

POSITIVE = (
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
"""The flags that must be > 0 and finite."""


def flag_name(name: str) -> str:
    """A field's flag: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


def check_config(config) -> None:
    """Raise BadConfig with one clear line for a value of `config` that cannot work."""
    for name in POSITIVE:
        value = getattr(config, name)
        if not (0 < value < math.inf):
            raise BadConfig(f"{flag_name(name)} must be positive and finite, got {value}")
    check_belonging(config)
    check_ranges(config)
    check_parameter_server(config)
    check_outputs(config)
    check_memory(config)
    for name in ("dp", "tp"):
        if getattr(config, name) < 0:
            raise BadConfig(f"--{name} must be >= 0 (0: what the world leaves)")
    if config.sequence_parallel and config.tp == 1:
        raise BadConfig("--sequence-parallel needs --tp > 1 (it splits over the TP group)")
    check_prune(config)
    check_backend(config)
    check_compress(config)
    if config.strategy == "zero" and config.zero_stage not in (1, 2, 3):
        raise BadConfig(f"--strategy zero needs --zero-stage 1, 2 or 3, got {config.zero_stage}")
    if config.strategy == "hybrid" and config.zero_stage not in (0, 1, 2, 3):
        raise BadConfig(f"--zero-stage must be 1, 2 or 3 (0: off), got {config.zero_stage}")
    check_pipeline(config, config.pp)
    check_log_dir(config)


def check_pipeline(config, pp: int) -> None:
    """--strategy pp: pp x V stages of at least one block each, V of them a rank only for
    interleaved (which needs pp x V to divide the blocks), 1 <= m <= batch (pp: 0 unknown)."""
    if config.strategy != "pp":
        return
    V, m, n = config.virtual, config.micro_batches, config.n_layer
    if config.model != "gpt":
        raise BadConfig(
            f"--strategy pp cuts the GPT's blocks into stages, not --model {config.model}"
        )
    if pp < 0 or V < 1:
        raise BadConfig(f"--pp must be >= 0 (0: the world) and --virtual >= 1, got {pp}, {V}")
    if config.recompute and config.dropout > 0:  # a recomputed forward would draw new masks
        raise BadConfig(f"--recompute needs --dropout 0, got {config.dropout}")
    if not 1 <= m <= config.batch_size:
        raise BadConfig(
            f"--micro-batches must be in [1, --batch-size {config.batch_size}], got {m}"
        )
    if V > 1 and config.schedule != "interleaved":
        raise BadConfig(f"--virtual {V}: only --schedule interleaved runs several stages a rank")
    if max(pp, 1) * V > n:
        raise BadConfig(f"--pp {pp} x --virtual {V} stages are more than --n-layer {n} blocks")
    if V > 1 and pp and n % (pp * V):
        raise BadConfig(
            f"--schedule interleaved: --pp {pp} x --virtual {V} must divide --n-layer {n}"
        )


def check_ranges(config) -> None:
    """Sizes, rates and probabilities in their ranges; --threads no more than the cores."""
    if config.model == "gpt" and config.n_embd % config.n_head:
        raise BadConfig(f"--n-embd ({config.n_embd}) must divide by --n-head ({config.n_head})")
    if config.seed < 0:
        raise BadConfig(f"--seed must be >= 0, got {config.seed}")
    cores = os.cpu_count() or 1
    if config.threads > cores:
        raise BadConfig(
            f"--threads {config.threads} is more than the {cores} cores here: BLAS threads "
            "beyond them only wait for each other (0: the cores shared among the ranks)"
        )
    if not 0.0 <= config.dropout < 1.0:
        raise BadConfig(f"--dropout must be in [0, 1), got {config.dropout}")
    if not 0.0 <= config.min_lr_ratio <= 1.0:
        raise BadConfig(f"--min-lr-ratio must be in [0, 1], got {config.min_lr_ratio}")
    resolved = config.resolved()
    for name in ("threads", "warmup", "sample_tokens", "grad_clip", "weight_decay"):
        value = getattr(resolved, name)
        if not (0 <= value < math.inf):
            raise BadConfig(f"{flag_name(name)} must be >= 0 and finite, got {value}")


def check_belonging(config) -> None:
    """A flag set under a --strategy or --model it does not belong to is refused, never
    silently ignored (its metadata's "strategies" and "models")."""
    for f in fields(config):
        if not config.applies(f.name) and config.is_set(f.name):
            whose = ("--model", f.metadata.get("models"), config.model)
            if config.strategy not in f.metadata.get("strategies", (config.strategy,)):
                whose = ("--strategy", f.metadata["strategies"], config.strategy)
            raise BadConfig(
                f"{flag_name(f.name)} is a flag of {whose[0]} "
                f"{' or '.join(whose[1])}, not of {whose[0]} {whose[2]}"
            )


def check_outputs(config) -> None:
    """Output paths are checked here, before training, so a typo never costs a finished
    run's results."""
    for flag, path in (("--json", config.json), ("--trace", config.trace)):
        if path is not None:
            if os.path.isdir(path):
                raise BadConfig(f"{flag} {path} is a directory; give a file name")
            check_can_write(flag, os.path.dirname(os.path.abspath(path)))
    if (
        config.json
        and config.trace
        and os.path.realpath(config.json) == os.path.realpath(config.trace)
    ):
        raise BadConfig(
            f"--json and --trace both name {config.json}: one would overwrite the other"
        )


def check_log_dir(config) -> None:
    """--log-dir: the nearest directory that exists must take a new file."""
    if config.log_dir is not None:
        existing = os.path.abspath(config.log_dir)
        while not os.path.exists(existing):  # the directories it would create
            existing = os.path.dirname(existing)
        check_can_write("--log-dir", existing)


def check_can_write(flag: str, directory: str) -> None:
    """BadConfig unless a file can be created in directory (tried: root passes os.access)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise BadConfig(f"{flag}: cannot write in {directory} ({error.strerror})") from None


def check_memory(config) -> None:
    """Refuse a GPT block longer than the text, and a model and batch whose estimated size
    is past this machine's memory, before any rank allocates it (the ranks of one machine
    share it: the global batch counts)."""
    if config.model == "gpt":
        check_block_size(config.block_size)
    need = estimated_bytes(config)
    have = physical_memory_bytes()
    if have is not None and need > have:
        sizes = (
            f"--block-size {config.block_size}, --n-embd {config.n_embd}, "
            f"--n-layer {config.n_layer}"
            if config.model == "gpt"
            else f"--hidden {config.hidden}"
        )
        raise BadConfig(
            f"--batch-size {config.batch_size} with {sizes} needs about {need / 2**30:,.1f} "
            f"GiB, more than the {have / 2**30:,.1f} GiB of this machine: make them smaller"
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


def check_parameter_server(config) -> None:
    """--servers, --consistency and the parameter server's times."""
    if config.servers < 1:
        raise BadConfig(f"--servers must be >= 1, got {config.servers}")
    staleness_bound(config.consistency)  # raises BadConfig on a bad value
    for name in ("ps_slow_worker_ms", "ps_timeout"):
        value = getattr(config, name)
        if not (0 <= value < math.inf) or (name == "ps_timeout" and value == 0):
            raise BadConfig(f"{flag_name(name)} must be positive, got {value}")


def staleness_bound(consistency: str) -> float:
    """--consistency as the bound K on how far a worker may run ahead of the slowest:
    bsp -> 0 (and updates wait for the whole clock), ssp:K -> K, asp -> infinity."""
    from minidp.parallel.param_server.server import consistency_bound  # the piece's rule

    try:
        return consistency_bound(consistency)
    except ValueError:
        raise BadConfig(
            f"--consistency {consistency!r}: choose bsp, asp or ssp:K with an integer K >= 0"
        ) from None


def check_prune(config) -> None:
    """--prune and its schedule (minidp/prune/magnitude.py): one line for each way they fail."""
    schedule = ("prune_start", "prune_end", "prune_every", "prune_scope")
    if not 0.0 <= config.prune < 1.0:
        raise BadConfig(f"--prune must be in [0, 1), got {config.prune}")
    if not config.prune:
        given = [n for n in schedule if config.is_set(n)]
        if given:
            flags = ", ".join(flag_name(n) for n in given)
            raise BadConfig(f"{flags} shape the schedule of --prune SPARSITY: give --prune")
        return
    if config.compress != "none" or config.compress_on != "gradient":
        raise BadConfig(
            "--prune together with --compress (or --compress-on update) is not yet "
            "supported: pick one"
        )
    if config.prune_scope not in ("global", "layer"):
        raise BadConfig(f"--prune-scope must be global or layer, got {config.prune_scope!r}")
    r = config.resolved()  # the schedule's unset steps follow --steps
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


def check_backend(config) -> None:
    """--backend torch runs --strategy dp only (plain or accumulating), on an installed
    torch and, for --device cuda, a visible GPU: one line otherwise."""
    from minidp.backend import BackendUnavailable, check

    try:
        check(config.backend, config.device)
    except BackendUnavailable as error:
        raise BadConfig(str(error)) from None
    if config.backend == "numpy":
        return
    if config.strategy not in TORCH_STRATEGIES:
        raise BadConfig(
            f"--strategy {config.strategy} does not run on --backend torch yet (it runs "
            f"--strategy {', '.join(TORCH_STRATEGIES)}): use --backend numpy"
        )
    given = ("prune", "compress")  # the DP hooks that do not stage through the host yet
    extras = [f for f in given if config.is_set(f)]
    if extras:
        raise BadConfig(f"--{extras[0]} does not run on --backend torch yet: use --backend numpy")


def check_compress(config) -> None:
    """--compress-warmup needs --compress; --compress-on velocity moves SGD's momentum before
    a sparsifier."""
    if config.compress_warmup < 0:
        raise BadConfig(f"--compress-warmup must be >= 0, got {config.compress_warmup}")
    if config.compress_on == "velocity":
        if config.optimizer != "momentum":
            raise BadConfig(
                "--compress-on velocity needs --optimizer momentum: it moves SGD's momentum "
                f"to each rank, before the compression (DGC), not {config.optimizer}'s"
            )
        name = config.compress.partition(":")[0]
        if name not in VELOCITY_COMPRESSORS:
            raise BadConfig(
                f"--compress-on velocity clears the coordinates it sent (DGC's momentum factor "
                f"masking): it needs --compress {' or '.join(VELOCITY_COMPRESSORS)}, not {name}"
            )
    if config.compress_warmup and config.compress == "none":
        raise BadConfig("--compress-warmup needs --compress: it delays the compression")


__all__ = [
    "TORCH_STRATEGIES",
    "VELOCITY_COMPRESSORS",
    "BadConfig",
    "check_block_size",
    "check_config",
    "staleness_bound",
]
