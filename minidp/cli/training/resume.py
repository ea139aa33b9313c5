"""The loop's checkpoints: what resumes a run bit for bit, saved and restored.

    python -m minidp --steps 900 --save-dir run --save-every 300   # run/step_000300, ...
    python -m minidp --steps 900 --resume run                      # from run/step_000900's
    python -m minidp --steps 900 --resume run/step_000300          # ... or from that one

What a checkpoint holds, per rank (the format: minidp.parallel.checkpoint):
    step       the steps done; the next one runs at this index. It is the whole position of
               the loop: the learning rate is warmup_cosine(step) and the sampler's batch at
               step t is a pure function of (seed, t) (data.DistributedSampler reshuffles
               per epoch from (seed, epoch)), so neither holds state of its own, given the
               same flags: another --seed or --batch-size is refused (another order of the
               data), and so is another --steps, --lr, --warmup, optimizer or any flag of
               SAME_RUN (another run from that step on)
    rng        the state of every np.random.Generator the strategy reaches (the task's, the
               model's dropout, TP's per-rank dropout streams), by its attribute path
    strategy   strategy.state_dict(): model, optimizer, and the scheme's own state
               (compression residuals, pruning masks, ZeRO's shards, the servers' shards)
    counters   what the final record sums over the run (StepMeter.so_far): its time, comm
               and bytes sent so far, the steps skipped; a resumed run's record goes on
               from them, so it reports the whole run, as an uninterrupted one does

A strategy that says how its arrays are cut (`state_layout()`) can be resumed over another
number of ranks; what it does not declare is its ranks' own and reshards nowhere.
"""

import contextlib
import os
import sys
import time
import warnings

import numpy as np

from minidp import comm
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.models.tasks import vocabulary
from minidp.parallel import checkpoint
from minidp.parallel.checkpoint.reshard import describe_layout
from minidp.tools.flags import kept_on_resume
from minidp.tools.log import RunStopped, print0

MODEL_FIELDS = kept_on_resume(TrainConfig, "model")
"""What makes another model: a checkpoint saved with another value is refused."""
DATA_ORDER = kept_on_resume(TrainConfig, "data")  # the step is the data's position
SAME_RUN = kept_on_resume(TrainConfig, "run")
"""What makes another run from the resumed step on, the model and the data being the same
(the learning rate at every step, what each step does): refused too (Megatron-LM refuses
another learning-rate schedule in the same way). What only changes where the work runs
(the world size, the mesh, buckets, threads, logs) may differ. Each flag says which it is
(its metadata's "on_resume", config.py)."""


def loop_state(strategy, step: int) -> dict:
    return {"step": step, "rng": checkpoint.rng_states(strategy), "strategy": strategy.state_dict()}


def layout_words(config, group: comm.Group) -> str:
    """The layout a checkpoint was saved in, as a refusal names it."""
    words = f"--strategy {config.strategy} over {group.size} ranks"
    mesh = [
        f"--{k} {getattr(config, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if config.is_set(k)
    ]
    if config.strategy in ("zero", "hybrid") and config.zero_stage:  # its segments too
        mesh += [f"--zero-stage {config.zero_stage}", f"--bucket-mb {config.bucket_mb}"]
    if config.strategy == "pp" or config.pp > 1:  # which layers a rank holds
        mesh += [f"--schedule {config.schedule}", f"--virtual {config.virtual}"]
    if config.compress != "none":  # residuals and factors are each rank's own
        mesh += [f"--compress {config.compress}", f"--compress-on {config.compress_on}"]
    return words + (f" ({', '.join(mesh)})" if mesh else "")


def layout_of(strategy) -> dict:
    """{array path: "replicated" or a Slice's JSON}, from strategy.state_layout()."""
    return {
        f"strategy/{path}": where.as_json() if isinstance(where, checkpoint.Slice) else where
        for path, where in strategy.state_layout().items()
    }


@contextlib.contextmanager
def own_save_dir(config, group: comm.Group):
    """Collective: hold --save-dir's lock while the run goes on (checkpoint/lock.py); one
    line on every rank if another job holds it. Nothing without --save-dir."""
    with contextlib.ExitStack() as held:
        if config.save_dir is not None:
            try:
                held.enter_context(checkpoint.folder_lock(config.save_dir, group))
            except checkpoint.FolderInUse as error:
                raise BadConfig(f"--save-dir {error}") from None
        yield


def saves_group(group: comm.Group) -> comm.Group:
    """Collective: the group the loop's saves talk on: a dup (what they send is not
    training's traffic), without fingerprint checks (a save's few calls are fixed by its
    code; profiled, the checks' exchanges were a quarter of a rank's time in a save of the
    default GPT), with the deadline the group had."""
    saves = group.dup()
    deadline = saves.timeout  # 300 s or MINIDP_TIMEOUT (it follows checks unless set)
    saves.checks, saves.timeout = False, deadline
    return saves


class SaveFailed(RunStopped):
    """A checkpoint could not be written (a full disk, say), found alike on every rank:
    checkpoint.save gives every rank the first failing rank's reason. The checkpoints saved
    before stay whole (a save commits with its manifest, written last)."""


