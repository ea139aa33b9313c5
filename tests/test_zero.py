"""ZeRO stages 1-3 are single-process training, sharded: same per-step losses, and after every
step each rank's shard holds what one process holds for those elements (float64, 1e-10);
memory counted from the arrays matches the paper's formulas to the byte; communication is
DP's (stages 1, 2) or 1.5x it (stage 3). One parallel launch checks dp 2, 3 and 4 on
sub-groups of 4 ranks.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from minidp import comm, nn, optim
from minidp.cli.commands import parse_train_args
from minidp.cli.strategies import DataParallel, ZeRO
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.cli.training.loop import train
from minidp.models.data import DistributedSampler
from minidp.models.tasks import Task
from minidp.parallel.zero.flat import ShardLayout
from minidp.parallel.zero.stages import model_state_bytes
from minidp.tools.chunks import chunk_bounds

STEPS = 3
# batch 10 does not divide by 3 or 4; a tiny bucket cap: many segments, chunk edges in tensors
TINY = dict(
    n_layer=1, n_embd=16, n_head=2, block_size=8, hidden=16, seed=3, batch_size=10,
    bucket_mb=0.002, grad_clip=0.05, lr=0.01, weight_decay=0.1, overlap="on",
    allreduce="ring", dtype="float64",
)  # fmt: skip


def sgd(params):
    return optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=0.01)


def reference(config, make_optimizer):
    """One process on the global batch: losses and, after each step, {name: param}, {name: m}."""
    task = Task(config, np.dtype(config.dtype))
    params = task.model.parameters()
    opt = make_optimizer(params) if make_optimizer else optim.AdamW(
        params, lr=config.lr, weight_decay=config.weight_decay
    )  # fmt: skip
    names = [n for n, _ in task.model.named_parameters()]
    sampler = DistributedSampler(task.num_examples, config.batch_size, seed=config.seed)
    losses, states, moments = [], [], []
    for step in range(STEPS):
        loss = task.loss(*task.batch(sampler.local_indices(step)))
        opt.zero_grad()
        loss.backward()
        optim.clip_grad_norm(params, config.grad_clip)
        opt.step()
        losses.append(loss.item())
        states.append({k: v.copy() for k, v in task.model.state_dict().items()})
        moments.append({n: s.get("m", s.get("velocity")).copy() for n, s in zip(names, opt.state)})
    return losses, states, moments


def zero_run(config, group, make_optimizer=None):
    """Train STEPS steps with ZeRO as the loop drives it; yield (strategy, step, loss)."""
    task = Task(config, np.dtype(config.dtype))
    strategy = ZeRO(task, config, group, make_optimizer=make_optimizer)
    sampler = DistributedSampler(
        task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
    )
    with strategy:
        for step in range(STEPS):
            yield strategy, step, strategy.step(sampler.local_indices(step), config.lr).loss
        strategy.gather_model()  # collective: the whole trained model in task.model
        assert strategy.max_param_diff() == 0.0


def check_equivalence(config, group, make_optimizer=None):
    losses, states, moments = reference(config, make_optimizer)
    for z, step, loss in zero_run(config, group, make_optimizer):
        where = f"{config.model} stage {config.zero_stage} dp {group.size} step {step}"
        np.testing.assert_allclose(loss, losses[step], rtol=1e-10, err_msg=where)
        want = z.layout.shard_of(z.layout.flatten(states[step]))
        np.testing.assert_allclose(z.shard(), want, rtol=1e-10, atol=1e-12, err_msg=where)
        kind = "m" if make_optimizer is None else "velocity"
        mine = np.concatenate([s[kind] for s in z.optimizer.state])
        want_m = z.layout.shard_of(z.layout.flatten(moments[step]))
        np.testing.assert_allclose(mine, want_m, rtol=1e-10, atol=1e-14, err_msg=where)
    for name, p in z.task.model.named_parameters():  # the whole model is back in task.model
        np.testing.assert_allclose(p.data, states[-1][name], rtol=1e-10, atol=1e-12)


def traffic(strategy) -> dict[str, int]:
    return {k: c["bytes_sent"] for k, c in strategy.comm_group.counters.items() if k != "checks"}


def check_memory_and_traffic(group):
    """float32, a GPT of Ψ = 8,835 (odd: N = 2 and 4 do not divide it): model states to
    the byte, and the bytes each collective sent."""
    gpt = dict(dtype="float32", model="gpt", n_layer=2, n_embd=15, n_head=3, block_size=9)
    config = TrainConfig(**{**TINY, **gpt})
    task = Task(config, np.float32)
    psi = task.model.num_parameters()
    assert psi % group.size, "pick a Ψ that does not divide by N"
    n_tensors = len(task.model.parameters())
    local = np.arange(group.rank, 10, group.size)
    with DataParallel(task, config, group) as dp:
        dp.step(local, config.lr)
        want = model_state_bytes(0, psi, 1)
        got = dp.memory_bytes()
        assert got["parameters"] == want["parameters"] == 4 * psi
        assert got["gradients"] == 4 * psi
        assert got["optimizer"] == 8 * psi + 8 * n_tensors  # + AdamW's step counters
        dp_bytes = {k: c["bytes_sent"] for k, c in dp.ddp.comm_group.counters.items()}
    for stage in (1, 2, 3):
        z_config = replace(config, strategy="zero", zero_stage=stage)
        task = Task(z_config, np.float32)
        with ZeRO(task, z_config, group) as z:
            z.step(local, config.lr)
            mine = z.layout.shard_numel  # this rank's Ψ/N
            assert comm.allreduce(np.array([mine]), group=group)[0] == psi
            got = z.memory_bytes()
            want = {
                "parameters": 4 * (mine if stage == 3 else psi),
                "gradients": 4 * (mine if stage >= 2 else psi),
                "optimizer": 8 * mine + 8 * len(z.pieces),
            }
            for category, value in want.items():
                assert got[category] == value, (stage, category, got, want)
            # the paper's formula, exactly, for the ranks together (each holds its Ψ/N)
            formula = sum(model_state_bytes(stage, psi, group.size).values())
            states = sum(want.values()) - 8 * len(z.pieces)  # less the step counters
            total = comm.allreduce(np.array([states]), group=group)[0]
            assert total == round(group.size * formula), (stage, total, formula)
            sent, p, r = traffic(z), group.size, group.rank
            # the ring sends every chunk but one: reduce-scatter all but chunk r, allgather
            # all but chunk r + 1 (ring.py), per segment
            rs = sum(n - (b[r + 1] - b[r]) for n, b in zip(z.layout.lengths, z.layout.bounds))
            ag = sum(
                n - (b[(r + 1) % p + 1] - b[(r + 1) % p])
                for n, b in zip(z.layout.lengths, z.layout.bounds)
            )
            gathers = 1 if stage < 3 else 2  # stage 3: an allgather more, in backward
            assert sent == {"reduce_scatter": 4 * rs, "allgather": 4 * gathers * ag}, sent
            ratio = sum(sent.values()) / dp_bytes["allreduce"]
            if stage < 3:  # exactly DP's ring allreduce, bucket for bucket
                assert sum(sent.values()) == dp_bytes["allreduce"], (sent, dp_bytes)
            else:
                assert ratio == pytest.approx(1.5, rel=0.02), (sent, dp_bytes)
                assert z.gathered.gathers == 2 * len(z.units)
                largest = 4 * max(z.layout.lengths)
                assert got["gathered_peak"] <= 2 * largest < 4 * psi  # two slots, not Ψ
            # resuming: a fresh strategy loaded with this state takes the same next step
            state = z.state_dict()
            z.step(local[::-1], config.lr)
            with ZeRO(Task(z_config, np.float32), z_config, group) as again:
                again.load_state_dict(state)
                again.step(local[::-1], config.lr)
                assert np.array_equal(again.shard(), z.shard()), f"stage {stage} resumed"


@pytest.mark.parallel(nprocs=[4])
@pytest.mark.timeout(600)
def test_zero_stages_match_one_process_and_count_memory_and_bytes():
    world = comm.world()
    for n in (2, 3, 4):
        group = world.subgroup(list(range(n)))
        if group is not None:
            for model in ("mlp", "gpt"):
                for stage in (1, 2, 3):
                    config = TrainConfig(**TINY, model=model, strategy="zero", zero_stage=stage)
                    check_equivalence(config, group)
            config = TrainConfig(**TINY, model="mlp", strategy="zero", zero_stage=1)
            check_equivalence(config, group, make_optimizer=sgd)
            if n in (2, 4):
                check_memory_and_traffic(group)
            group.free()
        world.comm.Barrier()


class WithUnused(nn.Module):
    """The task's MLP beside a layer that its forward never calls."""

    def __init__(self, mlp, dtype):
        self.mlp = mlp
        self.unused = nn.Linear(4, 4, rng=np.random.default_rng(0), dtype=dtype)

    def forward(self, x):
        return self.mlp(x)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(300)
