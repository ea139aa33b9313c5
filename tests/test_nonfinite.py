"""A NaN on one rank: every rank skips that step together (--skip-nonfinite), or the run
ends naming the step and the rank. Real jobs of 2 ranks, a NaN planted on rank 1 by a
script that wraps the task (test-only: nothing in minidp reads a poison switch)."""

import json
import os
import subprocess
import sys

import pytest

POISON = """
import sys
import numpy as np
from mpi4py import MPI
from minidp import autograd
from minidp.cli import main
from minidp.strategies.step import Step
from minidp.training.tasks import Task

where, at = sys.argv[1], int(sys.argv[2])  # "input" or "gradient", the step
rank, calls = MPI.COMM_WORLD.rank, []
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
    return result


Step.__call__ = checked_step
sys.exit(main(sys.argv[3:]))
"""
MLP = ["--model", "mlp", "--hidden", "16", "--steps", "6", "--batch-size", "8"]
MLP += ["--log-every", "1", "--eval-batches", "1"]


def poisoned_run(tmp_path, where: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "poison.py"
    script.write_text(POISON)
    command = ["mpiexec", "-n", "2", sys.executable, str(script), where, "3", *MLP, *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(command, capture_output=True, text=True, timeout=90, env=env)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["input", "gradient"])
def test_skip_nonfinite_skips_the_step_on_every_rank_alike(where, tmp_path):
    records = tmp_path / "records.json"
    logs = tmp_path / "logs"
    job = poisoned_run(
        tmp_path, where, "--skip-nonfinite", "--json", str(records), "--log-dir", str(logs)
    )
    assert job.returncode == 0, job.stderr
    final = [json.loads(line) for line in records.read_text().splitlines()][-1]
    assert final["skipped_steps"] == [3] and final["max_param_diff"] == 0.0
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
