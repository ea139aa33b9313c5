"""The parameter server from the command line: bad input is one line each (data parallelism's
flags, and a batch the workers cannot split, found on the servers too); a silent worker is
dropped with a warning under ASP and is an error naming it under BSP; the benchmark runs."""

import json
import os
import subprocess
import sys

import pytest

from minidp.cli.commands import main

MLP = ["--strategy", "ps", "--model", "mlp", "--hidden", "16", "--steps", "3", "--batch-size", "8"]
NOT_PS = "is a flag of --strategy dp or tp or hybrid or zero, not of --strategy ps"
SILENT = ["--ps-timeout", "0.3", "--ps-slow-worker-ms", "1000", "--eval-batches", "1"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--strategy", "ps", "--servers", "0"], "--servers must be >= 1"),
        (["--strategy", "ps", "--consistency", "ssp:-1"], "--consistency 'ssp:-1'"),
        (["--servers", "2"], "--servers is a flag of --strategy ps, not of --strategy dp"),
        (["--consistency", "asp"], "--consistency is a flag of --strategy ps"),
        (MLP, "--servers 1 leaves no worker in a world of 1 ranks"),  # servers >= world
        # data parallelism's flags, which the parameter server would ignore
        ([*MLP, "--grad-accum", "2"], f"--grad-accum {NOT_PS}"),
        ([*MLP, "--overlap", "on"], f"--overlap {NOT_PS}"),
        ([*MLP, "--bucket-mb", "1"], f"--bucket-mb {NOT_PS}"),
        ([*MLP, "--allreduce", "ring"], f"--allreduce {NOT_PS}"),
    ],
)
def test_bad_input_is_one_line(args, words, capsys):
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err


def mpiexec(nprocs: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = ["mpiexec", "-n", str(nprocs), sys.executable, "-m", "minidp", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.timeout(60)
def test_a_batch_too_small_for_the_workers_is_one_line_on_every_rank():
    # the server reads no data: it finds the bad batch too, not waiting --ps-timeout for
    # workers that have quit
    bad = mpiexec(3, *MLP[:-1], "1", "--ps-timeout", "30")  # 2 workers, a global batch of 1
    assert bad.returncode == 2, bad.stderr
    words = "--batch-size 1: global batch 1 is smaller than the 2 ranks"
    assert bad.stderr.count("\n") == 1 and words in bad.stderr, bad.stderr


@pytest.mark.timeout(120)
def test_a_silent_worker_is_dropped_under_asp_and_an_error_under_bsp(tmp_path):
    asp = mpiexec(3, *MLP, *SILENT, "--consistency", "asp", "--json", str(tmp_path / "a.json"))
    assert asp.returncode == 0, asp.stderr
    assert "worker 1 sent nothing for 0.3 s; dropped, training goes on with 1 workers" in asp.stderr
    final = [json.loads(line) for line in open(tmp_path / "a.json")][-1]
    assert final["max_param_diff"] == 0.0  # among the ranks still in the job
    assert final["consistency"] == "asp" and final["staleness_histogram"]
    assert final["dropped_workers"] == [1] and final["duplicates_dropped"] == 0
    assert list(final["dropped_at_clock"]) == ["1"]  # and when: the clocks complete then
    roles = [(r["rank"], r["role"]) for r in final["ps_traffic"]]  # the dropped worker stopped
    assert roles == [(0, "worker"), (2, "server")] and "staleness histogram" in asp.stdout
    bsp = mpiexec(3, *MLP, *SILENT, "--consistency", "bsp")
    assert bsp.returncode != 0
    assert "worker 1 (rank 1) sent nothing to server rank 2 for 0.3 s" in bsp.stderr, bsp.stderr
    # the server that saw it says it once, in one line; the worker it told stays silent
    assert bsp.stderr.count("sent nothing") == 1 and "Traceback" not in bsp.stderr, bsp.stderr


@pytest.mark.timeout(120)
def test_bench_ps_smoke(tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "ps", "--model", "mlp", "--steps", "2", "--rounds", "1", "--slow-ms", "1"]
    result = mpiexec(3, *args, "--json", str(out), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = {r["contender"]: r for r in map(json.loads, open(out))}
    assert set(rows) == {
        "dp ring", "ps S=1 bsp", "ps S=2 bsp", "ps S=1 bsp slow", "ps S=1 asp slow",
        "ps S=1 ssp:2 slow",
    }  # fmt: skip
    model_kb = rows["ps S=2 bsp"]["server_in_kb"] * 2  # 1 worker, half the model each
    # one server takes every worker's whole gradient; the ring rank sends 2(p-1)/p of it
    assert rows["ps S=1 bsp"]["server_in_kb"] > 1.9 * model_kb
    assert rows["dp ring"]["ring_rank_kb"] < 1.5 * model_kb
    assert (tmp_path / "bench_ps_3ranks.png").exists()