def test_stage_1_leaves_a_parameter_no_backward_reached_as_dp_does():
    """DDP gives it .grad None and the optimizer skips it; stage 1 steps whole chunks (zeros
    there) but puts that part back: not moved, not decayed, and the rest as DP."""
    group, runs = comm.world(), []
    config = TrainConfig(**TINY, model="mlp", strategy="zero", zero_stage=1)
    for Scheme in (DataParallel, ZeRO):
        task = Task(config, np.float64)
        task.model = model = WithUnused(task.model, np.float64)
        before = [p.data.copy() for p in model.unused.parameters()]
        sampler = DistributedSampler(
            task.num_examples, config.batch_size, group.rank, group.size, seed=config.seed
        )
        with Scheme(task, config, group) as strategy:
            for step in range(STEPS):
                strategy.step(sampler.local_indices(step), config.lr)
        runs.append([p.data.copy() for p in model.parameters()])
        for p, was in zip(model.unused.parameters(), before, strict=True):
            assert np.array_equal(p.data, was), Scheme.name
    for dp, zero in zip(*runs, strict=True):
        np.testing.assert_allclose(zero, dp, rtol=1e-10, atol=1e-12)


# ---- serial ------------------------------------------------------------------------------
def test_shards_cover_the_flat_vector_once_with_edges_inside_tensors():
    class P:  # a parameter's size and shape are all a layout reads
        def __init__(self, n):
            self.size, self.shape = n, (n,)

    segments = [[P(7), P(3)], [P(2)], [P(1)]]  # 10, 2, 1 elements: none divides by 4
    names = {id(p): f"p{i}" for i, p in enumerate(q for s in segments for q in s)}
    covered = np.zeros(13, int)
    for rank in range(4):
        layout = ShardLayout(segments, names, 4, rank)
        for lo, hi in layout.ranges():
            covered[lo:hi] += 1
        assert layout.shard_numel == sum(hi - lo for lo, hi in layout.ranges())
    assert (covered == 1).all()
    assert ShardLayout(segments, names, 4, 0).ranges()[0] == (0, 3)  # inside p0 (7 elements)
    assert chunk_bounds(10, 4) == (0, 3, 6, 8, 10)


