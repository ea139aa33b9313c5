"""`bench pp` runs, and its simulated and formula columns are the schedules' own.

Tiny settings (pp 2, m 1 and 2, one step of 1 ms layers): the plumbing and the records,
never a time (docs/pipeline.md has the measured tables).
"""

import json
import os
import subprocess
import sys

import pytest

from minidp.parallel.pipeline.schedules import build_schedule
from minidp.parallel.pipeline.simulate import summary
from minidp.tools.plots import pyplot

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@pytest.mark.timeout(120)
def test_bench_pp_has_a_row_per_schedule_and_the_simulated_and_formula_values(tmp_path):
    out = tmp_path / "pp.json"
    args = ["--pps", "2", "--micro-batches", "1,2", "--steps", "1", "--delay-ms", "1"]
    args += ["--memory-m", "2", "--diagram-m", "2", "--out", str(tmp_path), "--json", str(out)]
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "minidp", "bench", "pp", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=env)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in open(out)]
    bubble = {(r["schedule"], r["m"]): r for r in rows if r["table"] == "bubble"}
    assert set(bubble) == {(name, m) for name in SCHEDULES for m in (1, 2)}
    for (name, m), row in bubble.items():
        want = summary(build_schedule(name, 2, m, 2 if name == "interleaved" else 1))
        assert row["p"] == 2 and row["V"] == want["virtual"]
        assert row["simulated"] == want["bubble_fraction"]
        assert row["formula"] == want["formula_bubble"] and row["exact"] == want["formula_holds"]
        assert 0 <= row["measured"] < 1 and len(row["bubbles"]) == 1
    memory = {(r["schedule"], r["recompute"]): r for r in rows if r["table"] == "memory"}
    assert set(memory) == {(name, rc) for name in SCHEDULES for rc in (False, True)}
    assert memory["gpipe", False]["formula"] == [2, 2]
    assert memory["1f1b", False]["formula"] == [2, 1]
    for row in memory.values():  # counted, not timed: the stages hold what the simulator says
        assert row["in_flight"] == row["simulated"] == row["formula"]
    (per_rank,) = [r for r in rows if r["table"] == "memory_per_rank"]  # interleaved, p 2, V 2
    sim = summary(build_schedule("interleaved", 2, 2, 2))
    assert per_rank["measured"] == per_rank["simulated"] == sim["peak_activations_per_rank"]
    assert per_rank["formula_rank0"] == sim["formula_peak_first_rank"] == per_rank["measured"][0]
    for name in SCHEDULES:  # recomputed blocks keep only their inputs
        assert sum(memory[name, True]["peak_KB"]) < sum(memory[name, False]["peak_KB"])
    if pyplot() is not None:
        for name in SCHEDULES:
            assert (tmp_path / f"measured_{name}_p2_m2.png").exists()
