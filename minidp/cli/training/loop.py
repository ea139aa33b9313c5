"""The training loop: `python -m minidp train` (see config.py for every flag).

    python -m minidp                             # the tiny GPT on one process
    mpiexec -n 4 python -m minidp                # the same job, data parallel over 4 ranks
    python -m minidp --model mlp --steps 200     # an MLP on the synthetic clusters

One loop for every scheme. It reads top to bottom: build the task (model and data) from one
seed, so every rank holds the same model; hand it to the strategy that `--strategy` names
(minidp.cli.strategies.STRATEGIES; the protocol is in strategies/protocol.py); then, for each step,
take the examples of the global batch this rank computes on and let the strategy do the
step (forward, backward, communication, clipping, optimizer); log; report. Who writes: the
group's rank 0 prints, writes the JSON records and the sample; every rank may keep a log.
"""

import contextlib
import functools

import numpy as np

from minidp import comm
from minidp.cli.strategies import STRATEGIES
from minidp.cli.training import resume
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.cli.training.drift import check_replicas
from minidp.cli.training.nonfinite import TrainingDiverged as TrainingDiverged  # re-exported
from minidp.cli.training.nonfinite import nonfinite_step
from minidp.comm.trace import Timeline
from minidp.engine import optim
from minidp.models import data
from minidp.models.tasks import Task, TextTooShort
from minidp.parallel import across_ranks
from minidp.parallel.checkpoint import CheckpointError, Preempted, Preemption
from minidp.parallel.distill import distilled as distill_from
from minidp.tools.info import blas_info, cores_per_rank, mpi_library
from minidp.tools.log import RankLog, print0
from minidp.tools.memory import check_cap, peak_rss_bytes, rank_floor_bytes
from minidp.tools.meter import StepMeter
from minidp.tools.records import Records, closing_lines, progress


def blas_threads_per_rank(requested: int) -> int:
    """`requested`, or the cores shared fairly among the ranks on this machine.

    Ranks that outnumber cores must not each start a pool of spinning BLAS threads: that
    alone makes training many times slower (docs/data_parallel.md)."""
    return requested or max(1, int(cores_per_rank()))


def train(
    config: TrainConfig, group: comm.Group | None = None, signals: bool = False, adds=()
) -> dict:
    """Train as `config` says over `group` (default: every rank); print progress from the
    group's rank 0; return the final record. `signals`: SIGTERM, SIGINT and --save-signal
    stop the run (parallel/checkpoint/preemption.py; the command line's runs), else they are
    left to the caller. `adds`: functions `add(config, group, step_s) -> dict` whose fields
    join the final record, each collective on the ranks still in the job, `step_s` the mean
    step of this launch after its first (None: none); the command line adds the cost model's
    prediction this way (minidp/cost/predicted.py), of which the loop knows nothing. NumPy's
    floating-point warnings are off: an overflow on the way to a NaN would print a dozen
    lines before the loop's own check names the step (nonfinite.py)."""
    from threadpoolctl import threadpool_limits

    with (
        threadpool_limits(limits=blas_threads_per_rank(config.threads), user_api="blas"),
        np.errstate(over="ignore", invalid="ignore", divide="ignore"),
        Preemption(config.save_signal) if signals else contextlib.nullcontext() as preemption,
    ):
        return _train(config, group or comm.world(), preemption or Preemption(), adds)


