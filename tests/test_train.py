"""The training loop on one process, and the command line around it.

Runs are tiny (tens of steps, small models) so each takes about a second; the loop is
called in-process through `minidp.cli.training.loop.train(TrainConfig(...))`, and the command line
through a subprocess, as a user would type it.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from minidp import optim
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import TrainingDiverged, train

MLP_RUN = {"model": "mlp", "steps": 30, "batch_size": 32, "hidden": 32, "warmup": 3, "lr": 1e-2}
GPT_RUN = {
    "model": "gpt",
    "steps": 40,
    "batch_size": 16,
    "block_size": 16,
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 32,
    "warmup": 4,
    "lr": 1e-2,
}
QUIET = {"log_every": 1, "eval_batches": 2, "sample_tokens": 0}


def run(tmp_path, **overrides) -> tuple[list[dict], dict]:
    """Train in-process; return (the per-step records, the final record) from --json."""
    path = tmp_path / "records.jsonl"
    final = train(TrainConfig(**{**QUIET, **overrides, "json": str(path)}))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[-1] == final
    return records[:-1], final


def minidp_cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minidp", *args], capture_output=True, text=True, timeout=timeout
    )


# ---- the loop ---------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [MLP_RUN, GPT_RUN], ids=["mlp", "gpt"])
def test_loss_goes_down(tmp_path, config):
    records, final = run(tmp_path, **config)
    first = records[0]["loss"]
    last = np.mean([r["loss"] for r in records[-10:]])  # tiny batches: average the noise
    assert last < 0.85 * first, [r["loss"] for r in records]
    assert final["val_loss"] < 0.85 * first


@pytest.mark.parametrize(
    "config",
    [
        MLP_RUN,
        {**GPT_RUN, "steps": 5, "dropout": 0.1},  # dropout masks must come from the seed as well
        {**MLP_RUN, "dtype": "float64", "steps": 10},
    ],
    ids=["mlp", "gpt-dropout", "mlp-float64"],
)
def test_same_seed_same_result_bitwise(tmp_path, config):
    first_records, first = run(tmp_path, **config)
    second_records, second = run(tmp_path, **config)
    timing = {"time_s", "comm_s", "exposed_comm_s", "measured_step_s", "predicted_over_measured"}
    timing |= {"peak_rss", "peak_rss_built"}  # the OS's high-water marks: this process's,
    # from before the run on

    def timed(k: str) -> bool:  # a clock's reading (the step model's predicted seconds too)
        return (
            k in timing or k.endswith("_per_s") or k.startswith("predicted_") and k.endswith("_s")
        )

    assert {k: v for k, v in first.items() if not timed(k)} == {
        k: v for k, v in second.items() if not timed(k)
    }
    assert [r["loss"] for r in first_records] == [r["loss"] for r in second_records]


def test_another_seed_gives_another_result(tmp_path):
    _, a = run(tmp_path, **MLP_RUN, seed=1)
    _, b = run(tmp_path, **MLP_RUN, seed=2)
    assert a["final_loss"] != b["final_loss"]


def test_json_records_hold_the_contract_fields(tmp_path):
    records, final = run(tmp_path, **{**MLP_RUN, "log_every": 10})
    assert [r["step"] for r in records] == [0, 10, 20, 29]  # every log step and the last one
    assert all(np.isfinite(r["loss"]) for r in records)
    ratio = TrainConfig().min_lr_ratio
    for r in records:  # the rate the step ran with, and how fast it went
        want = optim.warmup_cosine(r["step"], MLP_RUN["lr"], MLP_RUN["warmup"], 30, ratio)
        assert r["lr"] == pytest.approx(want, rel=1e-12), r
        assert np.isfinite(r["examples_per_s"]) and r["examples_per_s"] > 0, r
    assert final["final_loss"] == records[-1]["loss"]
    assert final["steps"] == 30 and final["world_size"] == 1
    assert isinstance(final["strategy"], str) and final["strategy"]
    assert final["param_l2"] > 0


def test_a_non_finite_loss_stops_training_naming_the_step():
    config = TrainConfig(
        **{
            **MLP_RUN,
            **QUIET,
            "lr": 1e6,
            "grad_clip": 0.0,
            "warmup": 0,
            "steps": 50,
            "dtype": "float32",
        }
    )
    with pytest.raises(TrainingDiverged, match=r"at step \d+"):
        train(config)


# ---- the command line ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["--bogus"],
        ["--steps", "ten"],
        ["--model", "resnet"],
        ["--dtype", "float16"],
        ["--steps", "0"],
        ["--n-embd", "30", "--n-head", "4"],
        ["train", "--lr", "-1"],
        ["--lr", "nan"],
        ["--bucket-mb", "inf"],
        ["--min-lr-ratio", "-5"],
        ["--json", "/nonexistent/run.json"],  # found before training, not after it
        ["--log-dir", "/proc/minidp"],
    ],
    ids=lambda a: " ".join(a),
)
def test_a_bad_flag_or_value_is_one_line_and_exit_code_2(args):
    result = minidp_cli(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minidp: error:"), result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_diverging_run_exits_1_with_the_step_named():
    result = minidp_cli(
        "--model",
        "mlp",
        "--lr",
        "1e6",
        "--grad-clip",
        "0",
        "--warmup",
        "0",
        "--steps",
        "50",
        "--dtype",
        "float32",
        "--log-every",
        "10",
    )
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("minidp: error:")]
    assert len(errors) == 1 and "step" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_cli_trains_and_writes_json(tmp_path):
    path = tmp_path / "run.jsonl"
    result = minidp_cli(
        "--model", "mlp", "--steps", "5", "--log-every", "2", "--hidden", "16", "--json", str(path)
    )
    assert result.returncode == 0, result.stderr
    final = json.loads(path.read_text().splitlines()[-1])
    assert final["steps"] == 5 and np.isfinite(final["final_loss"])


def test_info_runs():
    result = minidp_cli("info")
    assert result.returncode == 0, result.stderr
    assert "minidp" in result.stdout and "world size 1" in result.stdout
    assert "Traceback" not in result.stderr
