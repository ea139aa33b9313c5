"""`ZeROStages` (parallel/zero/stages.py), the piece `--strategy zero` drives, on a user's
model without the command line: stages 1, 2 and 3 over 2 and 3 ranks (uneven slices),
with gradient accumulation, train equal to one process on the whole batch (float64,
1e-10), and each rank holds its shard of the optimizer state (stage 3: of the parameters)."""

import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel.step import Step
from minidp.parallel.zero.stages import ZeROStages

BATCH, STEPS = 10, 3


class Net(nn.Module):
    """A user's MLP of three layers (three units at stage 3)."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.fc1 = nn.Linear(6, 9, rng=rng, dtype=np.float64)
        self.fc2 = nn.Linear(9, 9, rng=rng, dtype=np.float64)
        self.fc3 = nn.Linear(9, 4, rng=rng, dtype=np.float64)

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(Tensor(x), relu=True), relu=True))


def data():
    rng = np.random.default_rng(5)
    return rng.standard_normal((STEPS * BATCH, 6)), rng.integers(0, 4, STEPS * BATCH)


def adamw(params):
    return optim.AdamW(params, lr=0.02, weight_decay=0.1)


@pytest.mark.parallel(nprocs=[3])
def test_a_users_model_under_each_stage_is_one_process():
    for stage in (1, 2, 3):
        check_stage(stage)


def check_stage(stage: int) -> None:
    group, (x, y) = comm.world(), data()
    ref = Net()
    plain = adamw(ref.parameters())
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        plain.zero_grad()
        cross_entropy(ref(x[rows]), y[rows]).backward()
        plain.step()
    model = Net()
    zero = ZeROStages(model, group, stage, adamw, bucket_mb=0.0002, overlap=False)
    run = Step(
        lambda idx: cross_entropy(model(x[idx]), y[idx]),
        zero.sync,
        zero.optimizer,
        batch_size=BATCH,
        grad_accum=2,
        dp_group=group,
        timeline=zero.timeline,
        after_sync=zero.after_sync,
        after_step=zero.after_step,
    )
    for step in range(STEPS):
        lo = step * BATCH + BATCH * group.rank // group.size
        hi = step * BATCH + BATCH * (group.rank + 1) // group.size
        run(np.arange(lo, hi), 0.02)
    zero.gather_model()
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-10, atol=1e-12, err_msg=f"stage {stage}")
    psi = sum(p.size for p in ref.parameters())
    held = comm.allreduce(np.array([zero.layout.shard_numel]), group=group)[0]
    assert held == psi  # the chunks tile the model: each element on one rank
    assert zero.layout.shard_numel <= psi // group.size + len(zero.layout.segments)
    zero.close()
