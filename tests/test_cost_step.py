"""The step model's exact parts (minidp/cost/step.py): the bytes each rank sends per mesh axis,
against what real runs count, and the model states per rank; `predict`'s output and errors."""

from dataclasses import replace

import numpy as np
import pytest

from minidp import comm, nn
from minidp.cli.commands import main
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.cost.calls import gpt_shapes
from minidp.cost.predicted import in_record
from minidp.cost.step import Compute, Layout, Network, bytes_by_axis, fixed_part, memory, predict
from minidp.models.tasks import Task
from minidp.tools.memory import activation_estimate

TINY = dict(
    n_layer=1, n_embd=16, n_head=4, block_size=8, batch_size=10, bucket_mb=0.002,
    steps=2, log_every=100, eval_batches=1, sample_tokens=0, overlap="on",
)  # fmt: skip
CASES = [  # (ranks, flags): uneven batches (10 over 3 and 4), many buckets, accumulation
    (2, dict(strategy="dp", grad_accum=2)),
    (3, dict(strategy="dp", allreduce="ring", dtype="float64")),
    (3, dict(strategy="zero", zero_stage=1)),
    (4, dict(strategy="zero", zero_stage=2, allreduce="ring")),
    (3, dict(strategy="zero", zero_stage=3, grad_accum=2)),
    (4, dict(strategy="tp", tp=4)),
    (4, dict(strategy="hybrid", dp=2, tp=2)),
    (4, dict(strategy="hybrid", dp=2, tp=2, zero_stage=3)),
    (3, dict(strategy="dp", compress="topk:0.1")),  # each compressor's own wire format
    (4, dict(strategy="dp", compress="qsgd:2", dtype="float64")),
    (2, dict(strategy="dp", compress="fp16")),
    (3, dict(strategy="dp", compress="randomk:0.2", allreduce="ring")),
    (4, dict(strategy="hybrid", dp=2, tp=2, compress="sign")),
    (3, dict(strategy="dp", compress="powersgd:1")),  # its factors follow the shapes
    (4, dict(strategy="hybrid", dp=2, tp=2, compress="powersgd:2")),  # of a TP shard
    (4, dict(strategy="tp", tp=4, sequence_parallel=True)),  # reduce-scatters and allgathers
    (4, dict(strategy="hybrid", dp=2, tp=2, sequence_parallel=True)),
    (4, dict(strategy="hybrid", dp=2, tp=2, sequence_parallel=True, zero_stage=2, grad_accum=2)),
    (4, dict(strategy="hybrid", dp=2, tp=2, sequence_parallel=True, zero_stage=3, grad_accum=2)),
]


