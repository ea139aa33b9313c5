"""Resume is bit-exact: 2 steps, save, resume in a new strategy object, 2 more steps give the
same logged losses, param_l2 and every array of every rank's state (model, optimizer, the
scheme's own) as 4 uninterrupted steps, in float32, for every strategy, with compression and
pruning; once end to end through the command line in new processes. Then the refusals, one
line each, and resharding over another number of ranks, equal to one process in float64."""

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_checkpoint import remove, shared_directory  # a directory every rank names

from minidp import comm
from minidp.cli.commands import main
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.cli.training.loop import train
from minidp.parallel import checkpoint
from minidp.parallel.checkpoint.shards import parse, shard_name

TINY = dict(
    n_layer=2, n_embd=16, n_head=2, block_size=8, batch_size=8, steps=4, log_every=1,
    eval_batches=1, sample_tokens=0, bucket_mb=0.002,
)  # fmt: skip
SMALL = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "8",
         "--batch-size", "8", "--eval-batches", "1", "--sample-tokens", "0"]  # fmt: skip
PRUNE = dict(prune=0.5, prune_start=1, prune_end=3, prune_every=1)


def losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "step" in r}


def shards_equal(a: str, b: str, rank: int, what: str) -> None:
    name = shard_name(rank)
    with open(os.path.join(a, name), "rb") as x, open(os.path.join(b, name), "rb") as y:
        x, y = parse(bytearray(x.read()))[0], parse(bytearray(y.read()))[0]
    assert list(x) == list(y), what
    for key in x:
        assert np.array_equal(x[key], y[key], equal_nan=True), f"{what}: {key}"


def check_resumes_bit_exact(group, what: str, **flags) -> None:
    """4 steps saving at 2 and 4; then 2 steps resumed from step 2 in new objects."""
    root = shared_directory(group)
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    whole = train(TrainConfig(**TINY, **flags, save_dir=a, save_every=2, json=a + ".json"), group)
    resumed = TrainConfig(**TINY, **flags, save_dir=b, resume=a, json=b + ".json")
    if group.rank == 0:  # the newest made incomplete: skipped, said once (by rank 0)
        os.rename(f"{a}/step_000004/{checkpoint.MANIFEST}", f"{a}/step_000004/gone")
    comm.barrier(group=group)
    with contextlib.redirect_stderr(io.StringIO()) as said:
        again = train(resumed, group)
    skipped = "step_000004 has no manifest.json (an unfinished save): skipped"
    assert (skipped in said.getvalue()) == (group.rank == 0), said.getvalue()
    assert again["param_l2"] == whole["param_l2"], what
    assert again["final_loss"] == whole["final_loss"], what
    for counted in ("bytes_sent_per_rank", "bytes_sent_by_axis", "skipped_steps"):
        assert again[counted] == whole[counted], f"{what}: {counted}"  # carried over
    if group.rank == 0:
        want = losses(a + ".json")
        assert losses(b + ".json") == {2: want[2], 3: want[3]}, what
    shards_equal(f"{a}/step_000004", f"{b}/step_000004", group.rank, what)
    remove(root, group)


CASES_2 = {
    "dp": {},
    "dp topk error feedback": dict(compress="topk:0.1"),
    "dp powersgd factors": dict(compress="powersgd:1"),
    "dp pruning": PRUNE,
    "dp dropout": dict(dropout=0.1),
    "zero 1": dict(strategy="zero", zero_stage=1),
    "zero 2": dict(strategy="zero", zero_stage=2),
    "zero 3": dict(strategy="zero", zero_stage=3),
    "tp dropout": dict(strategy="tp", dropout=0.1),
    "pp": dict(strategy="pp"),
}


@pytest.mark.timeout(300)
@pytest.mark.parallel(nprocs=[2])
def test_resume_is_bit_exact_over_2_ranks():
    for what, flags in CASES_2.items():
        check_resumes_bit_exact(comm.world(), what, **flags)


CASES_4 = {
    "ps bsp": dict(strategy="ps", consistency="bsp", servers=2),
    "hybrid dp x tp": dict(strategy="hybrid", dp=2, tp=2),
    "hybrid dp x tp zero 2": dict(strategy="hybrid", dp=2, tp=2, zero_stage=2),
    "hybrid dp x pp": dict(strategy="hybrid", dp=2, pp=2),
}


@pytest.mark.timeout(300)
@pytest.mark.parallel(nprocs=[4])
def test_resume_is_bit_exact_over_4_ranks():
    for what, flags in CASES_4.items():
        check_resumes_bit_exact(comm.world(), what, **flags)


