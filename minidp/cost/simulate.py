"""`python -m minidp simulate`: what 1,024 ranks would do, from minidp.cost's model alone.

    python -m minidp simulate --nprocs 1024 --model-params 1.3e9
    python -m minidp simulate --latency-us 10 --bandwidth-gbs 1.25 --png-dir runs/sim
    python -m minidp simulate --strategy zero --zero-stage 3 --trace runs/sim_trace.json

One process, no MPI job, no measurement: every figure is a formula of minidp.cost evaluated
(cost/scale.py walks them over ranks, sizes and bandwidths; cost/step.py is the step; the
pipeline's bubbles are parallel/pipeline/simulate.py's). At P = 2 and 4 the step figures
are exactly step.py's, the model `predict` checks against measured runs.

The network: α from --latency-us, β from --bandwidth-gbs (GB/s, bytes), γ from --reduce-gbs;
--calibration FILE takes all three (and δ, an allgather's local copy) from `bench
calibrate`'s fit instead, and a flag given on the command line still wins. The defaults are
a cluster's, not this machine's: 5 µs and 25 GB/s (a 200 Gb/s InfiniBand link a GPU, as in
a DGX A100), reductions and copies at 100 GB/s.
The compute: 6·Ψ FLOPs a token (forward 2Ψ, backward 4Ψ) at --tflops (default 100: a
recent GPU's sustained rate, ~40% of its bf16 peak), --tokens-per-rank per step (default
2,048: one sequence; 1,024 ranks then take 2M tokens a step, GPT-3's batch sizes); AdamW
at --memory-gbs. The model is minidp's GPT (untied head, V = 50,257, T = 2,048) of --layers
blocks, its width the multiple of 128 whose Ψ is nearest --model-params.
"""

import json

from minidp.cli.training.config import BadConfig
from minidp.cost import chrome, report, scale
from minidp.cost.predict import load_network
from minidp.cost.step import Layout, Network, predict
from minidp.parallel.pipeline.schedules import SCHEDULES, build_schedule
from minidp.parallel.pipeline.simulate import summary
from minidp.tools.log import die, print0
from minidp.tools.parser import Parser

GROUPS = (2, 3, 4, 6, 8, 16, 32, 64, 100, 128, 256, 512, 1000, 1024)
SIZES = tuple(1 << k for k in range(10, 31, 2))  # 1 KiB .. 1 GiB, every 4x


def parser() -> Parser:
    p = Parser(prog="minidp simulate", description=__doc__.split("\n\n")[2])
    add = p.add_argument
    add("--nprocs", type=int, default=1024, help="ranks (default: 1024)")
    add("--model-params", type=float, default=1.3e9, help="Ψ, parameters (default: 1.3e9)")
    add("--layers", type=int, default=24, help="GPT blocks; the width is fitted to Ψ (24)")
    add("--latency-us", type=float, help="α in µs (default: 5)")
    add("--bandwidth-gbs", type=float, help="1/β in GB/s (default: 25)")
    add("--reduce-gbs", type=float, help="1/γ in GB/s (default: 100)")
    add("--calibration", metavar="FILE", help="α, β, γ from bench calibrate's JSON")
    add("--tflops", type=float, default=100.0, help="sustained TFLOP/s a rank (default: 100)")
    add("--tokens-per-rank", type=int, default=2048, help="a step, a multiple of 2048 (2048)")
    add("--memory-gbs", type=float, default=1000.0, help="the optimizer's GB/s (default: 1000)")
    add(
        "--compress-gbs",
        type=float,
        default=100.0,
        help="a compressor's encode and decode, GB/s of values (default: 100)",
    )
    add("--bucket-mb", type=float, default=25.0, help="DDP's bucket cap in MiB (default: 25)")
    add(
        "--strategy",
        choices=("dp", "zero", "tp", "hybrid"),
        default="dp",
        help="the step summarized and traced (default: dp)",
    )
    add("--zero-stage", type=int, choices=(1, 2, 3), default=1, help="with --strategy zero")
    add("--tp", type=int, default=8, help="TP ranks for tp, hybrid and memory (default: 8)")
    add("--pp", type=int, default=8, help="pipeline ranks: bubbles, memory (default: 8)")
    add("--micro-batches", type=int, default=32, help="a pipeline's m (default: 32)")
    add("--no-overlap", action="store_true", help="the traced step reduces after backward")
    add("--trace", metavar="FILE", help="the step's simulated Chrome-trace timeline")
    add("--trace-ranks", type=int, default=4, help="ranks drawn in --trace (default: 4)")
    add("--png-dir", metavar="DIR", help="save the crossover, scaling, breakeven plots")
    add("--json", metavar="FILE", help="save every table's rows")
    return p


