"""Mixture of experts and expert parallelism from the command line (`--experts E --ep N`
under --strategy dp and hybrid): at 2 and 4 ranks, EP 2 and 4, top-1 and top-2, dropless,
and under TP (hybrid dp 2 x tp 2 x ep 2 at 4 ranks, dp 4 x tp 2 x ep 2 at 8), each equal to
one process `--experts E` in final loss, validation loss (the gathered model)
and parameter L2 to 1e-10 relative (float64), with the same experts' load, the predicted
dp and tp bytes the run's (the ep bytes a lower bound, dropless); a capacity factor at EP 2
equal to EP 1 over the same ranks and to dp 2 x tp 2 x ep 2 (each DP rank one capacity
group either way: the one-process run with the ranks' capacity groups is
tests/test_expert_parallel.py's), its bytes predicted exactly on every axis; the ep bytes
against alltoall_bytes; the record's load; checkpoints that reshard (EP 2 -> 2,
EP 2 -> 1, EP 1 -> 2, 4 ranks -> 2 at EP 2); and the refusals, one line each before any
message. The pieces themselves are tested in tests/test_moe.py and
tests/test_expert_parallel.py."""

import json
import math
import os
import subprocess
import sys

import pytest

from minidp import comm
from minidp.cli.commands import main
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.parallel.experts import alltoall_bytes

TINY = dict(
    n_layer=2, n_embd=32, n_head=4, block_size=16, batch_size=8, steps=3, log_every=1,
    eval_batches=1, sample_tokens=0, dtype="float64", experts=4,
)  # fmt: skip
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]


def alone(**more) -> dict:
    """The run on one process (a group of one), `more` flags changed."""
    solo = comm.world().split(0)
    try:
        return train(TrainConfig(**{**TINY, **more}), solo)
    finally:
        solo.free()


@pytest.fixture(scope="module")
def one_process() -> dict:
    return {k: alone(moe_top_k=k) for k in (1, 2)}


def launch(tmp_path, ranks: int, *flags: str, name="ep.json") -> tuple[dict, str]:
    path = tmp_path / name
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "minidp", *FLAGS, *flags,
           "--json", str(path)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in open(path)][-1], result.stdout


RUNS = [  # (ranks, flags)
    (2, ["--ep", "2"]),
    (2, ["--ep", "2", "--moe-top-k", "2"]),
    (4, ["--ep", "2"]),
    (4, ["--ep", "4", "--moe-top-k", "2"]),
    (2, ["--strategy", "hybrid", "--dp", "2", "--ep", "2"]),
    # under TP: attention split over TP, each MoE layer whole on the TP ranks, its experts
    # over EP groups of the DP ranks at one TP coordinate (parallel/tensor_parallel/mesh_gpt.py)
    (4, ["--strategy", "hybrid", "--dp", "2", "--tp", "2", "--ep", "2"]),
    (4, ["--strategy", "hybrid", "--dp", "2", "--tp", "2", "--ep", "2", "--moe-top-k", "2"]),
    (8, ["--strategy", "hybrid", "--dp", "4", "--tp", "2", "--ep", "2"]),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "ranks,flags", RUNS, ids=lambda x: str(x) if isinstance(x, int) else " ".join(x)
)
def test_an_ep_run_trains_like_one_process(ranks, flags, tmp_path, one_process):
    final, stdout = launch(tmp_path, ranks, *flags)
    top_k = 2 if "--moe-top-k" in flags else 1
    one = one_process[top_k]
    for key in ("final_loss", "val_loss", "param_l2"):
        assert final[key] == pytest.approx(one[key], rel=1e-10), key
    assert final["max_param_diff"] == 0.0
    assert final["expert_load"]["tokens_per_expert"] == one["expert_load"]["tokens_per_expert"]
    ep, tp = (int(flags[flags.index(f) + 1]) if f in flags else 1 for f in ("--ep", "--tp"))
    header = f"dp {ranks // tp} x ep {ep} ({4 // ep} of 4 experts a rank)"
    assert final["ep"] == ep and header in stdout
    by_axis, predicted = final["bytes_sent_by_axis"], final["predicted_bytes_by_axis"]
    if tp > 1:
        assert f"x tp {tp} (each MoE layer whole on its TP ranks)" in stdout
        assert by_axis["tp"] > 0
    assert "experts' load" in stdout
    # predicted (cost/experts.py): dp and tp exactly (under TP: attention's g and f, the
    # loss's sums, the norm, TP rank 0's replicated gradients at dp 4); dropless, the ep
    # bytes at an even load: a lower bound
    assert {a: predicted[a] for a in ("dp", "tp", "pp", "cp")} == {
        a: by_axis[a] for a in ("dp", "tp", "pp", "cp")
    }
    assert predicted["ep"] <= by_axis["ep"]


