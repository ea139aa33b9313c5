"""Tensor parallelism and DP x TP train like one process (one launch of 4 ranks): float64,
AdamW, clipping on; the same per-step losses, gradients and final parameters (1e-10
relative) for (dp, tp) in (1, 2), (1, 4), (2, 2), sequence parallelism off and on;
replicated parameters bit for bit the same on every rank after every step. Then the mesh,
the command line and its bad input."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidp import comm
from minidp.cli.commands import main
from minidp.cli.strategies import STRATEGIES, DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.parallel import Mesh
from minidp.tools.memory import nbytes

STEPS = 3
TINY = dict(
    n_layer=2, n_embd=16, n_head=4, block_size=8, batch_size=4, seed=3, dtype="float64",
    grad_clip=0.05, bucket_mb=0.002, overlap="off", eval_batches=1, sample_tokens=0,
)  # fmt: skip


def run(strategy, each_step):
    sampler = DistributedSampler(
        strategy.task.num_examples, strategy.config.batch_size, *strategy.data_shard, seed=3
    )
    losses = []
    for step in range(STEPS):
        losses.append(strategy.step(sampler.local_indices(step), 1e-2).loss)
        each_step(step)
    return losses


def reference(config):
    """One process: DataParallel over a group of one, the loop's own scheme."""
    solo = comm.world().split(comm.world().rank)
    grads = []
    with DataParallel(Task(config, np.float64), config, solo) as strategy:
        model = strategy.task.model

        def keep(step):
            grads.append({n: p.grad.copy() for n, p in model.named_parameters()})

        losses = run(strategy, keep)
    solo.free()
    return losses, grads, model.state_dict()


def assert_close(got: dict, want: dict, what: str):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(
            got[name], want[name], rtol=1e-10, atol=1e-13, err_msg=what + name
        )


def replicated_digest(strategy) -> str:
    return hashlib.sha256(b"".join(p.data.tobytes() for p in strategy.replicated)).hexdigest()


def check_the_mesh(world):
    """The grid, its groups, the pipeline neighbours, the error that names the numbers."""
    mesh = Mesh(dp=2, tp=2, group=world)  # grid [[0 1] [2 3]]
    d, t = divmod(world.rank, 2)
    assert mesh.coords == {"dp": d, "pp": 0, "cp": 0, "tp": t}
    assert mesh.tp_group.world_ranks == (2 * d, 2 * d + 1) and mesh.tp_group.rank == t
    assert mesh.dp_group.world_ranks == (t, t + 2) and mesh.dp_group.rank == d
    assert mesh.pp_group.size == 1 and mesh.pp_prev is None and mesh.pp_next is None
    assert "tp groups {0,1} {2,3} | dp groups {0,2} {1,3}" in mesh.describe()
    mesh.close()
    mesh = Mesh(dp=1, tp=2, pp=2, group=world)  # grid (1, 2, 2): stages {0, 2} and {1, 3}
    p = world.rank // 2
    assert mesh.pp_group.world_ranks == (world.rank % 2, world.rank % 2 + 2)
    assert (mesh.pp_prev, mesh.pp_next) == ((None, 1) if p == 0 else (0, None))
    mesh.close()
    with pytest.raises(ValueError, match=r"dp x tp x pp = 3 x 1 x 1 = 3, but group has 4 ranks"):
        Mesh(dp=3, group=world)
    with pytest.raises(ValueError, match=r"^dp must be a positive integer, got 0$"):
        Mesh(dp=0, tp=4, group=world)


