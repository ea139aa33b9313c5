"""Distillation under data parallelism: the teacher, a checkpoint, on every rank.

    mpiexec -n 4 python -m minidp --save-dir teacher                   # the main job, saved
    mpiexec -n 2 python -m minidp distill --teacher teacher --n-layer 1 --n-embd 32

The teacher is the model a run saved with --save-dir (its newest complete checkpoint, or
DIR/step_N): its flags are in the checkpoint's manifest, so the same Task builds it, and
`checkpoint.load` fills its weights in place from the shards, whatever layout saved them (a
teacher saved over 4 ranks loads on 2). Every rank holds the whole teacher and runs its
forward on its own shard of the batch under no_grad: no teacher gradient, no teacher
message. The student trains as any model under the strategy (DDP's allreduce of its
gradients only); its loss is models/distill.py's DistillationLoss.
"""

import os
from types import SimpleNamespace

import numpy as np

from minidp import comm
from minidp.engine.nn import Module
from minidp.models.distill import DistillationLoss, DistilledTask
from minidp.models.tasks import Task
from minidp.parallel import checkpoint


def load_teacher(directory: str, group: comm.Group, dtype=np.float32) -> Module:
    """Collective: the model saved at `directory` (a run's --save-dir or one of its
    step_N), built from the flags it was saved with and its weights loaded, on every rank
    of `group`. checkpoint.CheckpointError, alike on every rank, if there is none."""
    path = directory
    if not os.path.exists(os.path.join(path, checkpoint.MANIFEST)):
        path = checkpoint.latest(directory) or path
    manifest = checkpoint.agreed_manifest(path, group)
    saved = SimpleNamespace(**manifest["metadata"]["config"])
    teacher = Task(saved, np.dtype(dtype)).model
    state = {"strategy": {"model": teacher.state_dict()}}  # views: loaded in place
    checkpoint.load(state, path, group)
    return teacher


def distilled(task, directory: str, group: comm.Group, temperature: float, alpha: float):
    """`task` with its training loss the distillation loss from the teacher at `directory`."""
    teacher = load_teacher(directory, group, task.model.parameters()[0].dtype)
    vocab = getattr(task, "tokenizer", None)
    if vocab is not None and teacher.config.vocab_size != vocab.vocab_size:
        raise checkpoint.CheckpointError("the teacher's vocabulary is not the student's")
    return DistilledTask(task, teacher, DistillationLoss(temperature, alpha))
