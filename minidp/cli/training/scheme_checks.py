"""Each scheme's own flags checked: the parameter server's, --prune's, --prune-structured's,
--backend's, --compress's, the pipeline's, --cp's, --experts'; one line each, as
config_checks.py's (which runs them).

Like config_checks.py, this module reads a config's fields and its `is_set`, `resolved`,
and does not import config.py.
"""

import math

from minidp.cli.training.bad_config import BadConfig, flag_name

VELOCITY_COMPRESSORS = ("topk", "randomk")  # what --compress-on velocity runs: sparsifiers
SHAPED = {"prune_structured_at": "prune_structured", "temperature": "teacher", "alpha": "teacher"}
TORCH_STRATEGIES = ("dp",)  # what --backend torch runs; the rest refuse (docs/torch.md)


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
    """--prune and its schedule (minidp/models/prune/magnitude.py): one line for each way
    they fail."""
    schedule = ("prune_start", "prune_end", "prune_every", "prune_scope")
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


def check_structured(config) -> None:
    """--prune-structured (parallel/structured_pruning.py) at a step of the run, leaving a head
    and a channel in each layer, alone; it and --teacher, each with the flags it is shaped by."""
    for name, feature in SHAPED.items():
        if config.is_set(name) and not config.is_set(feature):
            raise BadConfig(f"{flag_name(name)} shapes {flag_name(feature)}: give it")
    if not config.prune_structured:
        return
    clashes = [("--prune", config.prune), ("--compress", config.compress != "none"),
               ("--compress-on", config.compress_on != "gradient"), ("--resume", config.resume),
               ("--experts", config.experts), ("--backend", config.backend != "numpy")]  # fmt: skip
    if clash := next((name for name, given in clashes if given), None):
        raise BadConfig(f"--prune-structured with {clash} is not supported: pick one")
    if not 0 <= config.resolved().prune_structured_at < config.steps:
        raise BadConfig(f"--prune-structured-at must be a step in [0, --steps {config.steps})")
    units = (config.n_head, 4 * config.n_embd) if config.model == "gpt" else (config.hidden,)
    if any(round(config.prune_structured * n) >= n for n in units):
        raise BadConfig(f"--prune-structured {config.prune_structured:g} leaves no head or channel")


def check_backend(config) -> None:
    """--backend torch runs --strategy dp only (plain or accumulating), on an installed
    torch and, for --device cuda, a visible GPU: one line otherwise."""
    from minidp.engine.backend import BackendUnavailable, check

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
    if config.skip_nonfinite and (config.compress != "none" or config.compress_on != "gradient"):
        raise BadConfig(
            "--skip-nonfinite with --compress: a skipped step's NaN would stay in the "
            "compressor's residuals (or velocity) and poison every later step; pick one"
        )
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
    if config.compress != "none" and config.zero_stage:  # hybrid's DP axis under ZeRO
        raise BadConfig(
            f"--compress with --zero-stage {config.zero_stage}: the compressors replace "
            "DDP's bucket allreduce, and ZeRO reduce-scatters its shards instead; drop one"
        )


PIPELINE_FLAGS = ("micro_batches", "schedule", "virtual")  # --pp's own


def check_precision(config) -> None:
    """--precision bf16 or fp16: float32 underneath (the masters, the loss), on either
    backend (torch: engine/casts.py), its gradients reduced as they are (not by a
    compressor)."""
    if config.precision == "fp32":
        return
    flag = f"--precision {config.precision}"
    if config.dtype != "float32":
        raise BadConfig(f"{flag} keeps float32 master weights and arithmetic: drop --dtype")
    if config.compress != "none" or config.compress_on != "gradient":
        raise BadConfig(f"{flag} sends 16-bit gradients already: drop --compress")


