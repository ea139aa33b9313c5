"""The main job, `mpiexec -n N python -m minidp`, end to end in subprocesses."""

import json
import os
import subprocess
import sys

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
    for x, y in zip(a[:-1], b[:-1]):
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
    for same_call in zip(*calls):
        assert max(e["ts"] for e in same_call) <= min(e["ts"] + e["dur"] for e in same_call)
    assert sorted(os.listdir(tmp_path / "logs")) == [f"rank{r}.log" for r in range(4)]


@pytest.mark.timeout(120)
def test_bad_flag_under_mpiexec_is_one_line():
    result = run(3, "--allreduce", "carrier-pigeon")
    assert result.returncode != 0
    assert result.stderr.count("minidp: error:") == 1 and "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_batch_smaller_than_ranks_times_accumulation_is_a_clear_error():
    result = run(2, *SMALL, "--batch-size", "4", "--grad-accum", "3")
    assert result.returncode == 2
    assert result.stderr.count("minidp: error:") == 1 and "--grad-accum" in result.stderr


@pytest.mark.timeout(120)
def test_an_exception_on_one_rank_ends_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "from minidp import comm\n"
        "from minidp.cli import abort_others\n"
        "group = comm.world()\n"
        "try:\n"
        "    if group.rank == 1:\n"
        "        raise RuntimeError('boom on rank 1')\n"
        "    comm.barrier(group=group)  # the others would wait here forever\n"
        "except BaseException:\n"
        "    abort_others()\n"
        "    raise\n"
    )
    env = dict(os.environ, MINIDP_TIMEOUT="600")  # the abort, not a timeout, must end it
    result = subprocess.run(
        ["mpiexec", "-n", "3", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert result.returncode != 0
    assert result.stderr.count("RuntimeError: boom on rank 1") == 1, result.stderr
    assert "rank 1 failed; aborting all ranks" in result.stderr


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
