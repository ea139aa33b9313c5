"""The benchmarks run, say what they ran with, and refuse to time a wrong answer.

Tiny sizes and one or two rounds: these check the benchmarks' plumbing and records, never a
time (docs/benchmarks.md has the measured figures).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from minidp import comm
from minidp_bench._common import median_ratio, per_timed_step_ms, rotated_rounds

TINY_MLP = ("--sizes", "784,32,10", "--batch", "16")
ONE_ROUND = ("--iters", "1", "--warmup", "1")


def minidp(nprocs: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "minidp", *args]
    if nprocs > 1:
        cmd = ["mpiexec", "-n", str(nprocs), *cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # MINIDP_CHECKS=1 too (conftest.py)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def records(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def finite_positive(*values) -> bool:
    return all(np.isfinite(v) and v > 0 for v in values)


# ---- the pieces ---------------------------------------------------------------------------------
def test_the_ratio_is_the_median_of_per_round_ratios():
    ours, theirs = [1.0, 2.0, 10.0], [1.0, 4.0, 1.0]  # ratios 1, 0.5, 10
    assert median_ratio(ours, theirs) == 1.0  # the ratio of the medians would be 2
    with pytest.raises(ValueError):
        median_ratio(ours, theirs[:2])  # a round without its pair is an error, not dropped


def test_rounds_rotate_the_order_of_the_contenders():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
    times = rotated_rounds(steps, warmup=1, iters=3, mpi=MPI.COMM_SELF)
    assert "".join(calls) == "ABC" + "BCA" + "CAB" + "ABC"
    assert {name: len(ts) for name, ts in times.items()} == {"A": 3, "B": 3, "C": 3}


def test_communication_times_are_the_slowest_ranks():
    class OtherRankTookThreeSeconds:
        def allreduce(self, value, op):
            assert op == MPI.MAX
            return max(value, 3.0)

    assert per_timed_step_ms(1.0, iters=2, mpi=OtherRankTookThreeSeconds()) == 1500.0


# ---- the benchmarks, end to end ---------------------------------------------------------------
@pytest.mark.timeout(120)
def test_bench_dp_covers_every_algorithm_with_checks_off_by_default(tmp_path):
    out = tmp_path / "dp.json"
    result = minidp(2, "bench", "dp", *ONE_ROUND, *TINY_MLP, "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "case weak" in result.stdout and "| checks off |" in result.stdout  # despite the env
    rows = records(out)
    algos = ("auto", *comm.ALGORITHMS["allreduce"])
    want = {(algo, overlap) for algo in algos for overlap in (True, False)}
    assert {(r["algo"], r["overlap"]) for r in rows} == want and len(rows) == len(want)  # naive too
    assert "default settings (algo auto, overlap " in result.stdout  # the no-flags row, named
    for r in rows:
        assert r["checks"] == "off" and r["nprocs"] == 2 and r["sizes"] == "784-32-10"
        assert finite_positive(r["step_ms"], r["solo_ms"], r["efficiency"], r["vs_mpi_dp"])
        assert r["comm_ms"] >= 0 and r["exposed_ms"] >= 0
        if r.get("torch_ddp_ms") is not None:
            assert finite_positive(r["torch_ddp_ms"], r["vs_torch_ddp"])


@pytest.mark.timeout(120)
def test_bench_dp_shallowspeed_checks_minidp_against_the_hand_written_loop(tmp_path):
    out = tmp_path / "shallowspeed.json"
    args = ("--case", "shallowspeed", "--checks", "on", "--iters", "1", "--warmup", "0")
    result = minidp(2, "bench", "dp", *args, "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "| checks on |" in result.stdout and "checked:" in result.stdout, result.stdout
    rows = records(out)
    assert [(r["algo"], r["overlap"]) for r in rows] == [("auto", True), ("auto", False)]
    for r in rows:
        assert r["sizes"] == "784-128-127-126-125-124-123-10" and r["global_batch"] == 128
        assert r["micro_batches"] == 4 and r["checks"] == "on" and r["buckets"] > 1
        assert finite_positive(r["minidp_ms"], r["hand_ms"], r["minidp/hand"])


@pytest.mark.timeout(120)
def test_bench_dp_tricks_has_one_on_off_row_per_trick(tmp_path):
    from minidp.parallel.data_parallel.ddp import TRICKS

    out = tmp_path / "tricks.json"
    args = ("--case", "tricks", "--no-torch", *ONE_ROUND, *TINY_MLP, "--bucket-mb", "0.01")
    result = minidp(2, "bench", "dp", *args, "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = records(out)
    assert [r["trick"] for r in rows] == [t for t in TRICKS if t != "host_stage"]  # no torch
    for r in rows:
        assert r["case"] == "tricks" and r["nprocs"] == 2 and r["buckets"] > 1
        assert finite_positive(r["on_ms"], r["off_ms"], r["on/off"])
        assert r["default"] == TRICKS[r["trick"]]


@pytest.mark.timeout(60)
def test_bench_checkpoint_times_a_save_against_np_save(tmp_path):
    out = tmp_path / "checkpoint.json"
    args = ("--sizes", "gpt default", *ONE_ROUND, "--dir", str(tmp_path), "--json", str(out))
    result = minidp(2, "bench", "checkpoint", *args)
    assert result.returncode == 0, result.stderr
    (row,) = records(out)
    assert row["state"] == "gpt default" and row["ranks"] == 2 and row["MB_per_rank"] > 1
    assert finite_positive(row["save_ms"], row["np.save+fsync_ms"], row["ratio"])


def test_bench_autograd_runs(tmp_path):
    out = tmp_path / "autograd.json"
    args = ("--threads", "1", "--no-torch", *ONE_ROUND, *TINY_MLP)
    result = minidp(1, "bench", "autograd", *args, "--json", str(out))
    assert result.returncode == 0, result.stderr
    (row,) = records(out)
    assert row["threads"] == 1 and row["sizes"] == "784-32-10" and row["batch"] == 16
    assert finite_positive(row["minidp_ms"], row["numpy_ms"], row["minidp/numpy"])
    assert row["minidp_faults"] >= 0  # minor page faults per step, beside the time


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_bench_fused_has_a_row_per_op_and_per_phase(tmp_path):
    out = tmp_path / "fused.json"
    result = minidp(1, "bench", "fused", *ONE_ROUND, "--batch-size", "2", "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = records(out)
    assert [r["what"] for r in rows] == [
        "layer_norm",
        "layer_norm_linear",
        "gelu",
        "attention",
        "embedding",
        "step: forward",
        "step: backward",
        "step: optimizer",
        "step: whole",
    ]
    assert all(finite_positive(r["fused_ms"], r["torch_ms"], r["fused/torch"]) for r in rows)


@pytest.mark.timeout(60)
def test_bench_calibrate_saves_alpha_beta_gamma_and_a_row_per_algorithm_and_size(tmp_path):
    from minidp_bench.calibrate import PLAN

    fit, rows = tmp_path / "calibration.json", tmp_path / "check.json"
    tiny = ("--ping-sizes", "0,1K,4K", "--reduce-sizes", "4K,16K", "--sizes", "4K,8K")
    args = ("bench", "calibrate", *tiny, "--iters", "1", "--warmup", "0")
    result = minidp(2, *args, "--out", str(fit), "--json", str(rows))
    assert result.returncode == 0, result.stderr
    model = json.load(open(fit))
    assert all(np.isfinite(model[k]) and model[k] >= 0 for k in ("alpha", "beta", "gamma"))
    assert all(np.isfinite(model[k]) and model[k] >= 0 for k in ("delta", "per_call"))
    for name in ("ring_step", "ping_pong"):
        assert [p["bytes"] for p in model[name]["points"]] == [0, 1024, 4096]
    want = [
        (op, algo, size) for op, algos in PLAN.items() for size in (4096, 8192) for algo in algos
    ]
    got = records(rows)
    assert [(r["op"], r["algo"], r["bytes"]) for r in got] == want
    assert all(r["nprocs"] == 2 and finite_positive(r["measured_us"], r["ratio"]) for r in got)
    again = minidp(2, *args, "--calibration", str(fit), "--json", str(rows))  # read, not fitted
    assert again.returncode == 0, again.stderr
    assert f"from {fit}" in again.stdout and len(records(rows)) == len(want)


@pytest.mark.timeout(60)
def test_bench_deferral_runs(tmp_path):
    out = tmp_path / "deferral.json"
    args = ("--cases", "mlp-small", "--micro-batches", "4", *ONE_ROUND)
    result = minidp(1, "bench", "deferral", *args, "--json", str(out))
    assert result.returncode == 0, result.stderr
    (row,) = records(out)
    assert row["case"] == "mlp-small" and row["micro_batches"] == 4 and row["rows"] == 16
    assert finite_positive(row["deferred_ms"], row["plain_ms"], row["deferred/plain"])


@pytest.mark.timeout(60)
def test_bench_mesh_has_every_layout_and_bytes_on_exactly_its_axes(tmp_path):
    out = tmp_path / "mesh.json"
    tiny = ("--n-embd", "16", "--block-size", "8", "--iters", "1", "--warmup", "0")
    result = minidp(4, "bench", "mesh", *tiny, "--json", str(out), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "oversubscribed" in result.stdout  # the header says what the times compare
    rows = records(out)
    layouts = {(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)}  # dp, tp, pp
    assert {(r["dp"], r["tp"], r["pp"]) for r in rows} == layouts and len(rows) == len(layouts)
    for r in rows:
        assert r["world_size"] == 4 and r["strategy"] == ("dp" if r["dp"] == 4 else "hybrid")
        for axis in ("dp", "tp", "pp"):
            assert (r[f"{axis}_KB"] == 0) == (r[axis] == 1), (r["layout"], axis)  # exactly 0
        assert finite_positive(r["step_ms"], r["state_KB"], r["act_KB"])
        if r["pp"] > 1:
            assert 0 <= r["bubble"] < 1 and 0 < r["bubble_formula"] < 1
        else:
            assert r["bubble"] is None and r["bubble_formula"] is None


BROKEN_RING = """
import sys
from minidp.comm import collectives
from minidp.cli.commands import main

