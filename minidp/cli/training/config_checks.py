"""The flag checks: every value of a TrainConfig that cannot work, refused as one line.

`check_config(config)` (TrainConfig.validate) raises BadConfig naming the flag, before any
rank builds a model or sends a message, so a bad value never costs a run. It reads as the
list of the checks, in the order they run: the sizes and rates, whether each flag set belongs
to this --strategy and --model, the other ranges, the parameter server's, where the run
writes (tools/paths.py), memory, the mesh, --prune, --backend, --compress, --zero-stage,
the pipeline, --cp, --experts. Each scheme's own checks live in scheme_checks.py.

Range checks are written `not (0 < x < inf)` so that nan and inf fail them too. The checks
read a config's fields and its `applies`, `is_set`, `resolved` (config.py); this module does
not import config.py, which imports it.
"""

import math
import os
from dataclasses import fields

from minidp.cli.training.bad_config import BadConfig, flag_name
from minidp.cli.training.scheme_checks import (
    TORCH_STRATEGIES,
    VELOCITY_COMPRESSORS,
    check_backend,
    check_compress,
    check_context_parallel,
    check_experts,
    check_parameter_server,
    check_pipeline,
    check_precision,
    check_prune,
    check_structured,
    staleness_bound,
)
from minidp.tools.memory import estimated_bytes, physical_memory_bytes
from minidp.tools.paths import same_file, uncreatable_dir, unwritable_file

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
MOST = 10**9
"""The largest count a flag may hold (steps, examples, layers, ...): more would never end
(--steps 99999999999999999999 trained forever at a learning rate of 4.5e-22). --seed is
not a count: any integer >= 0 seeds NumPy."""


def check_config(config) -> None:
    """Raise BadConfig with one clear line for a value of `config` that cannot work."""
    for name in POSITIVE:
        value = getattr(config, name)
        if not (0 < value < math.inf):
            raise BadConfig(f"{flag_name(name)} must be positive and finite, got {value}")
    resolved = config.resolved()
    for f in fields(config):
        value = getattr(resolved, f.name)
        counted = isinstance(value, int) and not isinstance(value, bool) and f.name != "seed"
        if counted and value > MOST:
            raise BadConfig(f"{flag_name(f.name)} {value} is more than can run: at most {MOST:,}")
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
    check_structured(config)
    check_backend(config)
    check_compress(config)
    check_precision(config)
    if config.strategy == "zero" and config.zero_stage not in (1, 2, 3):
        raise BadConfig(f"--strategy zero needs --zero-stage 1, 2 or 3, got {config.zero_stage}")
    if config.strategy == "hybrid" and config.zero_stage not in (0, 1, 2, 3):
        raise BadConfig(f"--zero-stage must be 1, 2 or 3 (0: off), got {config.zero_stage}")
    check_pipeline(config, config.pp)
    check_context_parallel(config)
    check_experts(config)
    if config.check_every and (
        config.pp > 1 or (config.strategy, config.zero_stage) == ("zero", 3)
    ):
        raise BadConfig(
            "--check-every compares the copies ranks hold of one parameter: under "
            f"--strategy {config.strategy} with --{'pp' if config.pp > 1 else 'zero-stage'} "
            f"{config.pp if config.pp > 1 else 3} no rank holds a copy of another's"
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
    if bad := config.out_of_interval():  # each flag's own interval (its metadata: config.py)
        name, value, interval = bad
        within = f"in {interval}" if interval != "[0, inf)" else ">= 0 and finite"
        raise BadConfig(f"{flag_name(name)} must be {within}, got {value}")


def check_belonging(config) -> None:
    """A flag set under a --strategy or --model it does not belong to is refused, never
    silently ignored (its metadata's "strategies" and "models")."""
    if bad := config.misplaced():
        name, kind, owners, this = bad
        whose = f"--{kind} {' or '.join(owners)}, not of --{kind} {this}"
        raise BadConfig(f"{flag_name(name)} is a flag of {whose}")


def check_outputs(config) -> None:
    """Where the run writes, checked before training, so a typo never costs a finished run's
    results: --json and --trace files (not one and the same), --save-dir and --log-dir
    directories that can be made (an existing --save-dir is written into: --resume DIR
    then finds its newest checkpoint), --save-every and --save-signal with a --save-dir,
    --resume an existing one, and the parameter server saving under BSP only."""
    for flag, path in (("--json", config.json), ("--trace", config.trace)):
        if path is not None and (why := unwritable_file(path)):
            raise BadConfig(f"{flag} {path}: {why}")
    if config.json and config.trace and same_file(config.json, config.trace):
        raise BadConfig(f"--json and --trace both name {config.json}: one would overwrite it")
    for flag, directory in (("--save-dir", config.save_dir), ("--log-dir", config.log_dir)):
        if directory is not None and (why := uncreatable_dir(directory)):
            raise BadConfig(f"{flag}: {why}")
    if config.save_every < 0:
        raise BadConfig(f"--save-every must be >= 0 (0: at the end), got {config.save_every}")
    for name in ("save_every", "save_signal"):
        if config.is_set(name) and config.save_dir is None:
            raise BadConfig(f"{flag_name(name)} needs --save-dir DIR: where would it save?")
    if config.save_dir is not None and config.strategy == "ps" and config.consistency != "bsp":
        raise BadConfig(
            f"--save-dir with --consistency {config.consistency}: a save is collective "
            "over every rank, and a worker the servers dropped would never join it; "
            "save under --consistency bsp"
        )
    if config.resume is not None and not os.path.isdir(config.resume):
        raise BadConfig(f"--resume {config.resume}: no such directory")


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
    from minidp.models.data import char_corpus  # cached: built once per process

    train_tokens, val_tokens, _ = char_corpus()
    shortest = min(len(train_tokens), len(val_tokens))
    if block_size >= shortest:
        raise BadConfig(
            f"--block-size {block_size} is longer than the text: the validation split has "
            f"{len(val_tokens):,} characters, so at most {shortest - 1:,}"
        )


__all__ = [
    "TORCH_STRATEGIES",
    "VELOCITY_COMPRESSORS",
    "BadConfig",
    "check_block_size",
    "check_config",
    "flag_name",
    "staleness_bound",
]