def test_a_shard_is_copied_from_the_parameters_without_the_whole_flat_vector():
    params = [nn.Parameter(np.arange(n, dtype=np.float64) + 100 * n) for n in (7, 3, 2, 1)]
    segments = [params[:2], params[2:3], params[3:]]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    for rank in range(4):
        layout = ShardLayout(segments, names, 4, rank)
        flat = layout.flatten({f"p{i}": p.data for i, p in enumerate(params)})
        np.testing.assert_array_equal(layout.shard_of_parameters(np.float64), layout.shard_of(flat))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategy", "zero", "--zero-stage", "4"], "--zero-stage 1, 2 or 3"),
        (["--strategy", "zero"], "--zero-stage 1, 2 or 3"),
        (["--zero-stage", "2"], "is a flag of --strategy zero or hybrid, not of --strategy dp"),
    ],
)
def test_bad_zero_flags_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_train_args(args)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_unsupported_combinations_say_which():
    quiet = dict(model="mlp", hidden=8, steps=1, sample_tokens=0, eval_batches=1)
    with pytest.raises(BadConfig, match="--allreduce tree is not one of theirs"):
        train(TrainConfig(strategy="zero", zero_stage=3, allreduce="tree", **quiet))


def test_stage_3_on_one_rank_trains_and_reports_its_memory():
    quiet = dict(model="mlp", hidden=8, steps=2, sample_tokens=0, eval_batches=1, log_every=1)
    final = train(TrainConfig(strategy="zero", zero_stage=3, **quiet))
    assert np.isfinite(final["final_loss"]) and final["memory_bytes"]["gathered_peak"] > 0


