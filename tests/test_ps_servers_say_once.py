"""With two servers (--servers 2) a silent worker is still reported once: a warning under
ASP, an error naming it under BSP, said by the first server alone (both see the silence)."""

import os
import subprocess
import sys

import pytest

MLP = ["--strategy", "ps", "--model", "mlp", "--hidden", "16", "--steps", "3", "--batch-size", "8"]
SILENT = ["--ps-timeout", "0.3", "--ps-slow-worker-ms", "1000", "--eval-batches", "1"]


def run(consistency: str) -> subprocess.CompletedProcess:
    cmd = ["mpiexec", "-n", "4", sys.executable, "-m", "minidp", *MLP, *SILENT]
    cmd += ["--servers", "2", "--consistency", consistency]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.timeout(150)
def test_two_servers_report_a_silent_worker_once():
    asp = run("asp")
    assert asp.returncode == 0, asp.stderr
    assert asp.stderr.count("sent nothing") == 1, asp.stderr
    assert "server rank 2: worker 1 sent nothing for 0.3 s; dropped" in asp.stderr
    bsp = run("bsp")
    assert bsp.returncode != 0
    assert bsp.stderr.count("sent nothing") == 1 and "Traceback" not in bsp.stderr, bsp.stderr
    assert 'to server rank 2 for 0.3 s: under consistency="bsp"' in bsp.stderr, bsp.stderr