def test_the_ep_bytes_are_the_all_to_alls_and_the_record_holds_the_load(tmp_path):
    """Per layer and forward, 4 all-to-alls (dispatch, combine, their reverses) of S slots
    (the record's "slots", summed over the run) and the agreement on S (a max of 8 bytes);
    per step the clip's sum of the experts' squares (8 bytes): 2 ranks send each whole."""
    final, _ = launch(tmp_path, 2, "--ep", "2", "--moe-top-k", "2")
    load = final["expert_load"]
    B, T, k, steps, layers = 8, 16, 2, 3, 2
    assert load["layers"] == ["blocks.0.moe", "blocks.1.moe"] and load["dropped"] == 0
    assert [sum(row) for row in load["tokens_per_expert"]] == [steps * B * T * k] * layers
    assert load["tokens"] == [steps * B * T] * layers
    a2a = sum(4 * alltoall_bytes(2, 4, S, 32, 8) for S in load["slots"])
    by_axis = final["bytes_sent_by_axis"]
    assert set(by_axis) == {"dp", "tp", "pp", "cp", "ep"} and by_axis["dp"] > 0
    assert by_axis["ep"] == a2a + 8 * steps * layers + 8 * steps
    # predicted (cost/experts.py): dp exactly; ep at an even load, S = ceil(N_r k / E): a bound
    predicted, even = final["predicted_bytes_by_axis"], math.ceil(B // 2 * T * k / 4)
    assert predicted["dp"] == by_axis["dp"]
    assert (
        predicted["ep"] == steps * layers * (4 * alltoall_bytes(2, 4, even, 32, 8) + 8) + 8 * steps
    )
    assert predicted["ep"] <= by_axis["ep"]


@pytest.mark.timeout(240)
def test_a_capacity_factor_drops_alike_at_ep_1_and_2_and_under_tp(tmp_path):
    """Each DP rank's slice is its capacity group whatever --ep, and its TP ranks route it
    alike, so EP 2 equals EP 1, and dp 2 x tp 2 x ep 2 on 4 ranks equals both."""
    flags = ["--capacity-factor", "1.0", "--moe-top-k", "2"]
    two, _ = launch(tmp_path, 2, *flags, "--ep", "2", name="two.json")
    one, _ = launch(tmp_path, 2, *flags, name="one.json")
    mesh = ["--strategy", "hybrid", "--dp", "2", "--tp", "2", "--ep", "2"]
    tp, _ = launch(tmp_path, 4, *flags, *mesh, name="tp.json")
    assert two["expert_load"]["dropped"] > 0
    # every forward fills some expert's capacity, ceil(1.0 * 64 * 2 / 4) = 32: S is the
    # capacity, and the prediction's bytes are the run's (cost/experts.py), every axis
    assert two["expert_load"]["slots"] == tp["expert_load"]["slots"] == [3 * 32] * 2
    for run in (one, two, tp):
        assert run["predicted_bytes_by_axis"] == run["bytes_sent_by_axis"]
    assert tp["bytes_sent_by_axis"]["tp"] > 0 and tp["bytes_sent_by_axis"]["ep"] > 0
    for run in (one, tp):
        drops = run["expert_load"]["dropped_per_expert"]
        assert drops == two["expert_load"]["dropped_per_expert"]
        for key in ("final_loss", "val_loss", "param_l2"):
            assert two[key] == pytest.approx(run[key], rel=1e-10), key


@pytest.mark.timeout(300)
def test_a_checkpoint_resumes_at_its_layout_and_at_another_ep_or_world_size(tmp_path):
    """Saved after 2 of 4 steps and resumed as a run of 4 (float64, 1e-10 of one process):
    dp 2 x ep 2 at its layout and in one process (EP 2 -> 1: each expert read from the shard
    of the rank that saved it); one process into dp 2 x ep 2 (EP 1 -> 2); dp 4 x ep 2 into
    dp 2 x ep 2 (another world size, the same ep)."""
    straight = alone(steps=4)
    saved = {}
    for ranks, ep in ((2, 2), (4, 2)):
        save = str(tmp_path / f"ckpt{ranks}")
        launch(tmp_path, ranks, "--ep", str(ep), "--steps", "4", "--save-dir", save,
               "--save-every", "2")  # fmt: skip
        saved[ranks] = os.path.join(save, "step_000002")
    alone(steps=4, save_dir=str(tmp_path / "ckpt1"), save_every=2)
    saved[1] = str(tmp_path / "ckpt1" / "step_000002")
    resumed = [
        launch(tmp_path, 2, "--ep", "2", "--steps", "4", "--resume", saved[2])[0],
        alone(steps=4, resume=saved[2]),
        launch(tmp_path, 2, "--ep", "2", "--steps", "4", "--resume", saved[1])[0],
        launch(tmp_path, 2, "--ep", "2", "--steps", "4", "--resume", saved[4])[0],
    ]
    for case, run in zip(("2 -> 2", "ep 2 -> 1", "ep 1 -> 2", "4 -> 2 ranks"), resumed):
        for key in ("final_loss", "val_loss", "param_l2"):
            assert run[key] == pytest.approx(straight[key], rel=1e-10), (case, key)


def test_plot_reads_an_ep_run(tmp_path):
    final, _ = launch(tmp_path, 2, "--ep", "2")
    out = tmp_path / "loss.png"
    assert main(["plot", str(tmp_path / "ep.json"), "--png", str(out)]) in (0, None)
    assert math.isfinite(final["final_loss"])


BAD = [
    (["--ep", "2"], "--ep shapes the experts: give --experts E", False),
    (["--experts", "3", "--ep", "2"], "need E = --experts 3 to divide by N", True),
    (["--experts", "4", "--ep", "0"], "--ep must be >= 1", True),
    (["--experts", "4", "--ep", "2"], "--ep 2 and --batch-size 8 must divide by the 1 DP", True),
    (["--experts", "4", "--strategy", "zero", "--zero-stage", "1"],
     "--experts is a flag of --strategy dp or hybrid, not of --strategy zero", True),
    (["--experts", "4", "--strategy", "tp"], "--experts is a flag of --strategy dp or", True),
    (["--experts", "4", "--model", "mlp"], "--experts is a flag of --model gpt", True),
    (["--strategy", "hybrid", "--tp", "2", "--sequence-parallel"],
     "--experts with --sequence-parallel is not yet supported", True),
    (["--strategy", "hybrid", "--pp", "2"], "--experts with --pp is not yet supported", True),
    (["--strategy", "hybrid", "--cp", "2"], "--experts with --cp is not yet supported", True),
    (["--strategy", "hybrid", "--zero-stage", "1"], "with --zero-stage is not yet", True),
    (["--compress", "fp16"], "--experts with --compress is not yet supported", True),
    (["--prune", "0.5"], "--experts with --prune is not yet supported", True),
    (["--recompute"], "--experts with --recompute (the router's counts would be summed", True),
    (["--moe-top-k", "3"], "invalid choice", True),
]  # fmt: skip


@pytest.mark.parametrize("args,message,experts", BAD, ids=lambda x: str(x)[:40])
def test_bad_ep_flags_are_one_line_and_exit_code_2(args, message, experts, capsys):
    flags = [f for f in FLAGS if not f.startswith("--experts")] if not experts else FLAGS
    if "mlp" in args:
        flags = ["--steps", "3", "--batch-size", "4"]
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert err.count("error:") == 1, err


def test_a_batch_that_does_not_split_evenly_is_one_line_on_rank_0():
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "minidp", *FLAGS, "--batch-size", "7"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("minidp: error:") == 1
    assert "--ep 1 and --batch-size 7 must divide by the 2 DP ranks" in result.stderr


def test_predict_prices_the_all_to_alls(capsys):
    """dp 4 x ep 2, B 8: 2 examples, N_r = 32 tokens a rank, top-1, E 4: S = 8 (an even
    load); per step and MoE layer 4 all-to-alls and the 8-byte agreement on S, the clip's 8."""
    from minidp.cost.predict import main as predict

    assert predict([*FLAGS, "--strategy", "hybrid", "--dp", "4", "--ep", "2", "--world", "4"]) == 0
    out = capsys.readouterr().out
    ep = 2 * (4 * alltoall_bytes(2, 4, 8, 32, 8) + 8) + 8
    assert f"ep {ep:,}" in out and "(dp 4 x tp 1, ep 2" in out, out
    assert "S = 8 slots an expert, an even load of the 32 tokens" in out, out
    # dp 4 x tp 2 on 8 ranks: the same all-to-alls on each TP rank (its MoE layers whole)
    assert predict([*FLAGS, "--strategy", "hybrid", "--tp", "2", "--ep", "2", "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert f"ep {ep:,}" in out and "(dp 4 x tp 2, ep 2" in out and "tp 0," not in out, out