# ---- the command line and the benchmark, end to end ---------------------------------------
def minidp(nprocs: int, *args: str) -> subprocess.CompletedProcess:
    cmd = ["mpiexec", "-n", str(nprocs), sys.executable, "-m", "minidp", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


GPT_TINY = ("--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8")


def test_cli_stage_3_never_gathers_the_whole_model_and_evaluates_and_samples_as_dp(tmp_path):
    """Stage 3 leaves the model in shards after training: validation and sampling run
    through the layer-by-layer gathered forward on every rank, equal to DP's whole model;
    the record has each rank's memory by category and the OS's peak RSS."""
    finals, outs = {}, {}
    for name, flags in (("dp", ()), ("zero3", ("--strategy", "zero", "--zero-stage", "3"))):
        path = tmp_path / f"{name}.jsonl"  # 20 steps at a high rate: far from uniform
        args = (*flags, "--steps", "20", "--lr", "0.03", "--dtype", "float64", "--json", str(path))
        result = minidp(2, *args, *GPT_TINY, "--sample-tokens", "12", "--eval-batches", "1")
        assert result.returncode == 0, result.stderr
        finals[name], outs[name] = json.loads(path.read_text().splitlines()[-1]), result.stdout
    final, per_rank = finals["zero3"], finals["zero3"]["memory_bytes_per_rank"]
    assert "memory per rank, MB: parameters" in outs["zero3"], outs["zero3"]
    memory = final["memory_bytes"]  # rank 0's, float64: 8 bytes a parameter of its shard
    assert per_rank["parameters"][0] == memory["parameters"] == 8 * final["shard_elements"]
    assert len(per_rank["parameters"]) == len(final["peak_rss"]) == 2
    assert min(final["peak_rss"]) > 10e6
    for key in ("val_loss", "param_l2"):
        np.testing.assert_allclose(final[key], finals["dp"][key], rtol=1e-10)
    sample = outs["zero3"].split("sample:")[1]  # printed once, the same text as DP's
    assert outs["zero3"].count("sample:") == 1 and sample == outs["dp"].split("sample:")[1]


def test_bench_memory_smoke(tmp_path):
    path, out = tmp_path / "bench.jsonl", tmp_path / "pictures"
    args = ("--iters", "1", "--warmup", "0", "--batch-size", "4", "--json", str(path))
    result = minidp(2, "bench", "memory", *GPT_TINY, *args, "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    memory = [r for r in rows if "formula" in r]
    assert {(r["N"], r["strategy"]) for r in memory} == {
        (n, s) for n in (1, 2) for s in ("dp", "zero1", "zero2", "zero3")
    }
    for r in memory:  # model states within AdamW's step counters and Ψ/N rounding
        assert abs(r["vs_formula"] - 1) < 0.01, r
    timing = {r["strategy"]: r for r in rows if "step_ms" in r}
    assert timing["zero1"]["bytes_vs_dp"] == timing["zero2"]["bytes_vs_dp"] == 1.0
    assert timing["zero3"]["bytes_vs_dp"] == pytest.approx(1.5, rel=0.01)
    assert (out / "memory_per_rank.png").stat().st_size > 0