def network(args) -> Network:
    """α, β, γ (δ): the flags, else --calibration's, else the defaults (module docstring)."""
    fit = {"alpha": 5e-6, "beta": 1 / 25e9, "gamma": 1 / 100e9, "delta": 1 / 100e9}
    if args.calibration:
        try:
            fit = load_network(args.calibration, cores=0)[0]._asdict()
        except (BadConfig, OSError, ValueError, KeyError, TypeError) as error:
            raise die(f"--calibration {args.calibration}: {error}") from None
    if args.latency_us is not None:
        fit["alpha"] = args.latency_us * 1e-6
    if args.bandwidth_gbs is not None:
        fit["beta"] = 1 / (args.bandwidth_gbs * 1e9)
    if args.reduce_gbs is not None:
        fit["gamma"] = 1 / (args.reduce_gbs * 1e9)
    return Network(fit["alpha"], fit["beta"], fit["gamma"], delta=fit["delta"])


def check(args) -> None:
    """Every bad value is one line naming its flag."""
    positive = ["nprocs", "layers", "tokens_per_rank", "tp", "pp", "micro_batches", "trace_ranks"]
    for name in positive:
        if getattr(args, name) < 1:
            raise die(f"--{name.replace('_', '-')} must be a positive integer")
    for name in ("model_params", "tflops", "memory_gbs", "compress_gbs", "bucket_mb"):
        if not getattr(args, name) > 0:
            raise die(f"--{name.replace('_', '-')} must be positive")
    for name in ("latency_us", "bandwidth_gbs", "reduce_gbs"):
        value = getattr(args, name)
        if value is not None and not (value > 0 or (name == "latency_us" and value == 0)):
            raise die(f"--{name.replace('_', '-')} must be positive")
    if args.tokens_per_rank % 2048:
        raise die("--tokens-per-rank must be a multiple of the sequence length, 2048")
    if args.strategy in ("tp", "hybrid") and args.nprocs % args.tp:
        raise die(f"--tp {args.tp} must divide --nprocs {args.nprocs}")


def step_layout(args, overlap: bool) -> Layout:
    """The --strategy's layout on --nprocs ranks (tp: one TP group of --tp ranks alone)."""
    tp = args.tp if args.strategy in ("tp", "hybrid") else 1
    stage = args.zero_stage if args.strategy == "zero" else 0
    dp = 1 if args.strategy == "tp" else args.nprocs // tp
    return Layout(
        args.strategy,
        dp=dp,
        tp=tp,
        zero_stage=stage,
        overlap=overlap,
        bucket_mb=args.bucket_mb,
        shm=False,
    )


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    check(args)
    net = network(args)
    model = scale.gpt_of(args.model_params, args.layers)
    seqs = args.tokens_per_rank // model.seq
    compute = scale.flops_compute(model, seqs, args.tflops * 1e12, args.memory_gbs * 1e9)
    print0(
        f"# network: α = {net.alpha * 1e6:g} µs, 1/β = {1 / net.beta / 1e9:g} GB/s, "
        f"1/γ = {1 / net.gamma / 1e9:g} GB/s\n# model: GPT L={model.layers} C={model.hidden} "
        f"H={model.heads} V={model.vocab} T={model.seq}: Ψ = {model.params:.4g}; compute "
        f"{compute.forward_s + compute.backward_s:.4g} s a step ({args.tokens_per_rank} "
        f"tokens a rank at {args.tflops:g} TFLOP/s), optimizer {compute.optimizer_s:.3g} s"
    )
    record = {"network": net._asdict(), "model": model._asdict(), "params": model.params}
    for section in (crossover, scaling, compression, zero, pipeline, memory):
        record[section.__name__] = section(args, model, compute, net)
    record["step"] = one_step(args, model, compute, net)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
    if args.png_dir:
        report.save_all(record, args.png_dir)
    return 0


