"""`python -m minidp predict [train flags] --world N`: a run's step cost, before running it.

    python -m minidp predict --strategy hybrid --dp 2 --tp 2 --world 4
    python -m minidp predict --strategy zero --zero-stage 3 --world 4 --calibration FILE
    mpiexec -n 4 python -m minidp predict --strategy zero --zero-stage 3   # on the 4 ranks

The step model is minidp/cost/step.py (pure Python); this module feeds it from a TrainConfig
(the pipeline's: predict_pp.py, the parameter server's: predict_ps.py):

    layout      the flags (--strategy, --dp, --tp, --cp, --cp-algo, --zero-stage, --grad-accum,
                --allreduce, --bucket-mb, --overlap, --compress, --sequence-parallel; the
                experts': predict_experts.py) on N ranks
                (--world, or mpiexec's -n)
    shapes      the GPT's (cost.calls.gpt_shapes: no model built for the sizes)
    compute     measured here, one process: the whole model's forward, backward and
                optimizer step on this rank's examples (B / dp), two steps untimed
                then the median of 7, with the BLAS threads the run would
                have (cores / N). The run's ranks share the machine's cores: the model
                stretches compute and communication by N / cores when N > cores.
                Under mpiexec -n N instead, every rank measures at once (the sharing is
                in the measurement) and the per-call cost is timed on them (on_group).
                With tp > 1, also on half the examples: the part of the time that does not
                shrink with the work (`fixed_part`: the ops' own cost), which TP keeps whole;
                with --compress, the compressor's own work (predict_compress.py)
    network     α, β, γ from `python -m minidp bench calibrate` (runs/calibration.json, or
                --calibration FILE); without one, built-in defaults, said so in the output;
                the per-call cost from the file's "per_call" if it has one (else 0)

A `--json` run of the command line gets `for_run` at its end (cost/predicted.py's
`in_record`, which the command line hands the loop as one of its `adds`), with what the
run's own ranks see: the per-call cost timed on its group, the emulated network, shared
memory and overlap as the run decided them); the final record gets the prediction beside
what the run measured.
"""

import json
import os

import numpy as np

from minidp import comm
from minidp.cli.training.config import BadConfig
from minidp.cost.calls import gpt_shapes
from minidp.cost.experts import moe_shapes
from minidp.cost.predict_compress import check_compress, compressor_seconds, spelled_out
from minidp.cost.predict_compute import measure_compute, runs_alone
from minidp.cost.step import Compute, Layout, Network, fixed_part, predict
from minidp.models.tasks import Task
from minidp.tools.memory import activation_estimate

CALIBRATION = "runs/calibration.json"
DEFAULT_NETWORK = {"alpha": 2e-6, "beta": 6e-10, "gamma": 7e-10, "delta": 1e-10}  # this VM's order
COVERED = ("dp", "zero", "tp", "hybrid", "pp", "ps")


def layout_of(config, world: int) -> Layout:
    """The Layout the flags describe on `world` ranks; BadConfig (one line) if none."""
    from minidp.cli.strategies.tp import hybrid_sizes
    from minidp.cost.predict_pp import pipeline_layout, uses_pipeline

    if config.strategy not in COVERED:
        raise BadConfig(f"predict covers --strategy {', '.join(COVERED)}; got {config.strategy}")
    if config.model != "gpt" or config.backend != "numpy":
        raise BadConfig(
            f"predict models the GPT on NumPy; --model {config.model}, --backend {config.backend}"
        )
    if config.prune:
        raise BadConfig("predict does not model --prune yet")
    if config.experts:  # cost/predict_experts.py: ExpertParallel's all-to-alls
        from minidp.cost.predict_experts import experts_layout

        return experts_layout(config, world)
    if config.compress != "none":
        check_compress(config)  # cost/predict_compress.py
    if uses_pipeline(config):  # cost/predict_pp.py
        if config.sequence_parallel:
            raise BadConfig("predict does not model --sequence-parallel with --pp yet")
        return pipeline_layout(config, world)
    if config.strategy == "ps":  # cost/predict_ps.py
        from minidp.cost.predict_ps import ps_layout

        return ps_layout(config, world)
    whole = config.strategy in ("dp", "zero")
    dp, tp, cp = (world, 1, 1) if whole else hybrid_sizes(config, world)
    if dp * tp * cp != world:
        raise BadConfig(f"--world {world}: the mesh dp x tp x cp = {dp} x {tp} x {cp}")
    if config.batch_size // dp < config.grad_accum:
        raise BadConfig(f"--batch-size {config.batch_size} over {dp} ranks: too few examples")
    overlap = {"on": True, "off": False}.get(config.overlap)
    if overlap is None:  # auto: comm_thread.overlap_helps' rule, for N ranks on these cores
        overlap = dp > 1 and (os.cpu_count() or 1) / world >= 2
    return Layout(
        config.strategy,
        dp=dp,
        tp=tp,
        zero_stage=config.zero_stage,
        grad_accum=config.grad_accum,
        overlap=overlap,
        algo=config.allreduce,
        bucket_mb=config.bucket_mb,
        compress=spelled_out(config.compress),
        sequence_parallel=config.sequence_parallel,
        cp=cp,
        cp_algo=config.cp_algo,
    )