collectives.ALLREDUCE["ring"] = lambda group, src, dst, op: None  # a ring that does nothing
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args",
    [
        ("bench", "collectives", "--ops", "allreduce", "--algos", "ring", "--sizes", "1K"),
        ("bench", "dp", "--case", "shallowspeed", "--algos", "ring"),
    ],
    ids=["collectives", "dp-shallowspeed"],
)
def test_a_wrong_answer_is_not_timed(tmp_path, args):
    script = tmp_path / "broken_ring.py"
    script.write_text(BROKEN_RING)
    result = subprocess.run(
        ["mpiexec", "-n", "2", sys.executable, str(script), *args, *ONE_ROUND],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("minidp: error:") == 1, result.stderr
    assert "not timing a wrong answer" in result.stderr and "ring" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(180)
def test_bench_rss_runs_each_row_as_a_job_and_checks_the_formula(tmp_path):
    out = tmp_path / "rss.json"
    gpt = ("--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8")
    args = ("--nprocs", "2", "--batch-size", "4", "--steps", "1", "--strategies", "zero3")
    cmd = [sys.executable, "-m", "minidp", "bench", "rss", *gpt, *args, "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr
    rows = records(out)
    assert [(r["N"], r["strategy"], r["precision"], r["recompute"]) for r in rows] == [
        (1, "dp", "fp32", False), (1, "dp", "bf16", True),
        *((2, "zero3", p, rc) for p in ("fp32", "bf16") for rc in (False, True)),
    ]  # fmt: skip
    for r in rows:  # the paper's bytes, AdamW's step counters aside; the OS's peak above them
        assert abs(r["vs_formula"] - 1) < 0.01 and r["peak_rss"] > r["model_states"], r


@pytest.mark.timeout(120)
def test_bench_cp_and_moe_check_their_bytes_and_write_their_rows(tmp_path):
    """bench cp checks each algorithm against one process and its bytes against the counters;
    bench moe stops if an all-to-all's bytes differ from the formula."""
    cp, moe = tmp_path / "cp.json", tmp_path / "moe.json"
    for args in (("cp", "--block-size", "16,32", "--iters", "1", "--warmup", "0", "--json", cp),
                 ("moe", "--steps", "2", "--out", tmp_path, "--json", moe)):  # fmt: skip
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "minidp", "bench", *map(str, args)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
        assert result.returncode == 0, result.stderr
    rows = records(cp)
    assert {r["algo"] for r in rows} == {"ring", "ring zigzag", "ulysses"}
    zigzag = next(r for r in rows if r["algo"] == "ring zigzag")
    assert zigzag["busiest/mean"] == 1.0 and zigzag["fwd_KB"] > 0
    assert {r["T"] for r in rows} == {16, 32}  # a sweep over the sequence length
    assert all(r["kept_vs_1/C"] < 1 for r in rows if r["algo"].startswith("ring"))  # no P kept
    rows = records(moe)
    assert any(r["capacity_factor"] == 0 and r["dropped_pct"] == 0 for r in rows)
    assert all(r["alltoall_kB"] > 0 and r["ep"] == 2 for r in rows)