def test_resume_through_the_command_line_in_new_processes(tmp_path):
    """`--steps 4 --save-every 2 --json A`, then `--steps 4 --resume DIR/step_000002 --json
    B`: the losses of steps 2, 3 and the final param_l2 bit for bit."""

    def run(*args):
        command = ["mpiexec", "-n", "2", sys.executable, "-m", "minidp", *SMALL, "--steps", "4"]
        done = subprocess.run(
            [*command, "--log-every", "1", *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in open(args[-1])]

    a = run("--save-dir", str(tmp_path), "--save-every", "2", "--json", str(tmp_path / "A"))
    b = run("--resume", str(tmp_path / "step_000002"), "--json", str(tmp_path / "B"))
    assert [r["loss"] for r in b[:2]] == [r["loss"] for r in a[2:4]]
    assert b[-1]["param_l2"] == a[-1]["param_l2"]


def refused(argv: list[str], words: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--steps", "2", *SMALL, *argv])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err


def test_a_checkpoint_that_cannot_resume_this_run_is_refused_in_one_line(tmp_path, capsys):
    main(["--steps", "4", *SMALL, "--save-dir", str(tmp_path), "--save-every", "2"])
    path, steps = tmp_path / "step_000002", ["--steps", "4"]
    refused(["--resume", str(path), *steps, "--n-embd", "32"], "--n-embd 16", capsys)
    refused(["--resume", str(path), *steps, "--strategy", "zero", "--zero-stage", "1"],
            "saved as --strategy dp over 1 ranks, this is --strategy zero", capsys)  # fmt: skip
    # the flags that make another run from the saved step on, the learning rate first
    another = "saved with --lr 0.003, this run has 0.01: another run from step 2 on"
    refused(["--resume", str(path), *steps, "--lr", "0.01"], another, capsys)
    refused(["--resume", str(path), "--steps", "6"], "saved with --steps 4, this run has 6", capsys)
    refused(["--resume", str(path), *steps, "--optimizer", "sgd"],
            "saved with --optimizer adamw, this run has sgd", capsys)  # fmt: skip
    last = str(tmp_path / "step_000004")
    refused(["--resume", last, *steps], "at step 4, --steps 4 leaves nothing", capsys)
    shard = path / "shard_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    refused(["--resume", str(path), *steps], f"{shard} is truncated or grown", capsys)
    (path / checkpoint.MANIFEST).unlink()
    (tmp_path / "step_000004" / checkpoint.MANIFEST).unlink()
    with pytest.raises(SystemExit):
        main([*SMALL, "--resume", str(tmp_path), *steps])
    err = capsys.readouterr().err.splitlines()  # each skipped save said once, then the refusal
    assert len(err) == 3 and "has no manifest.json" in err[-1], err
    assert err[0].endswith("step_000004 has no manifest.json (an unfinished save): skipped")
    refused(["--save-every", "2"], "--save-every needs --save-dir", capsys)


RESHARD = dict(TINY, dtype="float64", n_head=4, n_layer=1)
RESHARD_CASES = [
    *[(n1, n2, {}) for n1, n2 in ((2, 4), (4, 2), (4, 1))],
    *[
        (n1, n2, dict(strategy="zero", zero_stage=stage))
        for stage in (1, 2, 3)
        for n1, n2 in ((2, 4), (4, 2), (4, 1))
    ],
    *[(n1, n2, dict(strategy="tp")) for n1, n2 in ((2, 1), (1, 2), (2, 4))],
    (4, 4, dict(strategy="hybrid", dp=2, tp=2, then=dict(dp=1, tp=4))),
    (4, 2, dict(strategy="hybrid", dp=2, tp=2, zero_stage=1, then=dict(dp=1))),
]


def first(n: int, world):
    """The first n ranks of the world as a group (None on the others)."""
    return world.split(0 if world.rank < n else None)


@pytest.mark.timeout(300)
@pytest.mark.parallel(nprocs=[4])
def test_a_checkpoint_reshards_onto_another_number_of_ranks_like_one_process():
    """Saved at step 2 over n1 ranks, resumed over n2: the losses of steps 2, 3 and the
    final param_l2 equal one process's 4 steps in float64 (1e-10); ZeRO's shards and the TP
    slices cut anew, padding never saved. Then a layout that cannot reshard, refused."""
    world = comm.world()
    solo = world.split(world.rank)
    root = shared_directory(world)
    want = train(TrainConfig(**RESHARD, json=f"{root}/solo{world.rank}.json"), solo)
    want_losses = losses(f"{root}/solo{world.rank}.json")
    for case, (n1, n2, flags) in enumerate(RESHARD_CASES):
        flags = dict(flags)
        then = flags.pop("then", {})
        what, path = f"{flags} {n1} -> {n2} ranks {then}", f"{root}/case{case}"
        if (saver := first(n1, world)) is not None:
            train(TrainConfig(**RESHARD, **flags, save_dir=path, save_every=2), saver)
        if (loader := first(n2, world)) is not None:
            resume = f"{path}/step_000002"
            config = TrainConfig(**RESHARD, **flags | then, resume=resume, json=path + ".json")
            got = train(config, loader)
            assert abs(got["param_l2"] / want["param_l2"] - 1) < 1e-10, what
            if loader.rank == 0:
                for step, loss in losses(path + ".json").items():
                    assert abs(loss / want_losses[step] - 1) < 1e-10, f"{what} step {step}"
        comm.barrier(group=world)
    path = f"{root}/topk"
    if (saver := first(2, world)) is not None:
        train(TrainConfig(**RESHARD, compress="topk:0.1", save_dir=path, save_every=2), saver)
    with pytest.raises(BadConfig) as error:
        train(TrainConfig(**RESHARD, compress="topk:0.1", resume=f"{path}/step_000002"), world)
    assert (
        "strategy/compressor/residuals/0 saved over --strategy dp over 2 ranks (--compress "
        "topk:0.1, --compress-on gradient) is each rank's own state (not a slice of one "
        "tensor): it loads only in that layout, not over --strategy dp over 4 ranks"
        in str(error.value)
    ), str(error.value)
    remove(root, world)