def load_network(path: str | None, cores: int) -> tuple[Network, str]:
    """(Network, where α β γ came from): FILE, runs/calibration.json, or the defaults."""
    chosen = path or CALIBRATION
    if os.path.exists(chosen):
        try:
            with open(chosen) as f:
                fit = json.load(f)
        except (OSError, ValueError) as error:
            raise BadConfig(f"{chosen}: cannot read a calibration ({error})") from None
        if not isinstance(fit, dict):
            raise BadConfig(f"{chosen}: not a calibration (alpha, beta, gamma numbers)")
        source = f"{chosen} ({fit.get('date', '?')}, P = {fit.get('nprocs', '?')})"
    elif path:
        raise BadConfig(f"--calibration {path}: no such file")
    else:
        fit = DEFAULT_NETWORK
        source = "built-in defaults (run `mpiexec -n 2 python -m minidp bench calibrate`)"
    try:
        alpha, beta, gamma = (float(fit[k]) for k in ("alpha", "beta", "gamma"))
        per_call = float(fit.get("per_call", 0.0))
        delta = float(fit.get("delta", 0.0))  # calibrations before 2026-12-04 have none
    except (KeyError, TypeError, ValueError):
        raise BadConfig(f"{chosen}: not a calibration (alpha, beta, gamma numbers)") from None
    if not (alpha >= 0 and beta > 0 and gamma > 0 and per_call >= 0 and delta >= 0):
        raise BadConfig(
            f"{chosen}: alpha {alpha}, beta {beta}, gamma {gamma}, delta {delta}: "
            "need a, d >= 0 and b, g > 0"
        )
    return Network(alpha, beta, gamma, cores, per_call, delta), source


