"""Knowledge distillation (Hinton, Vinyals & Dean 2015, "Distilling the Knowledge in a Neural
Network"): a small student learns from a large teacher's softened outputs as well as from
the labels.

    loss_fn = DistillationLoss(temperature=2.0, alpha=0.5)
    with no_grad():
        teacher_logits = teacher(x).data          # the teacher is only read
    loss = loss_fn(student(x), teacher_logits, y)
    loss.backward()                               # gradients reach the student alone

With z_s, z_t the student's and the teacher's logits over V classes and T the temperature:

    p_t = softmax(z_t / T),   log p_s = log_softmax(z_s / T)
    L = alpha · T² · KL(p_t || p_s) + (1 - alpha) · CE(z_s, y)
    KL(p_t || p_s) = sum_v p_t,v (log p_t,v - log p_s,v),     averaged over the examples

T > 1 softens both distributions, so the teacher's small probabilities (which wrong
answers it finds plausible) carry weight; the gradient of the soft term with respect to z_s
is (p_s - p_t) / T, so it is scaled by T² to keep its size against the hard term's as T
changes (Hinton et al., section 2). alpha = 1: the soft targets alone; 0: plain training.

DistilledTask wraps a Task (models/tasks.py) so the command line's loop trains a student
this way (`python -m minidp distill`): its training loss is the loss above, with the
teacher's forward on the same examples under no_grad; validation is the student's plain
cross-entropy, as any run's.
"""

import numpy as np

from minidp.engine import functional as F
from minidp.engine.backend import to_numpy
from minidp.engine.nn import Module
from minidp.engine.tensor import Tensor, no_grad


class DistillationLoss:
    """alpha · T² · KL(softmax(z_t / T) || softmax(z_s / T)) + (1 - alpha) · CE(z_s, y):
    `(student_logits, teacher_logits, targets)`, logits (..., V), targets (...) ints."""

    def __init__(self, temperature: float = 2.0, alpha: float = 0.5):
        if not 0 < temperature < np.inf:
            raise ValueError(f"temperature must be positive and finite, got {temperature}")
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.temperature, self.alpha = temperature, alpha

    def __call__(self, student_logits: Tensor, teacher_logits, targets) -> Tensor:
        T, alpha = self.temperature, self.alpha
        z_t = np.asarray(to_numpy(getattr(teacher_logits, "data", teacher_logits)))
        if z_t.shape != student_logits.shape:
            raise ValueError(f"teacher logits {z_t.shape} and student's {student_logits.shape}")
        V = z_t.shape[-1]
        z_t = z_t.reshape(-1, V).astype(student_logits.dtype) / T
        log_p_t = z_t - z_t.max(axis=1, keepdims=True)  # a constant: no gradient
        log_p_t -= np.log(np.exp(log_p_t).sum(axis=1, keepdims=True))
        p_t = np.exp(log_p_t)
        log_p_s = F.log_softmax(student_logits.reshape(-1, V) * (1.0 / T), axis=-1)
        # KL = sum p_t log p_t - sum p_t log p_s: the first term is the teacher's alone
        kl = float((p_t * log_p_t).sum(axis=1).mean()) - (log_p_s * p_t).sum(axis=1).mean()
        if alpha == 1:
            return kl * (T * T)
        hard = F.cross_entropy(student_logits, targets)
        return kl * (alpha * T * T) + hard * (1 - alpha) if alpha else hard


class DistilledTask:
    """A Task whose training loss is the student's DistillationLoss against `teacher` (a
    model of the same vocabulary, evaluated under no_grad); everything else is the task's."""

    def __init__(self, task, teacher: Module, loss: DistillationLoss):
        self.task, self.teacher, self.distillation = task, teacher, loss
        teacher.eval()

    def __getattr__(self, name):  # model, batch, validation_loss, sample, ...
        return getattr(self.task, name)

    def loss(self, inputs, targets, net=None) -> Tensor:
        if net is not None:
            raise ValueError("distillation trains task.model itself (no placed net)")
        with no_grad():
            teacher_logits = self.teacher(inputs).data
        return self.distillation(self.task.model(inputs), teacher_logits, targets)