@pytest.mark.parallel(nprocs=[4])
@pytest.mark.timeout(240)
def test_tp_and_hybrid_train_like_one_process():
    """One launch: the mesh, then every layout against one process."""
    world = comm.world()
    check_the_mesh(world)
    want_losses, want_grads, want_params = reference(TrainConfig(**TINY))
    halves = world.split(world.rank // 2)  # two groups of two ranks: (dp, tp) = (1, 2)
    layouts = [
        (halves, dict(strategy="tp", tp=2)),
        (world, dict(strategy="tp", tp=4)),
        (world, dict(strategy="hybrid", dp=2, tp=2, grad_accum=2)),
    ]
    for group, flags in layouts:
        for sp in (False, True):
            config = TrainConfig(**{**TINY, **flags, "sequence_parallel": sp})
            what = f"{flags} sp={sp}: "
            with STRATEGIES[config.strategy](Task(config, np.float64), config, group) as s:

                def check(step, s=s, group=group, what=what):
                    assert_close(s.model.gather_whole("grad"), want_grads[step], f"{what}{step} ")
                    digests = group.comm.allgather(replicated_digest(s))
                    assert len(set(digests)) == 1, f"{what}replicas differ after step {step}"

                losses = run(s, check)
                np.testing.assert_allclose(losses, want_losses, rtol=1e-10, err_msg=what)
                whole = nbytes(p.data for p in s.task.model.parameters())
                assert whole == 8 * len(want_params), f"{what}the whole model was not released"
                s.gather_model()
                assert_close(s.task.model.state_dict(), want_params, what)
                assert s.max_param_diff() == 0.0
                l2 = np.sqrt(sum(float(np.vdot(a, a)) for a in want_params.values()))
                assert s.param_l2() == pytest.approx(l2, rel=1e-12)
                assert set(s.bytes_sent_by_axis()) == {"dp", "tp", "pp", "cp"}
                if config.strategy == "hybrid" and sp:  # resuming from this rank's state
                    state = s.state_dict()  # its shard and the shard's AdamW moments
                    with STRATEGIES["hybrid"](Task(config, np.float64), config, group) as again:
                        again.load_state_dict(state)
                        assert again.param_l2() == s.param_l2()
                        assert again.step(np.arange(2), 1e-2) == s.step(np.arange(2), 1e-2)
                        assert again.param_l2() == s.param_l2()  # the moments came too
    halves.free()


SMALL = ["--steps", "3", "--log-every", "1", "--n-layer", "1", "--n-embd", "16",
         "--block-size", "8", "--batch-size", "4", "--eval-batches", "1",
         "--sample-tokens", "10", "--dtype", "float64"]  # fmt: skip


@pytest.mark.timeout(240)
def test_the_command_line_reports_the_mesh_bytes_by_axis_and_memory(tmp_path):
    path = tmp_path / "hybrid.json"
    cmd = ["mpiexec", "-n", "4", sys.executable, "-m", "minidp", *SMALL, "--strategy", "hybrid",
           "--dp", "2", "--tp", "2", "--sequence-parallel", "--json", str(path)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert "tp groups {0,1} {2,3} | dp groups {0,2} {1,3}" in result.stdout
    assert result.stdout.count("minidp train |") == 1 and "sample:" in result.stdout
    final = [json.loads(line) for line in open(path)][-1]
    assert final["mesh"] == {"dp": 2, "tp": 2, "pp": 1, "cp": 1} and final["sequence_parallel"]
    by_axis = final["bytes_sent_by_axis"]
    assert set(by_axis) == {"dp", "tp", "pp", "cp", "ep"} and by_axis["tp"] > 0
    assert by_axis["dp"] > 0 and by_axis["pp"] == 0
    assert min(final["memory_bytes"].values()) > 0
    config = TrainConfig(
        n_layer=1, n_embd=16, block_size=8, batch_size=4, steps=3, log_every=1,
        eval_batches=1, sample_tokens=0, dtype="float64",
    )  # fmt: skip
    solo = comm.world().split(0)
    one = train(config, solo)  # the same run on one process
    assert final["final_loss"] == pytest.approx(one["final_loss"], rel=1e-10)
    assert final["val_loss"] == pytest.approx(one["val_loss"], rel=1e-10)  # the gathered model
    assert final["param_l2"] == pytest.approx(one["param_l2"], rel=1e-10)


BAD = [
    (["--strategy", "tp", "--tp", "3"], "--tp 3 must divide --n-head (4)"),
    (["--strategy", "hybrid", "--dp", "2", "--tp", "2"], "dp x tp x pp = 2 x 2 x 1 = 4"),
    (["--strategy", "tp", "--tp", "1", "--sequence-parallel"], "--sequence-parallel needs"),
    (["--strategy", "tp", "--sequence-parallel"], "--sequence-parallel needs a TP group"),
    (["--tp", "2"], "--tp is a flag of --strategy tp or hybrid, not of --strategy dp"),
    (["--strategy", "tp", "--dp", "2"], "--dp is a flag of --strategy hybrid"),
    (["--strategy", "hybrid"], "--strategy hybrid needs --dp or --tp"),
    (["--strategy", "tp", "--model", "mlp"], "splits the GPT"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_mesh_or_tp_flags_are_one_line_and_exit_code_2(args, message, capsys):
    small = SMALL if "mlp" not in args else ["--steps", "3", "--batch-size", "4"]  # no GPT flags
    with pytest.raises(SystemExit) as exit_info:
        main([*small, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("minidp: error:") == 1 and message in err, err
    assert "Traceback" not in err


def test_a_bad_mesh_under_mpiexec_is_one_line_on_rank_0():
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "minidp", *SMALL,
           "--strategy", "hybrid", "--dp", "3", "--tp", "1"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert (
        result.stderr.count("minidp: error:") == 1 and "= 3, but the world has 2" in result.stderr
    )


@pytest.mark.timeout(120)
def test_bench_tp_smoke(tmp_path):
    out = tmp_path / "bench.json"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "minidp", "bench", "tp", "--n-embd", "16",
           "--n-head", "2", "--n-layer", "1", "--block-size", "8", "--batch-size", "4",
           "--iters", "1", "--warmup", "0", "--json", str(out), "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in open(out)]
    assert [r["contender"] for r in rows] == ["dp2 tp1", "dp1 tp2", "dp1 tp2 sp"]
    for r in rows[1:]:  # the formula counts the blocks' and the ends' traffic; the loss adds
        assert r["formula_MB"] <= r["tp_MB_per_step"] < 1.2 * r["formula_MB"]
    assert rows[1]["params_MB"] < rows[0]["params_MB"]  # the shards
    assert rows[2]["act_KB_per_seq"] < rows[1]["act_KB_per_seq"]  # sequence parallelism