def _train(config: TrainConfig, group: comm.Group, preemption: Preemption, adds) -> dict:
    config = config.resolved()  # the step-counted flags left unset follow --steps
    say = functools.partial(print0, rank=group.rank)  # one writer: the group's rank 0
    if config.strategy not in STRATEGIES:
        raise BadConfig(f"--strategy {config.strategy!r}: choose from {', '.join(STRATEGIES)}")
    check_floor(config, group)  # --max-memory-mb: before any rank builds the model
    deferred = STRATEGIES[config.strategy].builds_deferred(config)  # ZeRO-3: never whole
    try:
        task = Task(config, np.dtype(config.dtype), deferred=deferred)
    except TextTooShort as error:  # alike on every rank: one line
        raise BadConfig(str(error)) from None
    if config.teacher is not None:  # distill: the student's loss from the saved teacher's
        try:
            task = distill_from(task, config.teacher, group, config.temperature, config.alpha)
        except CheckpointError as error:  # alike on every rank: one line
            raise BadConfig(f"--teacher {config.teacher}: {error}") from None
    timeline = Timeline(enabled=config.trace is not None)
    with (
        resume.own_save_dir(config, group),  # one job at a time in --save-dir
        STRATEGIES[config.strategy](task, config, group, timeline) as strategy,
    ):
        built = peak_rss_bytes()  # the high-water mark of building and sharding the model
        sampler = None
        if strategy.data_shard is not None:  # None: this rank reads no data
            try:
                sampler = data.DistributedSampler(
                    task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
                )
            except ValueError as error:  # a batch larger than the data: alike on every rank
                raise BadConfig(f"--batch-size {config.batch_size}: {error}") from None
        say(
            f"minidp train | model {config.model} ({task.model.num_parameters():,} parameters)"
            f" | strategy {config.strategy} | world size {group.size} | "
            f"numpy {np.__version__} | {blas_info()}"
        )
        say(f"MPI: {mpi_library()} | {strategy.describe()}")
        say(config.header())

        start, before = resume.resume(config, strategy, group, task)  # 0, {} or the saved
        # the saves talk on a group of their own: what they send is not training's traffic
        saves = resume.saves_group(group) if config.save_dir is not None else None
        if saves is not None:
            preemption.arm(saves)  # from here a signal stops the run after a step, saved
        else:
            preemption.disarm("nothing is saved without --save-dir")
        log = RankLog(config.log_dir, group.rank)
        meter = StepMeter(strategy)
        records = Records(config.json if group.rank == 0 else None, keep_before=start)
        skipped = []  # steps with a non-finite loss or gradient (--skip-nonfinite)
        overflowed = []  # steps a loss scaler skipped (--precision fp16), this launch's
        try:
            for step in range(start, config.steps):
                preemption.step = step
                lr = optim.warmup_cosine(
                    step, config.lr, config.warmup, config.steps, config.min_lr_ratio
                )
                local = sampler.local_indices(step) if sampler is not None else None
                result = strategy.step(local, lr)
                loss, local_loss = result.loss, result.local_loss
                # alike on every rank; a loss scaler's overflow is mixed precision's normal skip
                if result.overflow:
                    overflowed.append(step)
                if not (result.stepped or result.overflow) or not np.isfinite(loss):
                    skipped.append(nonfinite_step(step, result, config, group, say, log, skipped))
                n_local = 0 if local is None else len(local)
                log.write(
                    f"step {step} local_examples {n_local} local_loss {local_loss:.6f} "
                    f"global_loss {loss:.6f}"
                )
                meter.count()
                check_cap(config.max_memory_mb, group.rank, f"in step {step}")
                if config.check_every and (step + 1) % config.check_every == 0:
                    with meter.aside():  # not a training step's time
                        check_replicas(strategy, step)  # collective; stops naming a drift
                if step % config.log_every == 0 or step == config.steps - 1:
                    window = meter.window()
                    records.write(progress(step, loss, lr, window, config.batch_size, task, say))
                counters = functools.partial(meter.so_far, skipped, before)
                with meter.aside():
                    done = step + 1
                    saved = resume.save_if_due(config, strategy, saves, task, done, counters)
                    # collective when armed; the last step ends the run anyway, saved
                    if done < config.steps and (signum := preemption.agreed()):
                        saved = saved or resume.save(config, strategy, saves, task, done, counters)
                        stop = Preempted(signum, done, config.steps, saved, config.save_dir)
                        records.write(stop.record)
                        raise stop
        except BaseException:
            records.close()  # what was logged stays, each line whole
            raise
        finally:
            preemption.disarm("the run is past its last step; what it saved is whole")
            log.close()
            if saves is not None:
                saves.free()
        # what training sent and held, read before the reports below add their own
        counts, memory = meter.so_far(skipped, before), strategy.memory_bytes()
        launch = meter.steady()  # this launch's steps after its first, for what `adds` adds
        step_s = launch.seconds / launch.steps if launch.steps else None
        # collective among the ranks still in the job (a dropped ps worker is not)
        per_rank = across_ranks.per_rank(memory, strategy.group)  # shards differ by rank
        if not strategy.sharded_forward:  # ZeRO-3's forward gathers layer by layer instead
            strategy.gather_model()  # the whole trained model in task.model, for what follows
        final = {
            "final_loss": loss,
            "val_loss": (  # a sharded forward: each rank one slice of every batch, summed
                across_ranks.split_mean(task.validation_loss, strategy.group)
                if strategy.sharded_forward
                else task.validation_loss()
            ),
            "steps": config.steps,
            "world_size": group.size,
            "strategy": config.strategy,
            "param_l2": strategy.param_l2(),
            "max_param_diff": strategy.max_param_diff(),
            "time_s": counts["time_s"],  # with the launches before a resume (StepMeter.so_far)
            "comm_s": counts["comm_s"],
            "exposed_comm_s": counts["exposed_comm_s"],
            "bytes_sent_per_rank": counts["bytes_sent_per_rank"],
            "bytes_sent_by_axis": counts["bytes_sent_by_axis"],
            "memory_bytes": memory,
            "memory_bytes_per_rank": per_rank,
            "model": config.model,
            "dtype": config.dtype,
            "precision": config.precision,
            "skipped_steps": counts["skipped_steps"],
            **strategy.record(),
            **({"overflow_at": overflowed} if config.precision == "fp16" else {}),
        }
        check_cap(config.max_memory_mb, group.rank, "in validation or the checks")
        # the OS's figure, after training, validation and the checks; before what `adds`
        # adds (the cost model's prediction builds and times a model of its own); and the
        # same figure as it was once the task and the strategy were built
        peaks = np.array([peak_rss_bytes(), built], dtype=np.int64)
        peaks = comm.allgather(peaks, group=strategy.group).reshape(-1, 2)
        final["peak_rss"], final["peak_rss_built"] = peaks[:, 0].tolist(), peaks[:, 1].tolist()
        for add in adds:
            final.update(add(config, strategy.group, step_s))
        final["config"] = vars(config)  # every field, those of other strategies too
        sample = None  # drawn before the strategy closes: a sharded model's forward gathers
        if group.rank == 0 or strategy.sharded_forward:  # (then every rank draws, together)
            sample = task.sample()
    records.write(final)  # the last line
    records.close()
    for line in closing_lines(final):
        say(line)
    if line := strategy.summary():
        say(line)
    if sample is not None:
        say("sample:\n" + sample)
    if config.trace:
        timeline.save(config.trace, strategy.group)
        say(f"timeline: {config.trace} (open in ui.perfetto.dev)")
    return final


def check_floor(config: TrainConfig, group: comm.Group) -> None:
    """Collective: refuse a --max-memory-mb that the least a rank would hold already passes
    (the largest among the ranks, so every rank decides alike)."""
    floor = config.max_memory_mb and rank_floor_bytes(config, group.size)
    if not floor:
        return
    every = comm.allgather(np.array(list(floor.values())), group=group).reshape(group.size, -1)
    r = int(np.argmax(every.sum(axis=1)))  # the largest rank's parts, the same on every rank
    if every[r].sum() > config.max_memory_mb * 1e6:
        parts = ", ".join(f"{part} {b / 1e6:,.0f}" for part, b in zip(floor, every[r]))
        raise BadConfig(
            f"--max-memory-mb {config.max_memory_mb:g}: a rank of this run holds at least "
            f"{every[r].sum() / 1e6:,.0f} MB (rank {r}: {parts}): --strategy zero "
            "--zero-stage 3, --precision bf16, --recompute or more ranks hold less"
        )
