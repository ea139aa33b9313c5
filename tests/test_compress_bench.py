"""`python -m minidp bench compress` at tiny sizes, and `--compress` on the command line:
the plumbing and the records, never a time."""

import json

import pytest
from test_bench import minidp

TINY = ("--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8")


@pytest.mark.timeout(180)
def test_bench_compress_runs_every_contender_side_by_side(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "curves.png"
    args = ("--steps", "11", "--batch-size", "4", "--json", str(out), "--plot", str(png))
    result = minidp(2, "bench", "compress", *TINY, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["compress"]: r for r in map(json.loads, open(out))}
    assert list(rows)[0] == "none" and len(rows) == 11 and png.stat().st_size > 0
    assert rows["none"]["bytes_ratio"] == 1.0 and rows["fp16"]["bytes_ratio"] == 2.0
    assert rows["topk:0.001"]["bytes_ratio"] > 100 and rows["powersgd:2"]["bytes_ratio"] > 1
    for row in rows.values():
        assert row["max_param_diff"] == 0 and len(row["losses"]) == 11
    assert rows["sign"]["residual_norm"] > 0 and rows["sign-noef"]["residual_norm"] is None
    assert "time_vs_none" in result.stdout and "picture:" in result.stdout


@pytest.mark.timeout(120)
def test_train_prints_and_records_what_compression_did(tmp_path):
    out = tmp_path / "run.json"
    run = ("--steps", "2", "--model", "mlp", "--hidden", "8", "--json", str(out))
    result = minidp(2, "--compress", "sign", *run, "--sample-tokens", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    final = [json.loads(line) for line in open(out)][-1]
    assert final["compress"] == "sign" and final["compression_ratio"] > 20
    assert final["grad_bytes_sent"] > 0 and final["residual_norm"] > 0
    assert "compress sign: " in result.stdout and "ratio" in result.stdout


@pytest.mark.timeout(180)
def test_bench_compress_on_the_velocity_with_momentum_sgd(tmp_path):
    out = tmp_path / "bench.json"
    args = ("--steps", "11", "--batch-size", "4", "--plot", str(tmp_path / "v.png"))
    velocity = ("--optimizer", "momentum", "--compress-on", "velocity")
    result = minidp(2, "bench", "compress", *TINY, *args, *velocity, "--json", str(out),
                    "--compressors", "none,topk:0.001")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["compress"]: r for r in map(json.loads, open(out))}
    assert rows["topk:0.001"]["bytes_ratio"] > 100 and rows["topk:0.001"]["max_param_diff"] == 0
    assert "momentum lr 0.15 | compress on the velocity" in result.stdout
    refused = minidp(2, "bench", "compress", *TINY, *args, *velocity, "--compressors",
                     "none,powersgd:2")  # fmt: skip
    assert refused.returncode == 2
    assert "bench compress: powersgd:2: --compress-on velocity clears" in refused.stderr
