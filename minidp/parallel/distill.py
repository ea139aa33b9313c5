"""Distillation under data parallelism: the teacher, a checkpoint, on every rank.

    mpiexec -n 4 python -m minidp --save-dir teacher                   # the main job, saved
    mpiexec -n 2 python -m minidp distill --teacher teacher --n-layer 1 --n-embd 32

The teacher is the model a run saved with --save-dir (its newest complete checkpoint, or
DIR/step_N): its flags are in the checkpoint's manifest (metadata["config"]), so the same
Task builds it, and `checkpoint.load` fills its weights in place from the shards, whatever
layout saved them (a teacher saved over 4 ranks loads on 2). Every rank holds the whole
teacher and runs its forward on its own shard of the batch under no_grad: no teacher
gradient, no teacher message. The student trains as any model under the strategy (DDP's
allreduce of its gradients only); its loss is models/distill.py's DistillationLoss.

The teacher's config is the student's config class at its defaults overlaid with the saved
flags (a teacher saved before a newer flag existed takes that flag's default), on the
student's backend, device and threads. Refused before any step, with one CheckpointError
line alike on every rank: a checkpoint without saved flags (checkpoint.save called without
metadata={"config": ...}), another kind of model (--model mlp against the GPT), a teacher's
block_size shorter than the student's (its positions end before the student's windows), or
another vocabulary (the logits would not be over the same symbols).
"""

import dataclasses
import os

import numpy as np

from minidp import comm
from minidp.engine.nn import Module
from minidp.models.distill import DistillationLoss, DistilledTask
from minidp.models.tasks import Task, vocabulary
from minidp.parallel import checkpoint

WHERE_THE_TEACHER_RUNS = ("backend", "device", "threads")  # the student's, whatever was saved


def teacher_config(manifest: dict, path: str, student):
    """The teacher's config: `student`'s dataclass at its defaults, overlaid with the flags
    saved in `manifest` (those this version does not know are ignored), on the student's
    backend; CheckpointError if none were saved or the teacher cannot teach this student."""
    saved = manifest.get("metadata", {}).get("config")
    if not isinstance(saved, dict):
        raise checkpoint.CheckpointError(
            f"{path} holds no saved flags (metadata['config']): give a run's --save-dir, or "
            "save with checkpoint.save(..., metadata={'config': vars(config)})"
        )
    names = {f.name for f in dataclasses.fields(student)}
    known = {name: value for name, value in saved.items() if name in names}
    here = {name: getattr(student, name) for name in WHERE_THE_TEACHER_RUNS}
    config = dataclasses.replace(type(student)(), **{**known, **here})
    if config.model != student.model:
        raise checkpoint.CheckpointError(
            f"the teacher is a --model {config.model}, the student a --model {student.model}"
        )
    if config.model == "gpt" and config.block_size < student.block_size:
        raise checkpoint.CheckpointError(
            f"the teacher's block_size {config.block_size} is shorter than the student's "
            f"{student.block_size}: it has no positions for the student's windows"
        )
    return config


def load_teacher(directory: str, group: comm.Group, student: Task, dtype=np.float32) -> Module:
    """Collective: the model saved at `directory` (a run's --save-dir or one of its step_N),
    built from `teacher_config` and its weights loaded, on every rank of `group`.
    checkpoint.CheckpointError, one line alike on every rank, if there is none, if it cannot
    be built, or if it cannot teach the `student` Task (teacher_config's; another
    vocabulary: the symbols the loop saved, else the teacher's own text's)."""
    path = directory
    if not os.path.exists(os.path.join(path, checkpoint.MANIFEST)):
        path = checkpoint.latest(directory) or path
    manifest = checkpoint.agreed_manifest(path, group)
    config = teacher_config(manifest, path, student.config)  # one manifest: alike everywhere
    teacher = checkpoint.together(lambda: Task(config, np.dtype(dtype)), group)
    theirs = manifest["metadata"].get("vocab", vocabulary(teacher))
    if theirs != vocabulary(student):  # None and None: the MLP's 10 classes
        raise checkpoint.CheckpointError("the teacher's vocabulary is not the student's")
    state = {"strategy": {"model": teacher.model.state_dict()}}  # views: loaded in place
    checkpoint.load(state, path, group)
    return teacher.model


def distilled(task, directory: str, group: comm.Group, temperature: float, alpha: float):
    """`task` with its training loss the distillation loss from the teacher at `directory`
    (load_teacher's refusals, before any step)."""
    teacher = load_teacher(directory, group, task, task.model.parameters()[0].dtype)
    return DistilledTask(task, teacher, DistillationLoss(temperature, alpha))
