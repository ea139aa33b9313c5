"""A step gone wrong on one rank, in real jobs: a script wraps the task or the step on rank
1 (test-only: nothing in minidp reads a poison switch).

- a NaN in rank 1's input or gradient: every rank skips that step together
  (--skip-nonfinite), or the run ends naming the step and the rank;
- one value of rank 1's replica nudged: the drift detector (--check-every N) names the
  rank and the parameter; unperturbed, it finds nothing."""

import json
import os
import subprocess
import sys

import pytest

POISON = """
import sys
import numpy as np
from mpi4py import MPI
from minidp.engine import tensor as autograd
from minidp.cli.commands import main
from minidp.parallel.step import Step
from minidp.models.tasks import Task

where, at = sys.argv[1], int(sys.argv[2])  # "input", "gradient" or "nudge"; the step
rank, calls, steps = MPI.COMM_WORLD.rank, [], []
if rank == 1 and where == "input":  # a NaN in one example of rank 1's batch
    batch = Task.batch

    def poisoned_batch(self, indices, split="train"):
        x, y = batch(self, indices, split)
        calls.append(split)
        if split == "train" and len(calls) == at + 1:
            x.data[0, 0] = np.nan
        return x, y

    Task.batch = poisoned_batch
if rank == 1 and where == "gradient":  # the loss finite, its backward NaN
    loss = Task.loss

    def poisoned_loss(self, inputs, targets):
        out = loss(self, inputs, targets)
        calls.append(1)
        if len(calls) == at + 1:
            return autograd.op(out.data, (out,), lambda g: (g * np.nan,))
        return out

    Task.loss = poisoned_loss
step = Step.__call__


def checked_step(self, local, lr):  # a skipped step leaves every parameter as it was
    before = [p.data.copy() for p in self.optimizer.params]
    result = step(self, local, lr)
    if not result.stepped:
        same = all((p.data == b).all() for p, b in zip(self.optimizer.params, before))
        print(f"rank {rank} skipped a step, parameters unchanged: {same}", flush=True)
    steps.append(1)
    if rank == 1 and where == "nudge" and len(steps) == at + 1:
        model = self.loss.__self__.model  # the recipe's model (whole, or its TP shards)
        next(iter(model.parameters())).data.flat[0] += 1e-3
    return result


Step.__call__ = checked_step
sys.exit(main(sys.argv[3:]))
"""
MLP = ["--model", "mlp", "--hidden", "16", "--steps", "6", "--batch-size", "8"]
MLP += ["--log-every", "1", "--eval-batches", "1"]


def poisoned_run(tmp_path, where: str, *args: str, nprocs: int = 2) -> subprocess.CompletedProcess:
    script = tmp_path / "poison.py"
    script.write_text(POISON)
    command = ["mpiexec", "-n", str(nprocs), sys.executable, str(script), where, "3", *MLP]
    command += args
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(command, capture_output=True, text=True, timeout=90, env=env)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["input", "gradient"])
def test_skip_nonfinite_skips_the_step_on_every_rank_alike(where, tmp_path):
    records = tmp_path / "records.json"
    logs = tmp_path / "logs"
    saves = ["--save-dir", str(tmp_path / "run"), "--save-every", "4"]
    job = poisoned_run(
        tmp_path, where, "--skip-nonfinite", "--json", str(records), "--log-dir", str(logs),
        *(saves if where == "input" else []),
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    final = [json.loads(line) for line in records.read_text().splitlines()][-1]
    assert final["skipped_steps"] == [3] and final["max_param_diff"] == 0.0
    if where == "input":  # resumed after the skip, in a job with no poison: still counted
        again = tmp_path / "again.json"
        resume = ["--resume", str(tmp_path / "run" / "step_000004"), "--json", str(again)]
        command = ["mpiexec", "-n", "2", sys.executable, "-m", "minidp", *MLP, *resume]
        assert subprocess.run(command, capture_output=True, timeout=90).returncode == 0
        resumed = [json.loads(line) for line in again.read_text().splitlines()][-1]
        assert resumed["skipped_steps"] == [3]
        assert resumed["param_l2"] == final["param_l2"]
    for rank in (0, 1):
        assert f"rank {rank} skipped a step, parameters unchanged: True" in job.stdout
        assert "step 3: " in (logs / f"rank{rank}.log").read_text()
    named = "appeared on rank 1" if where == "input" else "appeared in a gradient"
    assert job.stdout.count("every rank skipped it (--skip-nonfinite)") == 1, job.stdout
    assert named in job.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["input", "gradient"])
def test_without_the_flag_the_run_ends_naming_the_step_and_the_rank(where, tmp_path):
    job = poisoned_run(tmp_path, where)
    assert job.returncode == 1, job.stderr
    assert job.stderr.count("minidp: error:") == 1 and "at step 3" in job.stderr
    named = "appeared on rank 1" if where == "input" else "appeared in a gradient"
    assert named in job.stderr and "Traceback" not in job.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["dp", "zero"])
def test_a_nudged_replica_is_named_with_its_parameter(strategy, tmp_path):
    args = ["--strategy", strategy] + (["--zero-stage", "1"] if strategy == "zero" else [])
    job = poisoned_run(
        tmp_path, "nudge", *args, "--batch-size", "12", "--check-every", "2", nprocs=3
    )
    assert job.returncode == 1, job.stderr
    assert job.stderr.count("minidp: error:") == 1 and "Traceback" not in job.stderr
    words = "replicas drifted apart by step 3: parameter 'layers.0.weight' on rank(s) 1 differs"
    assert words in job.stderr and "from rank(s) 0, 2" in job.stderr, job.stderr


@pytest.mark.timeout(120)
def test_replicas_in_step_pass_the_drift_check(tmp_path):
    job = poisoned_run(tmp_path, "none", "--check-every", "1")
    assert job.returncode == 0, job.stderr


def test_skipping_ends_when_training_does_not_recover():
    """The SKIPS_IN_A_ROW-th skip in a row ends the run; a finite step in between resets it."""
    from types import SimpleNamespace

    from minidp import comm
    from minidp.cli.training.nonfinite import SKIPS_IN_A_ROW, TrainingDiverged, nonfinite_step

    config = SimpleNamespace(skip_nonfinite=True, strategy="dp", lr=1e-3)
    result = SimpleNamespace(loss=float("nan"), local_loss=float("nan"))
    log = SimpleNamespace(write=lambda line: None)
    n, alone = SKIPS_IN_A_ROW, comm.world().split(comm.world().rank)  # a group of one
    assert nonfinite_step(n, result, config, alone, print, log, list(range(1, n - 1))) == n
    with pytest.raises(TrainingDiverged, match=f"the {n}th step skipped in a row"):
        nonfinite_step(n, result, config, alone, print, log, list(range(1, n)))
