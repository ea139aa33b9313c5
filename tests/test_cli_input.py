"""The command line as a new user meets it: every bad value is one line with exit code 2 (at
two ranks too: printed once, never a traceback per rank), the step-counted defaults follow
--steps, the header shows the flags that apply, and every --help reads whole."""

import json
import os
import subprocess
import sys

import pytest

from minidp.cli.commands import main
from minidp.cli.training.config import TrainConfig
from minidp.tools.memory import estimated_bytes
from minidp_bench import benchmarks


def minidp(*args: str, nprocs: int = 1, env=None, timeout: float = 120):
    cmd = [sys.executable, "-m", "minidp", *args]
    if nprocs > 1:
        cmd = ["mpiexec", "-n", str(nprocs), *cmd]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minidp: error:"), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0]


# ---- bad values: one line, exit code 2 -------------------------------------------------------
@pytest.mark.parametrize(
    "args, words",
    [
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--model", "mlp", "--n-head", "5"], "--n-head is a flag of --model gpt, not of --model"),
        (["--hidden", "64"], "--hidden is a flag of --model mlp, not of --model gpt"),
        (["--threads", "1000"], "--threads 1000 is more than the"),
        (["--n-embd", "65536", "--n-head", "1"], "--n-embd 65536, --n-layer 2 needs about"),
        (["--block-size", "1000000", "--batch-size", "2"], "--block-size 1000000 is longer"),
        (["--model", "mlp", "--hidden", "3000000"], "--hidden 3000000 needs about"),
        (["--prune", "0.8", "--steps", "60", "--prune-end", "60"], "--prune-end 60 is past"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--steps", "99999999999999999999"], "--steps 99999999999999999999 is more than can"),
        (["--warmup", "1000000001"], "--warmup 1000000001 is more than can run: at most 1,0"),
        (["--log-every", "10000000000"], "--log-every 10000000000 is more than can run"),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_line_naming_it(args, words, capsys):
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err


def test_json_and_trace_on_one_file_is_refused(tmp_path, capsys):
    path = str(tmp_path / "run.out")
    with pytest.raises(SystemExit) as exit:
        main(["--json", path, "--trace", path])
    assert exit.value.code == 2
    assert f"--json and --trace both name {path}" in capsys.readouterr().err


def test_a_block_longer_than_the_text_is_refused_before_any_array(capsys):
    with pytest.raises(SystemExit) as exit:  # small enough for memory, longer than the text
        main(["--block-size", "30000", "--batch-size", "1", "--n-layer", "1", "--n-head", "1",
              "--n-embd", "8", "--steps", "1"])  # fmt: skip
    assert exit.value.code == 2
    assert "--block-size 30000 is longer than the text" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["abc", "-5", "nan"])
def test_a_bad_minidp_timeout_is_one_line_at_two_ranks(value):
    result = minidp("--steps", "1", nprocs=2, env={"MINIDP_TIMEOUT": value})
    assert f"MINIDP_TIMEOUT='{value}'" in one_error_line(result)


@pytest.mark.timeout(120)
def test_a_bad_seed_is_one_line_at_two_ranks():
    assert "--seed must be >= 0" in one_error_line(minidp("--seed", "-1", nprocs=2))


def test_the_memory_estimate_is_within_2x_of_what_the_graph_holds():
    """estimated_bytes against the parameters, gradients, AdamW moments and activations that
    one process measures for the same GPT and batch (training/loop.py's memory report)."""
    from minidp.cli.training.loop import train

    config = TrainConfig(steps=1, batch_size=4, sample_tokens=0, eval_batches=1, threads=1)
    memory = train(config)["memory_bytes"]
    assert 0.5 < estimated_bytes(config) / sum(memory.values()) < 2, memory


# ---- defaults that follow --steps --------------------------------------------------------------
def test_step_counted_defaults_follow_steps():
    assert TrainConfig().resolved().warmup == 20  # the main job: as before
    short = TrainConfig(steps=60, prune=0.8).resolved()
    assert (short.warmup, short.prune_start, short.prune_end, short.prune_every) == (4, 10, 40, 2)
    given = TrainConfig(steps=60, warmup=7).resolved()
    assert given.warmup == 7  # a value given is kept
    TrainConfig(steps=60, prune=0.8).validate()  # no error from a default never set
    for config in (TrainConfig(), TrainConfig(strategy="ps", model="mlp"), short):
        config.resolved().validate()  # a filled-in default still reads as unset
    assert TrainConfig(steps=60, prune_end=40).is_set("prune_end") is False  # its default


@pytest.mark.timeout(120)
def test_pruning_a_short_run_needs_no_schedule_flags(tmp_path):
    out = tmp_path / "run.json"
    args = ("--prune", "0.8", "--steps", "6", "--model", "mlp", "--hidden", "16")
    result = minidp(*args, "--json", str(out), "--log-every", "5")
    assert result.returncode == 0, result.stderr
    final = json.loads(out.read_text().splitlines()[-1])
    assert final["config"]["prune_end"] == 4 and final["config"]["warmup"] == 0
    assert final["config"]["servers"] == 1  # the record keeps every field


# ---- the header and --help ----------------------------------------------------------------------
def test_the_header_shows_the_flags_that_apply():
    dp = TrainConfig().resolved().header()
    assert "allreduce=auto" in dp and "warmup=20" in dp and "block_size=64" in dp
    for other in ("servers=", "consistency=", "zero_stage=", "tp=", "prune_start=", "hidden="):
        assert other not in dp, (other, dp)
    pruned = TrainConfig(prune=0.5).resolved().header()
    assert "prune_start=50" in pruned and "prune_end=200" in pruned
    ps = TrainConfig(strategy="ps", model="mlp").resolved().header()
    assert "servers=1" in ps and "hidden=128" in ps
    assert "allreduce=" not in ps and "block_size=" not in ps and "bucket_mb=" not in ps


def description(help_text: str) -> str:
    """The paragraph between argparse's usage block and its 'options:' line."""
    body = help_text.split("\n\n", 1)[1].split("\noptions:", 1)[0]
    return " ".join(body.split())


@pytest.mark.parametrize("command", [["train"], *(["bench", b] for b in benchmarks())], ids=str)
def test_every_help_reads_whole(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([*command, "--help"])
    assert exit.value.code == 0
    text = description(capsys.readouterr().out)
    assert text.endswith("."), f"{' '.join(command)} --help: {text!r}"


# ---- an error every rank raises alike is printed once ------------------------------------------
MISMATCH = """
import sys
from minidp import comm
from minidp.cli.commands import main

if comm.world().rank == 1:  # rank 1 broadcasts where rank 0 allgathers: a mismatch on both
    comm.allgather = lambda x, group=None, **kw: comm.broadcast(x, root=0, group=group)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(120)
def test_a_mismatch_every_rank_finds_is_printed_once(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    result = subprocess.run(
        ["mpiexec", "-n", "2", sys.executable, str(script), "--model", "mlp", "--steps", "1"],
        capture_output=True, text=True, timeout=100, env={**os.environ, "MINIDP_CHECKS": "1"},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("Root cause") == 1, result.stderr
    assert result.stderr.count("CollectiveMismatch:") == 1, result.stderr


def test_each_flags_metadata_is_well_formed_and_its_default_passes_its_own_check():
    """A flag's interval and what a resume keeps live in its one definition (config.py):
    each interval parses, holds the flag's default, and on_resume names a known kind."""
    from dataclasses import fields

    from minidp.tools.flags import outside

    config = TrainConfig().resolved()
    for f in fields(TrainConfig):
        assert f.metadata.get("on_resume") in (None, "model", "data", "run"), f.name
        interval = f.metadata.get("interval")
        if interval is not None:
            assert not outside(getattr(config, f.name), interval), (f.name, interval)
            assert outside(float("nan"), interval) and outside(-1, interval), f.name


def test_what_a_resume_keeps_is_written_down_here_too():
    """The flags whose metadata makes them part of the model, the order of the data or the
    run (resume.py refuses another value): a new flag joins one of these on purpose, or
    may change across a resume; this list makes either a decision."""
    from minidp.cli.training import resume

    assert set(resume.MODEL_FIELDS) == {
        *("model", "n_layer", "n_head", "n_embd", "block_size", "hidden", "dtype", "precision"),
        *("experts", "moe_top_k", "capacity_factor", "moe_every", "aux_loss_coef"),
    }
    assert set(resume.DATA_ORDER) == {"seed", "batch_size"}
    assert set(resume.SAME_RUN) == {
        *("steps", "lr", "warmup", "min_lr_ratio"),  # the learning rate at every step
        *("optimizer", "ps_optimizer", "weight_decay", "grad_clip"),  # what each step does
        *("dropout", "compress", "compress_warmup", "compress_on"),
        *("prune", "prune_start", "prune_end", "prune_every", "prune_scope"),
        *("prune_structured", "prune_structured_at"),  # (--resume refuses them anyway)
        *("teacher", "temperature", "alpha"),  # distillation's loss
    }
