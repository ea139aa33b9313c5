"""`python -m minidp plot`: loss curves of --json files, a PNG and a table of the numbers."""

import json
import os

import pytest

from minidp.cli import commands as cli
from minidp.tools.loss_curves import main


def write_run(path, losses, final=None):
    records = [{"step": 5 * i, "loss": loss, "lr": 0.1} for i, loss in enumerate(losses)]
    with open(path, "w") as file:
        for record in records + ([final] if final else []):
            file.write(json.dumps(record) + "\n")
    return str(path)


@pytest.fixture
def runs(tmp_path):
    dp = write_run(
        tmp_path / "dp.jsonl",
        [4.5, 3.25, 2.875],
        {
            "final_loss": 2.875,
            "val_loss": 2.9375,
            "strategy": "dp",
            "world_size": 4,
            "steps": 11,
            "precision": "fp16",
            "overflow_at": [5, 6],
            "skipped_steps": [6, 10],
        },
    )
    zero = write_run(tmp_path / "zero.jsonl", [4.5, 3.5, 3.0625, 2.75])  # cut short: no final
    return dp, zero


def test_plot_saves_the_picture_and_prints_each_runs_final_loss(runs, tmp_path, capsys):
    png = tmp_path / "curves.png"
    assert cli.main(["plot", *runs, "--png", str(png)]) == 0
    assert png.stat().st_size > 1000
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:3]}
    # skipped: a loss scaler's overflows and the non-finite steps, each step once
    assert rows["dp.jsonl"][1:] == ["dp", "4", "11", "4.5000", "2.8750", "2.9375", "3"]
    assert rows["zero.jsonl"][1:] == ["?", "?", "16", "4.5000", "2.7500", "-", "0"]


def test_a_missing_file_or_one_without_step_records_is_one_line(runs, tmp_path, capsys):
    empty = tmp_path / "final_only.jsonl"
    empty.write_text(json.dumps({"final_loss": 1.0}) + "\nnot json\n")
    for path, said in [
        (str(tmp_path / "nope.jsonl"), "nope.jsonl: no such file"),
        (str(empty), "final_only.jsonl holds no step records"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main([runs[0], path, "--png", os.devnull])
        assert exit.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err