def crossover(args, model, compute, net) -> list[dict]:
    rows = scale.crossover(sorted({*GROUPS, args.nprocs}), SIZES, net)
    print0("\n## allreduce: the winner, its margin over the runner-up (* auto picks another)")
    print0(report.crossover_table(rows))
    return rows


def scaling(args, model, compute, net) -> list[dict]:
    P = args.nprocs
    ranks = sorted({*(1 << k for k in range(11) if 1 << k <= max(P, 2)), P})
    rows = scale.scaling(ranks, model, compute, net, bucket_mb=args.bucket_mb)
    print0(
        f"\n## data parallelism, {args.tokens_per_rank} tokens a rank, {args.bucket_mb:g} "
        "MiB buckets: efficiency = compute / step (cost/step.py)"
    )
    print0(report.scaling_table(rows))
    return rows


def compression(args, model, compute, net) -> list[dict]:
    rate, now = args.compress_gbs * 1e9, 8 / net.beta / 1e9
    dims = model.shapes().dims  # PowerSGD factors each matrix
    rows = [
        scale.breakeven(name, param, model.params, p, net, rate, compute.backward_s, dims)
        for p in sorted({2, 8, 64, 256, args.nprocs})
        for name, param in scale.COMPRESSORS
    ]
    print0(
        f"\n## compression pays below this bandwidth, Gb/s (its bytes ratio; + where it pays "
        f"at this {now:g} Gb/s), with overlap, its compute at {args.compress_gbs:g} GB/s"
    )
    print0(report.breakeven_table(rows, now))
    return rows


def zero(args, model, compute, net) -> list[dict]:
    rows = scale.zero_traffic(args.nprocs, model.params)
    print0(f"\n## ZeRO's traffic, rank 0 of {args.nprocs}, one step (cost.sent, ring, fp32)")
    print0(report.zero_table(rows))
    return rows


def pipeline(args, model, compute, net) -> list[dict]:
    rows = [
        summary(build_schedule(name, args.pp, args.micro_batches, 2 if cls.needs_virtual else 1))
        for name, cls in SCHEDULES.items()
    ]
    print0(
        f"\n## pipeline bubbles, pp {args.pp}, m {args.micro_batches} "
        "(parallel/pipeline/simulate.py, unit time)"
    )
    print0(report.pipeline_table(rows))
    return rows


def memory(args, model, compute, net) -> list[dict]:
    rows = scale.memory_table(
        model, args.nprocs, compute.examples, args.tp, args.pp, bucket_mb=args.bucket_mb
    )
    print0(
        f"\n## memory per rank ({args.nprocs} ranks, {compute.examples} sequence(s) a "
        "micro-batch; fp32, AdamW)"
    )
    print0(report.memory_table(rows))
    return rows


def one_step(args, model, compute, net) -> dict:
    """The --strategy's step (step.predict), printed; its timeline saved with --trace."""
    layout = step_layout(args, overlap=not args.no_overlap)
    shapes = model.shapes(layout.tp)
    batch = compute.examples * layout.dp
    acts = scale.activations(model, compute.examples, layout.tp)
    pred = predict(layout, shapes, compute, net, batch_size=batch, activations=acts)
    stage = f" stage {layout.zero_stage}" if layout.zero_stage else ""
    overlap = "overlapped" if layout.overlap else "after backward"
    print0(
        f"\n## one step: {layout.strategy}{stage}, dp {layout.dp} x tp {layout.tp}, the DP "
        f"axis {overlap}, {layout.bucket_mb:g} MiB buckets (cost/step.py)"
    )
    sent = ", ".join(f"{axis} {n:,}" for axis, n in pred.bytes_by_axis.items() if n)
    memory = sum(pred.memory_bytes.values()) / 1e9
    print0(
        f"step {pred.step_s:.4f} s = compute {pred.compute_s:.4f} + exposed communication "
        f"{pred.exposed_comm_s:.4f} (of {pred.comm_s:.4f}); bytes sent by rank 0: "
        f"{sent or 0}; memory {memory:.3g} GB a rank"
    )
    if args.trace:
        spans = chrome.step_spans(layout, shapes, compute, net, batch_size=batch)
        chrome.write_trace(args.trace, spans, min(args.trace_ranks, args.nprocs))
        print0(f"timeline: {args.trace} (open in ui.perfetto.dev beside a --trace of training)")
    return pred._asdict()
