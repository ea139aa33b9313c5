"""TrainConfig: every knob of `python -m minidp train`, with its default and its meaning.

The command line is generated from this dataclass (cli/commands.py), so a new field is a
new flag; the values that cannot work are refused by config_checks.py, one line each. The
default run: a GPT of ~0.1 M parameters, 1024 tokens a step, 300 steps.

Flags counted in steps (`--warmup`, `--prune-start`, `--prune-end`, `--prune-every`, ...) default
to a fraction of `--steps` (metadata "of_steps": 300 steps warm up for 20, 60 for 4). Left
unset they are None here, and `resolved()` fills them in; a value given is kept as it is.

Each field is a `flag(default, help, **metadata)`: tools/flags.py lists the metadata keys
and the methods every config has; `validate` is config_checks'. A new flag that changes the
step: one field here and the recipe that reads it (strategies/).
"""

from dataclasses import dataclass, fields

from minidp.cli.training.config_checks import BadConfig, check_config, staleness_bound
from minidp.engine.optim import OPTIMIZERS
from minidp.tools.flags import Flags, flag
from minidp.tools.names import ALGORITHMS, AUTO, PIPELINE_SCHEDULES

DATA_PARALLEL = ("dp", "tp", "hybrid", "zero")
"""The strategies whose ranks reduce replicas (or shards) by allreduce: they read the
data-parallel flags (allreduce, buckets, overlap, micro-batches); not the parameter server."""
PP = ("pp", "hybrid")  # the strategies that read the pipeline's flags
STEPPED = ("dp", "tp", "zero", "pp", "hybrid")  # those that run parallel/step.py