def save_if_due(config, strategy, group: comm.Group, task, done: int, counters=dict):
    """Collective: after `done` steps, save to --save-dir if --save-every says so (and at
    the end); return the checkpoint's path (None: none was due)."""
    every = config.save_every
    if config.save_dir is None or not (done == config.steps or (every and done % every == 0)):
        return None
    return save(config, strategy, group, task, done, counters)


def save(config, strategy, group: comm.Group, task, done: int, counters=dict) -> str:
    """Collective: save the loop's state after `done` steps to --save-dir, with
    `counters()` (StepMeter.so_far's) to carry into a resumed run's final record; its path."""
    path = checkpoint.step_directory(config.save_dir, done)
    metadata = {
        "config": vars(config),
        "layout": layout_words(config, group),
        "vocab": vocabulary(task),
    }
    start = time.perf_counter()
    state, layout = loop_state(strategy, done), layout_of(strategy)
    state["counters"] = counters()  # after state_dict(), whose traffic a run that goes on counts
    try:
        checkpoint.save(state, path, group, step=done, layout=layout, metadata=metadata)
    except checkpoint.CheckpointError as error:
        raise SaveFailed(
            f"the checkpoint of step {done} was not saved: {error} (those saved before are whole)"
        ) from None
    print0(f"saved {path} in {time.perf_counter() - start:.3f}s", rank=group.rank)
    return path


def resume(config, strategy, group: comm.Group, task) -> tuple[int, dict]:
    """Collective: load --resume into `strategy` and the RNGs; return the step to start at
    and the counts carried for the final record (StepMeter.so_far's; 0, {} without --resume).
    Every refusal is one line on every rank, before anything loads."""
    if config.resume is None:
        return 0, {}
    path = config.resume
    if not os.path.exists(os.path.join(path, checkpoint.MANIFEST)):
        with warnings.catch_warnings(record=True) as skipped:  # said once, not by every rank
            warnings.simplefilter("always")
            path = checkpoint.latest(config.resume) or path  # DIR: its newest complete one
        for warning in skipped:
            print0(f"minidp: warning: {warning.message}", rank=group.rank, file=sys.stderr)
    try:
        manifest = checkpoint.agreed_manifest(path, group)
        check_same_run(manifest, config, task, group)
        here = layout_words(config, group)
        layout = layout_of(strategy) if manifest["metadata"]["layout"] != here else None
        state = checkpoint.read(path, group, layout=layout, here=here)
    except checkpoint.CheckpointError as error:
        raise BadConfig(f"--resume {config.resume}: {error}") from None
    steps = comm.allgather(np.array([state["step"]], dtype=np.int64), group=group).ravel()
    if (steps != steps[0]).any():
        raise BadConfig(f"--resume {path}: its shards disagree on the step: {steps.tolist()}")
    try:  # a rank whose state does not fit (pipeline ranks hold different stages): every
        checkpoint.together(lambda: strategy.load_state_dict(state["strategy"]), group)
    except checkpoint.CheckpointError as error:  # rank refuses with it, in one line
        raise BadConfig(f"--resume {path}: its state does not fit this run ({error})") from None
    checkpoint.set_rng_states(strategy, state["rng"])
    print0(f"resumed from {path} at step {state['step']}", rank=group.rank)
    return int(state["step"]), state.get("counters", {})


def check_same_run(manifest: dict, config, task, group: comm.Group) -> None:
    """Refuse another model, order of the data, run (SAME_RUN), vocabulary, strategy or a
    step past --steps (every rank reads the same manifest: the same decision everywhere)."""
    saved = manifest["metadata"].get("config", {})
    another = (
        (MODEL_FIELDS, "another model"),
        (DATA_ORDER, "another order of the data"),
        (SAME_RUN, f"another run from step {manifest['step']} on (a resumed run goes on "
                   "with the flags it was saved with)"),
    )  # fmt: skip
    for names, what in another:
        for name in names:
            if name in saved and saved[name] != getattr(config, name):
                raise checkpoint.CheckpointError(
                    f"saved with --{name.replace('_', '-')} {saved[name]}, this run has "
                    f"{getattr(config, name)}: {what}"
                )
    vocab = manifest["metadata"].get("vocab")
    if vocab != vocabulary(task):
        raise checkpoint.CheckpointError(
            f"saved with a vocabulary of {len(vocab or '')} symbols, this run's has "
            f"{len(vocabulary(task) or '')} (another text)"
        )
    here = layout_words(config, group)
    if saved.get("strategy") != config.strategy:
        raise checkpoint.LayoutMismatch(f"saved as {describe_layout(manifest)}, this is {here}")
    zero = config.strategy in ("zero", "hybrid") and 0 < config.zero_stage < 3
    if zero and saved.get("bucket_mb", config.bucket_mb) != config.bucket_mb:
        raise checkpoint.LayoutMismatch(  # its segments: the optimizer state's coordinates
            f"saved as {describe_layout(manifest)}, this is {here}: ZeRO's segments follow "
            "--bucket-mb, and its optimizer state is cut by them"
        )
    if manifest["world_size"] != group.size and config.dropout > 0:
        raise checkpoint.LayoutMismatch(
            f"saved as {describe_layout(manifest)}, this is {here}: the dropout streams "
            "are each rank's own and reshard nowhere (--dropout 0 does)"
        )
    if manifest["step"] >= config.steps:
        raise checkpoint.CheckpointError(
            f"the checkpoint is at step {manifest['step']}, --steps {config.steps} leaves nothing"
        )
