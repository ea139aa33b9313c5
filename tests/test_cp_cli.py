"""Context parallelism from the command line (`--strategy hybrid --cp C`): dp x cp and
tp x cp, ring (zig-zag and contiguous) and Ulysses, each equal to one process in final
loss, validation loss (the gathered model) and parameter L2 to 1e-10 relative (float64);
the cp axis in the record and the header; the cp bytes the cost model predicts equal to
what the run counts; inside the pipeline (--pp: dp x cp x pp and cp x pp x tp at 8 ranks,
cp x pp at 4), equal to one process too, its bytes on every axis predicted exactly
(cost/pp_step.py: each stage's hops or all-to-alls); checkpoints that reshard (cp 2 -> 2,
cp 2 -> dp 1 and dp 2, dp 1 -> cp 2, dp 2 x cp 2 -> tp 2 x cp 2); and the refusals, one
line each before any message. The pieces themselves (ring_attention, ulysses_attention,
ContextParallel) are tested in tests/test_context_parallel.py."""

import json
import os
import subprocess
import sys

import pytest

from minidp import comm
from minidp.cli.commands import main
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.cost.calls import gpt_shapes
from minidp.cost.step import Layout, bytes_by_axis

TINY = dict(
    n_layer=2, n_embd=32, n_head=4, block_size=32, batch_size=4, steps=3, log_every=1,
    eval_batches=1, sample_tokens=0, dtype="float64",
)  # fmt: skip
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The same run on one process (--strategy dp over a group of one)."""
    return alone()


def alone(**more) -> dict:
    """TINY on one process (a group of one), `more` flags changed."""
    solo = comm.world().split(0)
    try:
        return train(TrainConfig(**{**TINY, **more}), solo)
    finally:
        solo.free()


def hybrid(tmp_path, *mesh: str, ranks: int = 4) -> tuple[dict, str]:
    path = tmp_path / "cp.json"
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "minidp", *FLAGS,
           "--strategy", "hybrid", *mesh, "--json", str(path)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in open(path)][-1], result.stdout


MESHES = [  # (flags, the record's mesh, the header's cp groups)
    (["--dp", "2", "--cp", "2"], {"dp": 2, "tp": 1, "pp": 1, "cp": 2}, "{0,1} {2,3}"),
    (["--tp", "2", "--cp", "2"], {"dp": 1, "tp": 2, "pp": 1, "cp": 2}, "{0,2} {1,3}"),
    (["--dp", "2", "--cp", "2", "--cp-algo", "ulysses"], {"dp": 2, "tp": 1, "pp": 1, "cp": 2},
     "{0,1} {2,3}"),
    (["--tp", "2", "--cp", "2", "--cp-algo", "ulysses", "--cp-layout", "zigzag"],
     {"dp": 1, "tp": 2, "pp": 1, "cp": 2}, "{0,2} {1,3}"),
    (["--cp", "4", "--cp-layout", "contiguous", "--block-size", "64"],
     {"dp": 1, "tp": 1, "pp": 1, "cp": 4}, "{0,1,2,3}"),
]  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh,sizes,groups", MESHES, ids=lambda m: " ".join(m)[:40])
def test_a_cp_mesh_trains_like_one_process_and_its_cp_bytes_are_predicted(
    mesh, sizes, groups, tmp_path, one_process
):
    final, stdout = hybrid(tmp_path, *mesh)
    one = one_process
    if "--block-size" in mesh:  # a longer sequence: its own one-process run
        one = alone(block_size=64)
    for key in ("final_loss", "val_loss", "param_l2"):
        assert final[key] == pytest.approx(one[key], rel=1e-10), key
    assert final["max_param_diff"] == 0.0
    assert final["mesh"] == sizes
    assert f"cp groups {groups}" in stdout and "context parallel" in stdout
    by_axis = final["bytes_sent_by_axis"]
    assert by_axis["cp"] > 0 and by_axis["pp"] == 0
    assert (by_axis["tp"] > 0) == (sizes["tp"] > 1) and (by_axis["dp"] > 0) == (sizes["dp"] > 1)
    # the cost model (run on the ranks at the end, with --json): every axis, cp's exactly
    assert final["predicted_bytes_by_axis"] == by_axis


PIPELINES = [  # (ranks, flags, the record's mesh): --micro-batches 2 (2 examples a replica)
    (8, ["--dp", "2", "--cp", "2", "--pp", "2"], {"dp": 2, "tp": 1, "pp": 2, "cp": 2}),
    (8, ["--tp", "2", "--cp", "2", "--pp", "2", "--schedule", "zb-h1", "--cp-algo", "ulysses"],
     {"dp": 1, "tp": 2, "pp": 2, "cp": 2}),
    (4, ["--cp", "2", "--pp", "2", "--schedule", "gpipe", "--cp-layout", "contiguous",
         "--recompute"], {"dp": 1, "tp": 1, "pp": 2, "cp": 2}),
]  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "ranks,mesh,sizes", PIPELINES, ids=["dp2-cp2-pp2", "tp2-cp2-pp2", "cp2-pp2"]
)
def test_cp_inside_the_pipeline_trains_like_one_process(ranks, mesh, sizes, tmp_path, one_process):
    final, stdout = hybrid(tmp_path, *mesh, "--micro-batches", "2", ranks=ranks)
    for key in ("final_loss", "val_loss", "param_l2"):
        assert final[key] == pytest.approx(one_process[key], rel=1e-10), key
    assert final["max_param_diff"] == 0.0
    assert final["mesh"] == sizes
    assert "cp groups" in stdout and "pp groups" in stdout
    by_axis = final["bytes_sent_by_axis"]
    assert by_axis["cp"] > 0 and by_axis["pp"] > 0
    assert (by_axis["tp"] > 0) == (sizes["tp"] > 1) and (by_axis["dp"] > 0) == (sizes["dp"] > 1)
    # the cost model (cost/pp_step.py): each stage's ring hops or all-to-alls a micro-batch
    # (again in backward with --recompute), the loss's and the gradients' sums over CP
    assert final["predicted_bytes_by_axis"] == by_axis


@pytest.mark.timeout(300)
def test_a_checkpoint_resumes_at_its_cp_and_at_another_cp(tmp_path, capsys):
    """Saved after 2 of 4 steps and resumed as a run of 4 (float64, 1e-10 of one process):
    cp 2 at its layout; in one process and over dp 2 (CP 2 -> 1: the model and its moments
    are whole on every CP rank, declared replicated or a TP slice of one); one process into
    cp 2 (CP 1 -> 2); dp 2 x cp 2 into tp 2 x cp 2 (the TP slices cut from the whole)."""
    straight = alone(steps=4)
    four = ["--steps", "4", "--save-every", "2"]
    for ranks, mesh in ((2, ["--cp", "2"]), (4, ["--dp", "2", "--cp", "2"])):
        hybrid(tmp_path, *mesh, *four, "--save-dir", str(tmp_path / f"ckpt{ranks}"), ranks=ranks)
    alone(steps=4, strategy="hybrid", dp=1, save_dir=str(tmp_path / "ckpt1"), save_every=2)
    saved = {n: str(tmp_path / f"ckpt{n}" / "step_000002") for n in (1, 2, 4)}
    capsys.readouterr()
    resumed = {"cp 2 -> 1": (alone(steps=4, strategy="hybrid", dp=1, resume=saved[2]),
                             capsys.readouterr().out)}  # fmt: skip
    for case, ranks, mesh, path in (
        ("cp 2 -> 2", 2, ["--cp", "2"], saved[2]),
        ("cp 2 -> dp 2", 2, ["--dp", "2"], saved[2]),
        ("cp 1 -> 2", 2, ["--cp", "2"], saved[1]),
        ("dp 2 x cp 2 -> tp 2 x cp 2", 4, ["--tp", "2", "--cp", "2"], saved[4]),
    ):
        resumed[case] = hybrid(tmp_path, *mesh, "--steps", "4", "--resume", path, ranks=ranks)
    for case, (run, stdout) in resumed.items():
        assert "at step 2" in stdout, case  # resumed, not trained again from step 0
        for key in ("final_loss", "val_loss", "param_l2"):
            assert run[key] == pytest.approx(straight[key], rel=1e-10), (case, key)


def test_predict_prices_cp_inside_the_pipeline(capsys):
    """dp 2 x pp 2 x cp 2, ring, rank 0 (stage 0: the embeddings and block 0): per
    micro-batch of 1 example (t = 16 positions, 32 channels) the block's 1 + 3 K/V hops,
    and per step each of its stage's gradients summed over CP; its activations to stage 1
    hold its 16 positions (a 64-byte header before each), beside the pipeline's four
    float64 sums (the bubble's three, the clip's)."""
    from minidp import cost
    from minidp.cost.pp_step import stage_params
    from minidp.cost.predict import main as predict

    args = [*FLAGS, "--strategy", "hybrid", "--dp", "2", "--cp", "2", "--pp", "2"]
    assert predict([*args, "--micro-batches", "2", "--world", "8"]) == 0
    out = capsys.readouterr().out
    hops = 2 * 4 * (2 * 16 * 32 * 8)  # 2 micro-batches x 4 hops of (k, v): 2 x 16 x 32
    gpt = (2, 32, 96, 32)  # L, C, V (the corpus's characters), T
    sums = sum(cost.sent("allreduce", "auto", 2, 0, n, 8).bytes for n in stage_params(gpt, 2, 0))
    assert "(dp 2 x tp 1 x pp 2 x cp 2 (ring)" in out, out
    assert f"pp {2 * (64 + 16 * 32 * 8) + 4 * 8:,}, cp {hops + sums:,}" in out, out


def test_the_cp_bytes_of_the_step_model_are_the_ring_and_ulysses_formulas():
    """Per step on one rank: the ring's (C-1) + (2C-1) K/V-sized hops a layer against
    Ulysses' 4 (C-1)/C of q, k, v and y, each with the loss's and the gradients' sums."""
    C, B, T, width, layers, w = 2, 4, 32, 32, 2, 8
    shapes = gpt_shapes(layers, width, 65, T)
    ring = bytes_by_axis(Layout("hybrid", dp=2, cp=C), shapes, w, B)["cp"]
    ulysses = bytes_by_axis(Layout("hybrid", dp=2, cp=C, cp_algo="ulysses"), shapes, w, B)["cp"]
    sums = ring - layers * (3 * C - 2) * 2 * (B // 2) * (T // C) * width * w
    assert sums == ulysses - layers * 2 * 4 * (B // 2) * T * width * w * (C - 1) // C**2
    assert sums > sum(shapes.params) * w  # every gradient, and the loss, summed over CP


def test_predict_prices_the_cp_axis(capsys):
    from minidp.cost.predict import main as predict

    args = [*FLAGS, "--strategy", "hybrid", "--dp", "2", "--cp", "2", "--world", "4"]
    assert predict([*args, "--cp-algo", "ulysses"]) == 0
    out = capsys.readouterr().out
    assert "dp 2 x tp 1 x cp 2 (ulysses)" in out and ", cp " in out


BAD = [
    (["--strategy", "hybrid", "--cp", "2", "--model", "mlp"], "--cp is a flag of --model gpt"),
    (["--cp", "2"], "--cp is a flag of --strategy hybrid, not of --strategy dp"),
    (["--strategy", "hybrid", "--cp", "2", "--block-size", "30"],
     "--block-size 30 must divide by 2 x --cp 2 (zig-zag)"),
    (["--strategy", "hybrid", "--cp", "3", "--cp-layout", "contiguous", "--block-size", "32"],
     "--block-size 32 must divide by --cp 3"),
    (["--strategy", "hybrid", "--cp", "8", "--cp-algo", "ulysses"],
     "--cp-algo ulysses: --n-head 4 must divide by --cp 8"),
    (["--strategy", "hybrid", "--tp", "2", "--cp", "4", "--cp-algo", "ulysses"],
     "--n-head 4 must divide by --cp 4 x --tp 2"),
    (["--strategy", "hybrid", "--cp", "2", "--dropout", "0.1"], "--cp 2 with --dropout 0.1"),
    (["--strategy", "hybrid", "--cp", "2"], "--cp 2 does not divide the world's 1 ranks"),
    (["--strategy", "hybrid", "--cp", "2", "--pp", "2", "--zero-stage", "1"],
     "with --zero-stage is not yet"),
    (["--strategy", "hybrid", "--cp", "2", "--zero-stage", "1"], "with --zero-stage is not yet"),
    (["--strategy", "hybrid", "--tp", "2", "--cp", "2", "--sequence-parallel"],
     "with --sequence-parallel is not yet"),
    (["--strategy", "hybrid", "--dp", "1", "--cp-algo", "ulysses"],
     "--cp-algo shapes context parallelism: give --cp C > 1"),
    (["--strategy", "hybrid", "--cp", "0"], "--cp must be >= 1"),
]  # fmt: skip


@pytest.mark.parametrize("args,message", BAD)
def test_bad_cp_flags_are_one_line_and_exit_code_2(args, message, capsys):
    flags = FLAGS if "mlp" not in args else ["--steps", "3", "--batch-size", "4"]
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("minidp: error:") == 1 and message in err, err
    assert "Traceback" not in err


def test_a_mesh_that_does_not_fill_the_world_is_one_line_on_rank_0():
    cmd = ["mpiexec", "-n", "4", sys.executable, "-m", "minidp", *FLAGS,
           "--strategy", "hybrid", "--dp", "2", "--tp", "2", "--cp", "2"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("minidp: error:") == 1
    assert "--cp 2 does not divide" not in result.stderr
    assert "dp x tp x pp x cp = 2 x 2 x 1 x 2 = 8, but the world has 4" in result.stderr