@dataclass
class TrainConfig(Flags):
    validate = check_config  # config.validate(): BadConfig, one line, for what cannot work
    strategy: str = flag(
        "dp", "how ranks share the work (minidp.cli.strategies.STRATEGIES names them)"
    )
    model: str = flag("gpt", "model to train", choices=("gpt", "mlp"), on_resume="model")
    steps: int = flag(300, "optimizer steps", on_resume="run")
    batch_size: int = flag(
        16, "GLOBAL batch (sequences for gpt, examples for mlp)", on_resume="data"
    )
    lr: float = flag(3e-3, "peak learning rate", on_resume="run")
    warmup: int | None = flag(None, "linear warmup steps, then cosine decay", of_steps=(1, 15, 0),
                              on_resume="run", interval="[0, inf)")  # fmt: skip
    min_lr_ratio: float = flag(0.1, "final lr = lr * this", on_resume="run", interval="[0, 1]")
    weight_decay: float = flag(0.01, "weight decay as torch applies it: AdamW's decoupled (w *= "
                               "1 - lr wd), SGD's added to the gradient (g + wd w)",
                               on_resume="run", interval="[0, inf)")  # fmt: skip
    grad_clip: float = flag(1.0, "global-norm clip (0 = off)", on_resume="run", interval="[0, inf)")
    seed: int = flag(1337, "one seed (>= 0) for init, data and dropout", on_resume="data")
    dtype: str = flag("float32", "compute dtype", choices=("float32", "float64"), on_resume="model")
    log_every: int = flag(25, "log a line every N steps")
    json: str | None = flag(None, "write JSON-lines records to FILE")
    # model size (gpt)
    block_size: int = flag(64, "gpt context length in tokens", models=("gpt",), on_resume="model")
    n_layer: int = flag(2, "gpt transformer blocks", models=("gpt",), on_resume="model")
    n_head: int = flag(4, "gpt attention heads", models=("gpt",), on_resume="model")
    n_embd: int = flag(64, "gpt channels", models=("gpt",), on_resume="model")
    dropout: float = flag(0.0, "dropout probability (> 0: each rank masks its own slice, so data "
                          "parallel losses match one process in distribution, not bit for bit)",
                          models=("gpt",), on_resume="run", interval="[0, 1)")  # fmt: skip
    # model size (mlp on the synthetic classification set)
    hidden: int = flag(128, "mlp hidden width", models=("mlp",), on_resume="model")
    eval_batches: int = flag(8, "validation batches at the end")
    sample_tokens: int = flag(200, "characters to generate (gpt)", interval="[0, inf)")

    # data parallelism
    allreduce: str = flag(
        "auto",
        "gradient allreduce algorithm",
        choices=(AUTO, *ALGORITHMS["allreduce"]),
        strategies=DATA_PARALLEL,
    )
    bucket_mb: float = flag(0.25, "gradient bucket size in MiB", strategies=DATA_PARALLEL)
    overlap: str = flag(
        "auto",
        "reduce gradients during backward (on), after it (off), or on when every "
        "rank has a spare core (auto)",
        choices=("auto", "on", "off"),
        strategies=DATA_PARALLEL,
    )
    grad_accum: int = flag(1, "micro-batches per optimizer step", strategies=DATA_PARALLEL)
    threads: int = flag(
        0, "BLAS threads per rank (0: cores / ranks on this machine)", interval="[0, inf)"
    )
    trace: str | None = flag(None, "write a Chrome-trace timeline")
    log_dir: str | None = flag(None, "one log file per rank here")
    # checkpoints (minidp.parallel.checkpoint; docs/checkpoints.md): DIR/step_000050, ...
    save_dir: str | None = flag(None, "write checkpoints here (DIR/step_NNNNNN)")
    save_every: int = flag(0, "save every N steps (0: once, at the end)", with_="save_dir")
    resume: str | None = flag(None, "resume from DIR's newest complete checkpoint, or DIR/step_N")
    save_signal: str = flag(
        "none",
        "a signal that, like SIGTERM and SIGINT, makes every rank finish its step, save it "
        "to --save-dir and stop (SLURM's --signal=USR1@120; parallel/checkpoint/"
        "preemption.py; MPICH's mpiexec forwards SIGUSR1, not SIGUSR2 or SIGHUP)",
        choices=("none", "SIGUSR1"),
        with_="save_dir",
    )

    # faults (docs/faults.md)
    skip_nonfinite: bool = flag(
        False,
        "a step whose loss or global gradient norm (computed where --grad-clip clips) is "
        "not finite is skipped by every rank, logged and counted, instead of ending the run",
        strategies=STEPPED,
    )
    check_every: int = flag(
        0,
        "every N steps, compare a hash of the parameters among the ranks that should hold "
        "the same bits, and stop naming the first that differ (0: never; training/drift.py)",
        strategies=("dp", "tp", "zero", "hybrid"),
        interval="[0, inf)",
    )

    # Each scheme's own flags go in its section below, with the strategies they belong to.

    # the optimizer of the schemes that hold a whole copy (or a shard) of every parameter:
    # AdamW by default; momentum (SGD, momentum 0.9, torch.optim.SGD's) is the setting the
    # compression papers (DGC, PowerSGD, EF-SignSGD) were published with. ps: --ps-optimizer
    optimizer: str = flag(
        "adamw",
        "adamw, momentum (SGD with momentum 0.9) or sgd, with --lr and "
        "--weight-decay (minidp/engine/optim.py, OPTIMIZERS)",
        choices=tuple(OPTIMIZERS),
        strategies=DATA_PARALLEL,
        on_resume="run",
    )

    # parameter server (--strategy ps): the last S ranks serve, the others work
    servers: int = flag(1, "server ranks (the last S of the world)", strategies=("ps",))
    consistency: str = flag("bsp", "bsp (every clock together), asp (each push as it comes) or "
                            "ssp:K (no worker more than K clocks ahead of the slowest)",
                            strategies=("ps",))  # fmt: skip
    ps_optimizer: str = flag("adamw", "the servers' optimizer (momentum: SGD with momentum 0.9)",
                             choices=("sgd", "momentum", "adamw"), strategies=("ps",),
                             on_resume="run")  # fmt: skip
    ps_slow_worker_ms: float = flag(0.0, "the last worker sleeps this long every step (to show "
                                    "ASP's gain)", strategies=("ps",))  # fmt: skip
    ps_timeout: float = flag(60.0, "seconds a server waits for a silent worker (asp/ssp: dropped;"
                             " bsp: an error) and a worker for a server's reply",
                             strategies=("ps",))  # fmt: skip

    # the array backend (minidp/engine/backend.py): NumPy, or torch tensors on the CPU or a GPU
    backend: str = flag(
        "numpy",
        "array library of the engine: numpy, or torch tensors (torch's autograd off)",
        choices=("numpy", "torch"),
    )
    device: str = flag("cpu", "device of --backend torch", choices=("cpu", "cuda"), with_="backend")

    # the rank mesh and tensor parallelism (--strategy tp, hybrid)
    #   world = dp x tp: mpiexec -n 4 ... --strategy hybrid --dp 2 --tp 2
    dp: int = flag(
        0,
        "data-parallel size of the mesh (0: what the world leaves, world / tp)",
        strategies=("hybrid",),
    )
    tp: int = flag(
        0,
        "tensor-parallel size of the mesh (0: what the world leaves, world / dp)",
        strategies=("tp", "hybrid"),
    )
    sequence_parallel: bool = flag(
        False,
        "split LayerNorm and dropout regions along the sequence over the TP group",
        strategies=("tp", "hybrid"),
    )
    # context parallelism (hybrid, parallel/context_parallel/): world = dp x tp x pp x cp
    cp: int = flag(1, "context-parallel size: each rank of a CP group holds T/C positions",
                   strategies=("hybrid",), models=("gpt",))  # fmt: skip
    cp_algo: str = flag("ring", "attention over the CP group: ring attention or DeepSpeed-"
                        "Ulysses' all-to-alls", choices=("ring", "ulysses"), strategies=("hybrid",),
                        with_="cp")  # fmt: skip
    cp_layout: str = flag("auto", "which positions a CP rank holds: zig-zag (2C chunks, balanced "
                          "under the causal mask), contiguous, or auto: zig-zag for ring, "
                          "contiguous for ulysses", choices=("auto", "zigzag", "contiguous"),
                          strategies=("hybrid",), with_="cp")  # fmt: skip
    # mixture of experts (models/moe/, parallel/experts/; docs/experts.md), dp and hybrid
    experts: int = flag(0, "experts E in each MoE block's MLP place (0: none; a MoE GPT trains "
                        "under ExpertParallel, not DDP)", strategies=("dp", "hybrid"),
                        models=("gpt",), on_resume="model", interval="[0, inf)",
                        with_="experts")  # fmt: skip
    moe_top_k: int = flag(1, "experts a token goes to: 1 (Switch) or 2 (GShard)", choices=(1, 2),
                          on_resume="model", with_="experts")  # fmt: skip
    capacity_factor: float = flag(0.0, "an expert takes at most this x an even share of a rank's "
                                  "tokens (0: dropless)", on_resume="model", interval="[0, inf)",
                                  with_="experts")  # fmt: skip
    moe_every: int = flag(1, "a MoE in every block (1) or every other (2)", choices=(1, 2),
                          on_resume="model", with_="experts")  # fmt: skip
    aux_loss_coef: float = flag(0.01, "Switch's load-balancing loss weight", on_resume="model",
                                interval="[0, inf)", with_="experts")  # fmt: skip
    ep: int = flag(1, "expert-parallel ranks, carved out of the DP ranks: each holds E/N experts",
                   strategies=("dp", "hybrid"), with_="experts")  # fmt: skip

    # memory (every strategy): parallel/amp.py, engine/recompute.py, tools/memory.py
    precision: str = flag("fp32", "weights and gradients in 16 bits (float32 masters and "
                          "optimizer; fp16 with a loss scaler), or fp32", on_resume="model",
                          choices=("fp32", "bf16", "fp16"), strategies=STEPPED)  # fmt: skip
    offload: bool = flag(False, "ZeRO's optimizer state in a memory-mapped file, paged in "
                         "for each update (zero/offload.py)", strategies=("zero",))  # fmt: skip
    recompute: bool = flag(False, "each GPT block keeps only its input and runs again in "
                           "backward (less memory, one more forward)", models=("gpt",))  # fmt: skip
    max_memory_mb: float = flag(0.0, "a rank's cap on its peak RSS, MB (0: none; tools/memory.py"
                                ": check_cap, rank_floor_bytes)", interval="[0, inf)")  # fmt: skip

    # pipeline parallelism (--strategy pp, hybrid): 4 blocks, --pp 2 --virtual 2: 4 stages
    #   of 1 block; world = dp x tp x pp: mpiexec -n 8 ... --strategy hybrid --dp 2 --tp 2 --pp 2
    pp: int = flag(0, "pipeline stages' ranks (pp: 0 the world; hybrid: 0 none)", strategies=PP)
    micro_batches: int = flag(4, "micro-batches per step (m)", strategies=PP)
    schedule: str = flag("1f1b", "pipeline schedule", choices=PIPELINE_SCHEDULES, strategies=PP)
    virtual: int = flag(1, "stages per rank (V > 1: --schedule interleaved)", strategies=PP)

    # ZeRO (--strategy zero, hybrid)
    zero_stage: int = flag(0, "what ZeRO shards over the data-parallel ranks: 1 the optimizer "
                           "state, 2 and the gradients, 3 and the parameters (0: not set)",
                           strategies=("zero", "hybrid"))  # fmt: skip

    # gradient compression and pruning (--strategy dp, hybrid)
    compress: str = flag("none", "gradient compression NAME[:PARAM]: none, fp16, bf16, "
                         "topk:DENSITY, randomk:DENSITY, sign, sign-noef, qsgd:LEVELS, "
                         "powersgd:RANK (minidp/parallel/compression/table.py)",
                         strategies=("dp", "hybrid"), on_resume="run")  # fmt: skip
    compress_warmup: int = flag(0, "the first STEPS reductions of each bucket are the plain "
                                "allreduce, uncompressed, and compression starts from a zero "
                                "residual after (PyTorch PowerSGD's start_powerSGD_iter)",
                                strategies=("dp", "hybrid"), with_="compress",
                                on_resume="run")  # fmt: skip
    compress_on: str = flag("gradient", "what --compress compresses: the summed gradient, before "
                            "one shared optimizer (gradient), each rank's optimizer step, "
                            "lr-scaled, with error feedback on the step as in EF-SignSGD (update; "
                            "minidp/parallel/compression/update.py), or each rank's momentum-SGD "
                            "velocity, DGC's momentum correction and factor masking (velocity, "
                            "with --optimizer momentum and --compress topk or randomk; minidp/"
                            "parallel/compression/velocity.py)", on_resume="run",
                            strategies=("dp",),
                            choices=("gradient", "update", "velocity"))  # fmt: skip

    # pruning (minidp/models/prune/magnitude.py; the default run's schedule: docs/pruning.md)
    prune: float = flag(
        0.0,
        "target sparsity of the weight matrices, in [0, 1) (0 = off; biases "
        "and LayerNorm stay dense)",
        strategies=("dp",),
        on_resume="run",
        interval="[0, 1)",
    )
    prune_start: int | None = flag(None, "step the cubic pruning ramp starts", strategies=("dp",),
                                   of_steps=(1, 6, 0), with_="prune", on_resume="run")  # fmt: skip
    prune_end: int | None = flag(None, "step the target sparsity is reached", strategies=("dp",),
                                 of_steps=(2, 3, 0), with_="prune", on_resume="run")  # fmt: skip
    prune_every: int | None = flag(None, "steps between pruning steps", strategies=("dp",),
                                   of_steps=(1, 30, 1), with_="prune", on_resume="run")  # fmt: skip
    prune_scope: str = flag("global", "one magnitude threshold over all weight matrices, or one "
                            "per matrix", choices=("global", "layer"), strategies=("dp",),
                            with_="prune", on_resume="run")  # fmt: skip
    # structured pruning (minidp/models/prune/structured.py, parallel/structured_pruning.py)
    prune_structured: float = flag(0.0, "remove this fraction of each block's attention heads and "
                                   "MLP channels (an MLP's hidden channels) by L2 norm at one "
                                   "step and slice the weights: a smaller dense model, fine-tuned "
                                   "for the steps left (0 = off)", strategies=("dp",),
                                   on_resume="run", interval="[0, 1)")  # fmt: skip
    prune_structured_at: int | None = flag(None, "the step --prune-structured prunes at",
                                           strategies=("dp",), of_steps=(1, 3, 0), on_resume="run",
                                           with_="prune_structured")  # fmt: skip
    # distillation (`python -m minidp distill`: models/distill.py, parallel/distill.py)
    teacher: str | None = flag(None, "train the model as a student of the one saved in DIR "
                               "(a run's --save-dir): Hinton et al.'s soft targets and the "
                               "labels", strategies=("dp",), on_resume="run")  # fmt: skip
    temperature: float = flag(2.0, "the soft targets' temperature T", with_="teacher",
                              strategies=("dp",), on_resume="run", interval="(0, inf)")  # fmt: skip
    alpha: float = flag(0.5, "the soft targets' weight (1 - alpha: the labels')", with_="teacher",
                        strategies=("dp",), on_resume="run", interval="[0, 1]")  # fmt: skip


def config_fields():
    """(name, default, type, metadata) for each TrainConfig field, in order."""
    return [(f.name, f.default, f.type, f.metadata) for f in fields(TrainConfig)]


__all__ = ["DATA_PARALLEL", "BadConfig", "TrainConfig", "config_fields", "flag", "staleness_bound"]