def run_prediction(
    config, world: int, *, cores: int, network: Network, threads: int, layout=None, rank=0,
    measured: Compute | None = None,
):  # fmt: skip
    """(Prediction, Layout) for `config` on `world` ranks (the flags' layout, or `layout`);
    compute measured here, or `measured` (a TP rank's own, measured on the ranks:
    predicted.tensor_parallel_compute); bytes and memory rank `rank`'s (a pipeline's and a
    parameter server's step too)."""
    from threadpoolctl import threadpool_limits

    layout = layout or layout_of(config, world)
    if layout.pp > 1 or layout.strategy in ("pp", "ps"):
        from minidp.cost.predict_pp import run_pipeline_prediction
        from minidp.cost.predict_ps import run_ps_prediction

        run = run_ps_prediction if layout.strategy == "ps" else run_pipeline_prediction
        net = network._replace(cores=cores)
        return run(config, layout, network=net, threads=threads, rank=rank), layout
    task = Task(config, np.dtype(config.dtype))
    examples = -(-config.batch_size // layout.dp)  # rank 0's: chunk_bounds' first chunk
    vocab = task.model.config.vocab_size
    tp_rank = rank % layout.tp  # mesh rank (d·cp + c)·tp + t: its TP shard's, its own bytes
    shapes = gpt_shapes(config.n_layer, config.n_embd, vocab, config.block_size, layout.tp, tp_rank)
    if layout.experts:  # this rank's E/ep experts a MoE block
        shapes = moe_shapes(config.n_layer, config.n_embd, vocab, config.block_size,
                            layout.experts, layout.ep, layout.tp, tp_rank)  # fmt: skip
    with threadpool_limits(limits=threads, user_api="blas"):
        compute = measured or measure_alone(task, config, examples, layout.tp)
        if layout.compress != "none":  # on the whole model's buckets; a TP shard has fewer
            whole = sum(p.size for p in task.model.parameters())
            spent = compressor_seconds(config, task, examples) * sum(shapes.params) / whole
            compute = compute._replace(compress_s=spent)
    itemsize = np.dtype(config.dtype).itemsize
    activations = activation_estimate(config, examples // config.grad_accum, layout.tp)
    net = network._replace(cores=cores)
    prediction = predict(
        layout,
        shapes,
        compute,
        net,
        batch_size=config.batch_size,
        itemsize=itemsize,
        activations=activations,
        rank=rank,
    )
    return prediction, layout


def measure_alone(task, config, examples: int, tp: int) -> Compute:
    """The compute of the model the strategy runs, on this process (predict_compute.py);
    with tp > 1 also on half the examples, for the part a TP split keeps whole."""
    with runs_alone(task, tp) as run:
        compute = measure_compute(run, config, examples)
        if tp > 1 and examples >= 2:
            half = measure_compute(run, config, examples // 2)
            compute = compute._replace(fixed=fixed_part(compute, half))
    return compute


def prediction_record(prediction, measured_step_s: float | None = None) -> dict:
    """The JSON record's fields: the prediction per step (and the measured step, if given)."""
    record = {
        "predicted_step_s": prediction.step_s,
        "predicted_compute_s": prediction.compute_s,
        "predicted_comm_s": prediction.comm_s,
        "predicted_exposed_comm_s": prediction.exposed_comm_s,
        "predicted_compress_s": prediction.compress_s,
        "predicted_bytes_by_axis_per_step": prediction.bytes_by_axis,
        "predicted_memory_bytes": prediction.memory_bytes,
    }
    if measured_step_s is not None:
        record["measured_step_s"] = measured_step_s
        record["predicted_over_measured"] = prediction.step_s / measured_step_s
    return record


def describe(prediction, layout: Layout, world: int, source: str, cores: int) -> str:
    """The lines `predict` prints."""
    p = prediction
    mesh = (
        f"dp {layout.dp} x tp {layout.tp}"
        + (f" x pp {layout.pp}" if layout.pp > 1 else "")
        + (f" x cp {layout.cp} ({layout.cp_algo})" if layout.cp > 1 else "")
        + (f", ZeRO stage {layout.zero_stage}" if layout.zero_stage else "")
        + (f", ep {layout.ep}" if layout.experts else "")
        + (", sequence parallel" if layout.sequence_parallel else "")
    )
    ps = layout.strategy == "ps"
    if ps:
        mesh = f"{layout.dp} workers, {layout.servers} servers, {layout.consistency}"
    exposed = {  # what the exposed part holds beyond messages and collectives
        "pp": "the bubble's waits, and ",
        "ps": "the wait for the servers' optimizer, and ",
    }.get("ps" if ps else "pp" if layout.pp > 1 else "")
    if not cores:  # measured on the ranks themselves
        stretch = f", compute measured on the {world} ranks at once"
    else:
        stretch = f", {world} ranks on {cores} cores" if world > cores else ""
    ms = 1e3
    return "\n".join(
        [
            f"predicted step: {layout.strategy} on {world} ranks ({mesh}{stretch})",
            f"α, β, γ: {source}",
            f"step {p.step_s * ms:.2f} ms = compute {p.compute_s * ms:.2f} ms (forward "
            f"{p.forward_s * ms:.2f}, backward {p.backward_s * ms:.2f}, "
            f"{'the servers: ' if ps else ''}optimizer {p.optimizer_s * ms:.2f}"
            + (f", compressor {p.compress_s * ms:.2f}" if p.compress_s else "")
            + f") + exposed "
            f"comm {p.exposed_comm_s * ms:.2f} ms "
            + (
                f"({exposed}{p.comm_s * ms:.2f} ms of messages and collectives)"
                if exposed
                else f"(of {p.comm_s * ms:.2f} ms, overlap {'on' if layout.overlap else 'off'})"
            ),
            "bytes sent per rank per step: "
            + ", ".join(f"{axis} {b:,}" for axis, b in p.bytes_by_axis.items()),
            "memory per rank, bytes: "
            + ", ".join(f"{name} {b:,}" for name, b in p.memory_bytes.items()),
        ]
    )


def main(argv: list[str]) -> int:
    """`python -m minidp predict [train flags] [--world N] [--calibration FILE]`."""
    from minidp.cli.commands import train_parser
    from minidp.cost.predict_experts import assumed_slots
    from minidp.tools.log import die, print0

    parser = train_parser()
    parser.prog = "minidp predict"
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--world", type=int, default=0, help="ranks (default: the MPI world's)")
    parser.add_argument("--calibration", metavar="FILE", help=f"α β γ (default: {CALIBRATION})")
    args = vars(parser.parse_args(argv))
    world, calibration = args.pop("world"), args.pop("calibration")
    from minidp.cli.training.config import TrainConfig

    config = TrainConfig(**args)
    try:
        config.validate()
        prediction, layout, world, source, cores, per_call = _predict(config, world, calibration)
    except BadConfig as error:
        raise die(str(error)) from None
    print0(describe(prediction, layout, world, source, cores))
    if layout.experts:  # which S the ep bytes assume (cost/experts.py)
        print0(assumed_slots(config, layout))
    if config.json and comm.world().rank == 0:
        with open(config.json, "w") as f:
            record = {"world_size": world, "strategy": config.strategy}
            record["predicted_per_call_s"] = per_call
            f.write(json.dumps({**record, **prediction_record(prediction)}) + "\n")
    return 0


def _predict(config, world: int, calibration: str | None):
    """predict's two ways: under mpiexec -n N (N > 1), on those ranks (on_group); alone, for
    --world N, compute measured here and stretched by N / cores."""
    launched = comm.world().size
    if world < 0 or (launched > 1 and world not in (0, launched)):
        raise BadConfig(
            f"--world must be a number of ranks >= 1 (under mpiexec, its -n {launched}), "
            f"got {world}"
        )
    world = world or launched
    cores = os.cpu_count() or 1
    network, source = load_network(calibration, cores)
    if launched > 1:
        from minidp.cost.predicted import on_group

        prediction, layout, network = on_group(config, comm.world(), network)
        us = network.per_call * 1e6
        source = f"{source}; per call {us:.0f} us, measured"
        return prediction, layout, world, source, 0, network.per_call
    threads = config.threads or max(1, cores // world)
    prediction, layout = run_prediction(
        config, world, cores=cores, network=network, threads=threads
    )
    return prediction, layout, world, source, cores, network.per_call