def layout_of(config, size: int) -> Layout:
    tp = config.tp or (1 if config.strategy in ("dp", "zero") else size // (config.dp or 1))
    return Layout(
        config.strategy,
        dp=size // tp,
        tp=tp,
        zero_stage=config.zero_stage,
        grad_accum=config.grad_accum,
        algo=config.allreduce,
        bucket_mb=config.bucket_mb,
        compress=config.compress,
        sequence_parallel=config.sequence_parallel,
    )


def real_runs(cases, tiny: dict, tmp_path):
    """Collective over the world: (ranks, flags, group, config, final record) of each case
    trained on the first `ranks` ranks (the ranks outside skip it); a hybrid with --json,
    whose record's prediction is checked beside its measurement on every rank."""
    world = comm.world()
    for ranks, flags in cases:
        group = world.subgroup(list(range(ranks)))
        if group is None:
            continue
        json = str(tmp_path / "run.jsonl") if flags["strategy"] == "hybrid" else None
        config = TrainConfig(**{**tiny, **flags, "json": json})
        final = train(config, group, adds=[in_record])  # as the command line's runs
        if json:  # --json: the prediction beside the measurement, on every rank
            assert final["predicted_bytes_by_axis"] == final["bytes_sent_by_axis"]
            assert final["predicted_step_s"] > 0 and final["measured_step_s"] > 0
        yield ranks, flags, group, config, final


@pytest.mark.parallel(nprocs=[4])
def test_bytes_by_axis_and_model_states_are_what_real_runs_count(tmp_path):
    for ranks, flags, group, config, final in real_runs(CASES, TINY, tmp_path):
        layout = layout_of(config, ranks)
        vocab = Task(config, np.dtype(config.dtype)).model.config.vocab_size
        shapes = gpt_shapes(1, 16, vocab, 8, layout.tp, group.rank % layout.tp)
        itemsize = np.dtype(config.dtype).itemsize
        sent = bytes_by_axis(layout, shapes, itemsize, 10, group.rank)
        counted = {axis: b // config.steps for axis, b in final["bytes_sent_by_axis"].items()}
        assert counted == sent, (ranks, flags)
        states = memory(layout, shapes, itemsize, 0, group.rank)
        held = final["memory_bytes"]
        assert held["parameters"] == states["parameters"], (ranks, flags)
        assert held["gradients"] == states["gradients"], (ranks, flags)
        steps_kept = held["optimizer"] - states["optimizer"]  # AdamW's step count per tensor
        assert 0 < steps_kept <= 8 * len(shapes.params) + 8 * len(shapes.units), (ranks, flags)
        group.free()


def test_more_ranks_send_less_per_rank_with_zero_3_and_step_time_adds_up():
    shapes = gpt_shapes(2, 64, 96, 64)
    compute = Compute(0.01, 0.02, 0.001, examples=16, params=sum(shapes.params))
    net = Network(alpha=2e-6, beta=1e-9, gamma=1e-9)
    p2, p4 = (predict(Layout("zero", dp=n, zero_stage=3), shapes, compute, net, batch_size=16)
              for n in (2, 4))  # fmt: skip
    assert p4.memory_bytes["parameters"] < p2.memory_bytes["parameters"]
    for p in (p2, p4):
        assert p.step_s == pytest.approx(p.compute_s + p.exposed_comm_s)
        assert p.comm_s == p.exposed_comm_s > 0  # stage 3: nothing hidden
    hidden = predict(Layout("dp", dp=2, overlap=True), shapes, compute, net, batch_size=16)
    assert hidden.exposed_comm_s < hidden.comm_s


def test_predict_prints_the_step_bytes_and_memory(capsys, tmp_path):
    path = tmp_path / "p.jsonl"
    args = ["predict", "--strategy", "hybrid", "--dp", "2", "--tp", "2", "--world", "4"]
    with pytest.raises(SystemExit):
        main([*args, "--n-layer", "1", "--calibration", "missing.json"])
    assert "--calibration missing.json: no such file" in capsys.readouterr().err
    assert main([*args, "--n-layer", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("predicted step: hybrid on 4 ranks (dp 2 x tp 2")
    for part in ("α, β, γ: ", "= compute ", "bytes sent per rank per step: dp ", "memory per rank"):
        assert part in out
    assert '"predicted_bytes_by_axis_per_step"' in path.read_text()


def test_a_compressor_s_own_work_is_measured_and_its_decoding_grows_with_p(capsys):
    """predict measures the compressor on a group of one; a gathering one (top-k) decodes
    every rank's payload, so its work grows with p, where the casts' does not."""
    assert main(["predict", "--compress", "topk:0.1", "--world", "2", "--n-layer", "1"]) == 0
    assert ", compressor " in capsys.readouterr().out
    shapes = gpt_shapes(1, 16, 96, 8)
    model = nn.GPT(nn.GPTConfig(vocab_size=96, block_size=8, n_layer=1, n_embd=16), seed=0)
    assert list(shapes.dims) == [p.shape for p in model.parameters()]  # PowerSGD's matrices
    compute = Compute(0.01, 0.02, 0.001, examples=8, params=sum(shapes.params), compress_s=0.003)
    net = Network(alpha=2e-6, beta=1e-9, gamma=1e-9)

    def work(spec, p):
        layout = Layout("dp", dp=p, compress=spec)
        step = predict(layout, shapes, compute, net, batch_size=8)
        expected = 0.01 / p + 0.02 / p + 0.001 + step.compress_s  # forward, backward, AdamW
        assert step.compute_s == pytest.approx(expected)
        return step.compress_s

    assert work("fp16", 2) == work("fp16", 4) == 0.003
    decode = 2 * 4 * sum(shapes.params) * net.gamma  # one more payload: two passes at γ
    assert work("topk:0.01", 4) - work("topk:0.01", 2) == pytest.approx(2 * decode)


def test_a_calibration_that_cannot_be_read_is_refused_by_predict_and_skipped_by_a_run(
    capsys, tmp_path, monkeypatch
):
    """predict names the file; a training run falls back to the built-in defaults: its
    final record is written (a run never fails for its prediction)."""
    from minidp.cost.predict import DEFAULT_NETWORK
    from minidp.cost.predicted import shared_network

    bad = tmp_path / "runs" / "calibration.json"
    bad.parent.mkdir()
    monkeypatch.chdir(tmp_path)
    no_gamma, negative = '{"alpha": 1e-6, "beta": 1e-10}', '{"alpha": -1, "beta": 1, "gamma": 1}'
    bad_delta = '{"alpha": 1e-6, "beta": 1e-10, "gamma": 1e-10, "delta": -1}'
    for text in (no_gamma, negative, bad_delta, "[1"):
        bad.write_text(text)
        with pytest.raises(SystemExit):
            main(["predict", "--world", "2", "--n-layer", "1"])
        assert "runs/calibration.json: " in capsys.readouterr().err
        network = shared_network(comm.world())
        fields = (network.alpha, network.beta, network.gamma, network.delta)
        assert fields == tuple(DEFAULT_NETWORK[k] for k in ("alpha", "beta", "gamma", "delta"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategy", "ps", "--consistency", "ssp", "--world", "3"], "--consistency 'ssp'"),
        (["--world", "-1"], "--world must be a number of ranks >= 1"),
        (["--strategy", "hybrid", "--dp", "3", "--world", "4"], "--world 4: the mesh dp x tp"),
        (["--compress", "sign", "--compress-on", "update", "--world", "2"], "on gradient; got"),
        (["--compress", "topk:abc", "--world", "2"], "--compress 'topk:abc': 'abc' is not a"),
        (["--compress", "foo", "--world", "2"], "unknown compressor 'foo'"),
        (["--compress", "fp16", "--compress-warmup", "3", "--world", "2"], "--compress-warmup"),
        (["--strategy", "hybrid", "--dp", "4", "--sequence-parallel"], "a TP group of more"),
        (["--strategy", "hybrid", "--tp", "2", "--pp", "2", "--sequence-parallel"], "with --pp"),
    ],
)
def test_bad_predict_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["predict", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_part_of_compute_no_split_shortens_stays_whole_under_tp():
    whole = Compute(0.03, 0.05, 0.0, examples=8, params=1)  # t(8) = 0.08 s
    half = Compute(0.02, 0.03, 0.0, examples=4, params=1)  # t(4) = 0.05 s: 0.02 s fixed
    assert fixed_part(whole, half) == pytest.approx(0.25)
    assert fixed_part(whole, whole._replace(examples=4)) == 1.0  # clamped: no shrinking
    shapes = gpt_shapes(1, 16, 96, 8, tp=2)
    compute = whole._replace(fixed=0.25, params=sum(shapes.params))
    p = predict(Layout("tp", tp=2), shapes, compute, Network(1e-6, 1e-9), batch_size=8)
    assert p.forward_s == pytest.approx(0.03 * (0.25 + 0.75 / 2))


def test_sequence_parallelism_moves_g_and_f_bytes_and_splits_the_layer_norms_activations(capsys):
    """An allreduce is a reduce-scatter then an allgather: at p = 2 SP's pairs send what g and
    f send, and the replicated gradients' partial sums add one allreduce; the activations
    outside the parallel regions (5·T·C a layer) split over TP too."""
    assert main(["predict", "--strategy", "tp", "--sequence-parallel", "--world", "2"]) == 0
    assert "(dp 1 x tp 2, sequence parallel" in capsys.readouterr().out
    shapes = gpt_shapes(2, 64, 96, 64, tp=2)
    plain = Layout("tp", tp=2, grad_accum=2)
    sp = plain._replace(sequence_parallel=True)
    summed = 4 * sum(shapes.replicated)  # a ring allreduce at p = 2: half, twice
    sent = {layout: bytes_by_axis(layout, shapes, 4, 16)["tp"] for layout in (plain, sp)}
    assert sent[sp] == sent[plain] + summed
    config = TrainConfig(n_layer=2, n_embd=64, n_head=4, block_size=64, sequence_parallel=True)
    split = activation_estimate(config, 8, tp=2)
    whole = activation_estimate(replace(config, sequence_parallel=False), 8, tp=2)
    assert whole - split == 2 * 8 * (5 * 64 * 64 // 2) * 4  # L, examples, 5 T C / 2, float32
