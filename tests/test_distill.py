"""Knowledge distillation (models/distill.py, parallel/distill.py): the loss and its gradient
against central differences in float64 (and PyTorch's kl_div where installed), and a
student taught under data parallelism by a teacher saved by the loop on 2 ranks; teachers
that cannot teach the student refused in one line before any step, and one saved before
newer flags existed loaded with their defaults.
"""

import contextlib
import io
import os
import tempfile

import numpy as np
import pytest

from minidp import Tensor, comm
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.cli.training.loop import train
from minidp.models.distill import DistillationLoss
from minidp.models.tasks import Task
from minidp.parallel import checkpoint
from minidp.parallel.distill import distilled

RNG = np.random.default_rng(0)
Z_S, Z_T, Y = RNG.normal(size=(2, 3, 5)), RNG.normal(size=(2, 3, 5)), RNG.integers(0, 5, (2, 3))


def reference(z_s, z_t, y, T, alpha) -> float:
    """The formula written out in NumPy, one example at a time."""
    soft = hard = 0.0
    for s, t, label in zip(z_s.reshape(-1, 5), z_t.reshape(-1, 5), y.ravel()):
        p_t = np.exp(t / T) / np.exp(t / T).sum()
        log_p_s = s / T - np.log(np.exp(s / T).sum())
        soft += (p_t * (np.log(p_t) - log_p_s)).sum()
        hard -= s[label] - np.log(np.exp(s).sum())
    n = len(y.ravel())
    return alpha * T * T * soft / n + (1 - alpha) * hard / n


@pytest.mark.parametrize("T, alpha", [(1.0, 0.0), (2.0, 0.3), (4.0, 1.0)])
def test_distillation_loss_value_and_gradient(T, alpha):
    loss_fn = DistillationLoss(T, alpha)
    x = Tensor(Z_S.copy(), requires_grad=True)
    loss = loss_fn(x, Z_T, Y)
    assert loss.item() == pytest.approx(reference(Z_S, Z_T, Y, T, alpha), rel=1e-12)
    loss.backward()
    numeric, eps = np.zeros_like(Z_S), 1e-6
    for i in np.ndindex(Z_S.shape):
        up, down = Z_S.copy(), Z_S.copy()
        up[i] += eps
        down[i] -= eps
        numeric[i] = loss_fn(Tensor(up), Z_T, Y).item() - loss_fn(Tensor(down), Z_T, Y).item()
    np.testing.assert_allclose(x.grad, numeric / (2 * eps), atol=1e-8)
    if alpha == 1.0:  # the soft term alone: zero where the student is the teacher
        assert loss_fn(Tensor(Z_T), Z_T, Y).item() == pytest.approx(0.0, abs=1e-12)


def test_distillation_loss_bad_input():
    with pytest.raises(ValueError, match="temperature"):
        DistillationLoss(0.0)
    with pytest.raises(ValueError, match="alpha"):
        DistillationLoss(2.0, 1.5)
    with pytest.raises(ValueError, match="teacher logits"):
        DistillationLoss()(Tensor(Z_S), Z_T[:1], Y)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_a_student_distilled_under_data_parallelism():
    group = comm.world()
    root = group.comm.bcast(tempfile.mkdtemp() if group.rank == 0 else None)
    teacher_dir = os.path.join(root, "teacher")
    small = dict(steps=6, batch_size=8, block_size=16, sample_tokens=0, eval_batches=2)
    with contextlib.redirect_stdout(io.StringIO()):
        train(TrainConfig(**small, n_layer=1, n_embd=32, save_dir=teacher_dir), group)
        student = TrainConfig(**small, n_layer=1, n_embd=16, teacher=teacher_dir, alpha=0.7)
        final = train(student, group)
        scratch = train(TrainConfig(**small, n_layer=1, n_embd=16), group)
        longer = TrainConfig(
            **{**small, "block_size": 32}, n_layer=1, n_embd=16, teacher=teacher_dir
        )
        with pytest.raises(BadConfig, match="block_size 16 is shorter than the student's 32"):
            train(longer, group)  # on every rank, one line, before any step
    assert final["max_param_diff"] == 0.0 and np.isfinite(final["val_loss"])
    # the training loss is the distillation loss, validation the plain cross-entropy
    assert final["final_loss"] != scratch["final_loss"]
    assert final["val_loss"] != scratch["val_loss"]


SMALL = dict(n_layer=1, n_embd=16, n_head=4, block_size=16, sample_tokens=0)


def saved(path, model, metadata=None) -> str:
    """`model` saved through the library API (as a script would), `metadata` beside it."""
    state = {"strategy": {"model": model.state_dict()}}
    checkpoint.save(state, str(path), comm.world(), metadata=metadata)
    return str(path)


def test_teachers_that_cannot_teach_are_refused_and_an_old_one_loads(tmp_path):
    group, student = comm.world(), Task(TrainConfig(**SMALL), np.float32)
    gpt = Task(TrainConfig(**SMALL, seed=5), np.float32).model
    mlp = Task(TrainConfig(model="mlp", hidden=8), np.float32).model
    short = Task(TrainConfig(**{**SMALL, "block_size": 8}), np.float32).model
    refused = [
        (gpt, None, "holds no saved flags"),  # checkpoint.save without metadata
        (mlp, {"config": {"model": "mlp", "hidden": 8}}, "teacher is a --model mlp, the student"),
        (short, {"config": {**SMALL, "block_size": 8}}, "block_size 8 is shorter than the"),
        (gpt, {"config": SMALL, "vocab": "ab"}, "vocabulary is not the student's"),
    ]
    for i, (model, metadata, error) in enumerate(refused):
        with pytest.raises(checkpoint.CheckpointError, match=error):
            distilled(student, saved(tmp_path / str(i), model, metadata), group, 2.0, 0.5)
    # saved before newer flags (--experts, ...) existed, with one this version lost: defaults
    old = {key: SMALL[key] for key in ("n_layer", "n_embd", "n_head", "block_size")} | {"gone": 1}
    task = distilled(student, saved(tmp_path / "old", gpt, {"config": old}), group, 2.0, 1.0)
    for p, q in zip(task.teacher.parameters(), gpt.parameters(), strict=True):
        np.testing.assert_array_equal(p.data, q.data)
    assert task.teacher.config.n_experts == 0 and task.teacher.config.n_embd == 16
    assert np.isfinite(task.loss(*task.batch(np.arange(4))).item())
