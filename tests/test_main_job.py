"""The main job, `mpiexec -n N python -m minidp`, end to end in subprocesses."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

SMALL = [
    "--steps",
    "4",
    "--log-every",
    "2",
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--batch-size",
    "8",
    "--eval-batches",
    "1",
    "--sample-tokens",
    "20",
    "--bucket-mb",
    "0.05",
]


def run(nprocs: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "minidp", *args]
    if nprocs > 1:
        cmd = ["mpiexec", "-n", str(nprocs), *cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def records(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.mark.timeout(300)
def test_four_ranks_train_like_one_process(tmp_path):
    one = run(1, *SMALL, "--dtype", "float64", "--json", str(tmp_path / "one.json"))
    assert one.returncode == 0, one.stderr
    four = run(
        4,
        *SMALL,
        "--dtype",
        "float64",
        "--json",
        str(tmp_path / "four.json"),
        "--trace",
        str(tmp_path / "trace.json"),
        "--log-dir",
        str(tmp_path / "logs"),
    )
    assert four.returncode == 0, four.stderr
    a, b = records(tmp_path / "one.json"), records(tmp_path / "four.json")
    assert len(a) == len(b) == 4, (a, b)  # steps 0, 2, 3 and the final record
    for x, y in zip(a[:-1], b[:-1], strict=True):
        assert x["step"] == y["step"] and x["loss"] == pytest.approx(y["loss"], rel=1e-10)
    final = b[-1]
    assert final["world_size"] == 4 and final["strategy"] == "dp"
    assert final["param_l2"] == pytest.approx(a[-1]["param_l2"], rel=1e-10)
    assert final["max_param_diff"] == 0.0
    # rank 0 alone talks to the terminal: one header, one summary
    assert four.stdout.count("minidp train |") == 1
    assert "max |param difference| across ranks: 0" in four.stdout
    assert "sample:" in four.stdout and "MB sent/rank" in four.stdout
    trace = json.load(open(tmp_path / "trace.json"))["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert {e["name"] for e in spans} >= {"forward", "backward", "optimizer"}
    # the ranks share one clock: no rank can finish an allreduce before every rank began it
    calls = [[e for e in spans if e["pid"] == r and "allreduce" in e["name"]] for r in range(4)]
    assert calls[0] and len({len(c) for c in calls}) == 1
    for same_call in zip(*calls, strict=True):
        assert max(e["ts"] for e in same_call) <= min(e["ts"] + e["dur"] for e in same_call)
    assert sorted(os.listdir(tmp_path / "logs")) == [f"rank{r}.log" for r in range(4)]


@pytest.mark.timeout(120)
def test_bad_flag_under_mpiexec_is_one_line():
    result = run(3, "--allreduce", "carrier-pigeon")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("minidp: error:") == 1 and "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_batch_smaller_than_ranks_times_accumulation_is_a_clear_error():
    result = run(2, *SMALL, "--batch-size", "4", "--grad-accum", "3")
    assert result.returncode == 2
    assert result.stderr.count("minidp: error:") == 1 and "--grad-accum" in result.stderr


@pytest.mark.timeout(120)
def test_a_diverging_run_under_mpiexec_exits_1_on_every_rank():
    args = ("--model", "mlp", "--hidden", "16", "--lr", "1e6", "--grad-clip", "0")
    result = run(2, *args, "--warmup", "0", "--steps", "50", "--dtype", "float32")
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("minidp: error:") == 1 and "at step" in result.stderr
    assert "Traceback" not in result.stderr


FAIL_ON_RANK_1 = """
import sys
from mpi4py import MPI
from minidp.engine import tensor as autograd
from minidp.cli.commands import main

if MPI.COMM_WORLD.rank == 1:  # rank 1's third backward raises: mid-training, inside the CLI
    backward, calls = autograd.Tensor.backward, []

    def failing_backward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom on rank 1")
        return backward(self, *args, **kwargs)

    autograd.Tensor.backward = failing_backward
sys.exit(main(["--model", "mlp", "--hidden", "16", "--steps", "200", "--log-every", "50"]))
"""


@pytest.mark.timeout(120)
def test_an_exception_on_one_rank_ends_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_RANK_1)
    env = dict(os.environ, MINIDP_TIMEOUT="600")  # the abort, not a timeout, must end it
    start = time.monotonic()
    job = subprocess.Popen(
        ["mpiexec", "-n", "3", sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # so that a hung job can be ended whole, ranks included
    )
    try:
        _, stderr = job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGTERM)
        job.communicate()
        pytest.fail("one rank failed and the job still ran after 60 s: no abort")
    assert time.monotonic() - start < 60
    assert job.returncode != 0  # MPI_Abort's code: the launcher's to choose
    assert stderr.count("RuntimeError: boom on rank 1") == 1, stderr
    assert "rank 1 failed; aborting all ranks" in stderr


@pytest.mark.timeout(120)
def test_a_batch_larger_than_the_data_is_one_line_on_every_rank():
    result = run(2, "--model", "mlp", "--batch-size", "100000")
    assert result.returncode == 2
    assert result.stderr.count("minidp: error: --batch-size 100000") == 1
    assert "Traceback" not in result.stderr


def test_bench_collectives_writes_the_contract_records(tmp_path):
    out = tmp_path / "collectives.json"
    args = ("bench", "collectives", "--sizes", "1K", "--iters", "15", "--json", str(out))
    result = run(2, *args)
    assert result.returncode == 0, result.stderr
    rows = records(out)
    assert {(r["op"], r["algo"]) for r in rows} >= {("allreduce", "ring"), ("broadcast", "tree")}
    for row in rows:
        assert row["nprocs"] == 2 and row["bytes"] == 1024
        assert row["time_s"] > 0 and row["busbw_gbs"] > 0 and row["builtin_busbw_gbs"] > 0


@pytest.mark.parametrize(
    "args",
    [
        ("bench", "collectives", "--algos", "rign"),
        ("bench", "collectives", "--ops", "allreduse"),
        ("bench", "collectives", "--sizes", "4Q"),
        ("bench", "dp", "--algos", "foo"),
        ("bench", "dp", "--iters", "x"),
        ("bench", "nothing"),
    ],
    ids=" ".join,
)
def test_a_bad_benchmark_argument_is_one_line_and_exit_code_2(args):
    result = run(2, *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minidp: error:"), result.stderr


def test_help_under_mpiexec_prints_once():
    for args in (("train", "--help"), ("bench", "dp", "--help")):
        result = run(2, *args)
        assert result.returncode == 0 and result.stdout.count("usage:") == 1, result.stdout