def check_pipeline(config, pp: int) -> None:
    """--strategy pp, or hybrid with --pp > 1: pp x V stages of at least one block each, V
    of them a rank only for interleaved (which needs pp x V to divide the blocks), 1 <= m <=
    batch (pp: 0 unknown). Under hybrid without a pipeline, its flags are refused."""
    if config.strategy == "hybrid" and pp <= 1:
        given = [n for n in PIPELINE_FLAGS if config.is_set(n)]
        if pp < 0 or given:
            what = f"--pp {pp}" if pp < 0 else flag_name(given[0])
            raise BadConfig(f"{what}: a pipeline needs --strategy hybrid --pp P with P > 1")
        return
    if config.strategy not in ("pp", "hybrid"):
        return
    V, m, n = config.virtual, config.micro_batches, config.n_layer
    if config.model != "gpt":
        raise BadConfig(
            f"--strategy {config.strategy}{' --pp' * (config.strategy == 'hybrid')} cuts the "
            f"GPT's blocks into stages, not --model {config.model}"
        )
    if pp < 0 or V < 1:
        raise BadConfig(f"--pp must be >= 0 (0: the world) and --virtual >= 1, got {pp}, {V}")
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


def cp_zigzag(config) -> bool:
    """Whether --cp-layout asks for zig-zag (auto: for ring attention, not for Ulysses)."""
    return config.cp_layout == "zigzag" or (config.cp_layout, config.cp_algo) == ("auto", "ring")


def check_context_parallel(config) -> None:
    """--cp C (--strategy hybrid, the GPT: their flags' metadata): a sequence that splits
    into C (2C zig-zag) chunks, heads that split over C for Ulysses, no attention dropout;
    with ZeRO or sequence parallelism, not yet (the pipeline: yes)."""
    C = config.cp
    if C < 1:
        raise BadConfig(f"--cp must be >= 1 (1: no context parallelism), got {C}")
    if C == 1:
        given = [n for n in ("cp_algo", "cp_layout") if config.is_set(n)]
        if given:
            raise BadConfig(f"{flag_name(given[0])} shapes context parallelism: give --cp C > 1")
        return
    pieces = 2 * C if cp_zigzag(config) else C
    if config.block_size % pieces:
        how = f"2 x --cp {C} (zig-zag)" if cp_zigzag(config) else f"--cp {C}"
        raise BadConfig(f"--block-size {config.block_size} must divide by {how}")
    heads = C * max(config.tp, 1)
    if config.cp_algo == "ulysses" and config.n_head % heads:
        tp = f" x --tp {config.tp}" if config.tp > 1 else ""
        raise BadConfig(f"--cp-algo ulysses: --n-head {config.n_head} must divide by --cp {C}{tp}")
    if config.dropout > 0:
        raise BadConfig(f"--cp {C} with --dropout {config.dropout}: context parallelism "
                        "computes no attention probabilities to drop; use --dropout 0")  # fmt: skip
    for flag, given in (("--zero-stage", config.zero_stage > 0),
                        ("--sequence-parallel", config.sequence_parallel)):  # fmt: skip
        if given:
            raise BadConfig(f"--cp {C} with {flag} is not yet supported: drop one")


MOE_FLAGS = ("moe_top_k", "capacity_factor", "moe_every", "aux_loss_coef", "ep")  # --experts'


def check_experts(config) -> None:
    """--experts E (dp, hybrid; the GPT) and --ep N dividing E; what ExpertParallel does not
    compose with yet refused (the world's checks, N | dp | batch: cli/strategies/ep.py)."""
    E, N = config.experts, config.ep
    if N < 1:
        raise BadConfig(f"--ep must be >= 1 (1: every rank holds every expert), got {N}")
    if not E:
        given = [n for n in MOE_FLAGS if config.is_set(n)]
        if given:
            raise BadConfig(f"{flag_name(given[0])} shapes the experts: give --experts E")
        return
    if E % N or E < config.moe_top_k:
        raise BadConfig(f"--ep {N} and --moe-top-k {config.moe_top_k} need E = --experts {E} "
                        "to divide by N and to be >= k")  # fmt: skip
    compress = (config.compress, config.compress_on) != ("none", "gradient")
    for flag, given in (("--sequence-parallel", config.sequence_parallel),
                        ("--pp", config.pp > 1), ("--cp", config.cp > 1),
                        ("--zero-stage", config.zero_stage), ("--prune", config.prune > 0),
                        ("--compress", compress), ("--precision", config.precision != "fp32"),
                        ("--backend torch", config.backend != "numpy"), ("--recompute (the "
                        "router's counts would be summed twice)", config.recompute)):  # fmt: skip
        if given:
            raise BadConfig(f"--experts with {flag} is not yet supported: drop one")
