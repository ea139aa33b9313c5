"""A per-rank memory cap (--max-memory-mb, tools/memory.py): a run past it is refused at start
where the model states' formula already passes it, else stopped in one line after the step
that passes it; an allocation that fails is one line too, never a traceback or a hang."""

import subprocess
import sys
from dataclasses import replace

import pytest

from minidp.cli.training.config import TrainConfig
from minidp.tools.memory import (
    OutOfMemory,
    check_cap,
    model_state_bytes,
    peak_rss_bytes,
    rank_floor_bytes,
)

GPT = ["--n-layer", "1", "--n-embd", "32", "--batch-size", "8", "--steps", "2"]
GPT += ["--eval-batches", "1", "--sample-tokens", "0"]


def run(nprocs: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "minidp", *GPT, *args]
    command = ["mpiexec", "-n", str(nprocs), *command] if nprocs > 1 else command
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "flags, stage, itemsize, k",
    [
        ({}, 0, 4, 8),  # DP in fp32: 4 + 4 + 8 bytes a parameter
        ({"strategy": "zero", "zero_stage": 3}, 3, 4, 8),  # 16 bytes over the ranks
        ({"strategy": "zero", "zero_stage": 1, "precision": "bf16"}, 1, 2, 12),  # 2 + 2 + 12
        ({"optimizer": "sgd", "dtype": "float64"}, 0, 8, 0),
    ],
)
def test_the_floor_counts_the_zero_papers_model_states(flags, stage, itemsize, k):
    config = replace(TrainConfig(), **flags)
    C, L, T = config.n_embd, config.n_layer, config.block_size
    psi = L * 12 * C * C + T * C  # (fewer than the GPT's: a floor)
    floor = rank_floor_bytes(config, 4)
    want = sum(model_state_bytes(stage, psi, 4, itemsize, k).values())
    assert floor["model states"] == int(want)
    assert 0 < floor["activations"] and 10e6 < floor["process"] < 1e9  # this process, now


def test_no_floor_where_the_formulas_are_not_the_schemes():
    for strategy in ("tp", "pp", "ps", "hybrid"):
        assert rank_floor_bytes(replace(TrainConfig(), strategy=strategy), 4) is None
    assert rank_floor_bytes(replace(TrainConfig(), backend="torch"), 4) is None  # a GPU's


def test_the_cap_is_the_peak_rss():
    check_cap(0, 0, "here")  # no cap
    check_cap(peak_rss_bytes() / 1e6 + 1, 0, "here")
    with pytest.raises(OutOfMemory, match=r"rank 3's peak RSS reached [\d,]+ MB in step 7"):
        check_cap(1, 3, "in step 7")


def test_a_cap_the_formula_passes_is_refused_at_start_in_one_line():
    done = run(2, "--max-memory-mb", "5")
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("minidp: error: --max-memory-mb 5: a rank of this run holds at least")
    assert "model states" in line and "--zero-stage 3" in line


def test_a_rank_past_the_cap_stops_the_job_in_one_line_after_its_step():
    # tp has no formula at start: the process itself passes the cap in step 0
    done = run(2, "--strategy", "tp", "--max-memory-mb", "30")
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "out of memory: rank" in line and "in step 0, past --max-memory-mb 30" in line
    assert run(1, "--max-memory-mb", "4000").returncode == 0  # a cap that holds: no effect


def test_an_allocation_that_fails_is_one_line():
    code = (
        "import numpy as np\nfrom minidp.comm import end_job\n"
        "try:\n    np.empty(10**15)\nexcept BaseException as e:\n    end_job(e)\n    raise\n"
    )
    done = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("minidp: error: out of memory: Unable to allocate"), line
