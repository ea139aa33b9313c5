"""`python -m minidp simulate`: its figures are minidp.cost's, exactly (no timing here).

crossover     each cell is cost.time's, the winner its argmin, auto cost.resolve's
reconciled    at P = 2 and 4 the simulator's step and timeline end at step.predict's step
ZeRO          the bytes are cost.sent's
trace         the file has trace.Timeline.save's fields
flags         a bad one is one line and exit code 2
"""

import json
import math

import pytest

from minidp import cost
from minidp.cost import chrome, scale
from minidp.cost.simulate import main
from minidp.cost.step import Layout, Network, memory, predict

NET = Network(alpha=5e-6, beta=1 / 25e9, gamma=1 / 100e9)
SMALL = scale.GPT(layers=2, hidden=256, heads=2, vocab=512, seq=2048)  # Ψ ≈ 1.8M
COMPUTE = scale.flops_compute(SMALL, 1, 1e12, 1e11)


@pytest.mark.parametrize("p", [2, 3, 8, 1000, 1024])
@pytest.mark.parametrize("nbytes", [1024, 256 * 1024, 1 << 30])
def test_crossover_cells_are_cost_time(p, nbytes):
    (row,) = scale.crossover([p], [nbytes], NET)
    for algo, seconds in row["times"].items():
        expected = cost.time(
            "allreduce", algo, p, nbytes // 4, 4, alpha=5e-6, beta=1 / 25e9, gamma=1 / 100e9
        )
        assert seconds == expected
    assert set(row["times"]) == {"ring", "recursive_doubling", "rabenseifner", "tree", "naive"}
    assert row["winner"] == min(row["times"], key=row["times"].get)
    assert row["auto"] == cost.resolve("allreduce", "auto", p, nbytes)
    assert row["auto_slowdown"] == row["times"][row["auto"]] / row["times"][row["winner"]]


LAYOUTS = [
    Layout("dp", dp=2, overlap=True, bucket_mb=1, shm=False),
    Layout("dp", dp=4, bucket_mb=1, shm=False),
    Layout("zero", dp=4, zero_stage=1, overlap=True, bucket_mb=1, shm=False),
    Layout("zero", dp=2, zero_stage=2, overlap=True, bucket_mb=1, shm=False),
    Layout("zero", dp=4, zero_stage=3, bucket_mb=1, shm=False),
    Layout("tp", tp=2),
    Layout("hybrid", dp=2, tp=2, overlap=True, bucket_mb=1, shm=False),
]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda l: f"{l.strategy}{l.zero_stage}-{l.dp}x{l.tp}"
)
def test_the_timeline_ends_at_the_step_models_step(layout):
    """Reconciled: the simulated timeline is step.predict's step laid out in time."""
    shapes, batch = SMALL.shapes(layout.tp), COMPUTE.examples * layout.dp
    spans = chrome.step_spans(layout, shapes, COMPUTE, NET, batch_size=batch)
    expected = predict(layout, shapes, COMPUTE, NET, batch_size=batch)
    assert chrome.step_length(spans) == pytest.approx(expected.step_s, rel=1e-12)
    waited = sum(s.end - s.start for s in spans if s.track == "compute" and "wait" in s.name)
    assert waited <= expected.exposed_comm_s * (1 + 1e-12)
    assert all(s.end >= s.start >= 0 for s in spans)


@pytest.mark.parametrize("p", [2, 4])
def test_scaling_rows_are_the_step_models(p):
    (row,) = scale.scaling([p], SMALL, COMPUTE, NET, bucket_mb=1)
    for key, overlap, algo in (
        ("serial", False, "auto"),
        ("overlap", True, "auto"),
        ("best", True, row["best_algo"]),
    ):
        layout = Layout("dp", dp=p, overlap=overlap, algo=algo, bucket_mb=1, shm=False)
        expected = predict(layout, SMALL.shapes(), COMPUTE, NET, batch_size=p)
        assert row[key] == expected.step_s
        assert row[key + "_efficiency"] == expected.compute_s / expected.step_s
    assert row["best"] <= row["overlap"]  # auto is one of the algorithms tried


@pytest.mark.parametrize("p", [2, 4])
def test_memory_rows_are_the_step_models(p):
    rows = {r["scheme"]: r for r in scale.memory_table(SMALL, p, 1, tp=2, pp=2)}
    acts = scale.activations(SMALL, 1)
    for stage, name in enumerate(("dp", "zero-1", "zero-2", "zero-3")):
        layout = Layout("zero" if stage else "dp", dp=p, zero_stage=stage, bucket_mb=25.0)
        expected = memory(layout, SMALL.shapes(), 4, acts)
        assert {k: rows[name][k] for k in expected} == expected


@pytest.mark.parametrize("p", [2, 3, 4, 7])
def test_zero_traffic_is_cost_sent(p):
    n = 1000
    rows = {r["scheme"]: r for r in scale.zero_traffic(p, n)}
    ring = cost.sent("allreduce", "ring", p, 0, n, 4)
    rs = cost.sent("reduce_scatter", "ring", p, 0, n, 4)
    ag = cost.sent("allgather", "ring", p, 0, n, 4)
    assert (rows["dp"]["messages"], rows["dp"]["bytes"]) == ring
    assert rows["zero-1"]["bytes"] == rows["zero-2"]["bytes"] == rs.bytes + ag.bytes
    assert rows["zero-3"]["bytes"] == rs.bytes + 2 * ag.bytes
    if n % p == 0:
        assert rows["zero-3"]["vs_dp"] == 1.5


def test_breakeven_without_overlap_is_where_the_times_meet():
    n, p = 10**8, 8
    row = scale.breakeven("randomk", 0.01, n, p, NET, 1e11)
    a0, b0 = scale.exchange_terms("none", None, n, p, NET)
    a1, b1 = scale.exchange_terms("randomk", 0.01, n, p, NET)
    bw = row["bandwidth"]
    assert a0 + b0 / bw == pytest.approx(a1 + row["work_s"] + b1 / bw, rel=1e-9)
    assert scale.breakeven("topk", 0.01, n, 1024, NET, 1e11)["bandwidth"] == 0.0  # more bytes


def test_powersgd_breakeven_prices_its_factors_by_the_matrices_shapes():
    """PowerSGD's bytes follow the shapes: its three allreduces (P, Q, the rest) priced as
    any allreduce; without the shapes it is refused rather than guessed."""
    model = scale.gpt_of(1.3e9)
    dims, n, p = model.shapes().dims, model.params, 64
    a1, b1 = scale.exchange_terms("powersgd", 2, n, p, NET, dims)
    factored = [(d[0], math.prod(d) // d[0]) for d in dims if len(d) == 2]
    factored = [(r, c) for r, c in factored if (r + c) * 2 < r * c]
    plain = n - sum(r * c for r, c in factored)
    parts = (sum(2 * r for r, _ in factored), sum(2 * c for _, c in factored), plain)
    expected = sum(scale.exchange_terms("none", None, k, p, NET)[1] for k in parts)
    assert b1 == pytest.approx(expected)
    assert scale.exchange_terms("none", None, n, p, NET)[1] / b1 > 100  # hundreds of times
    assert scale.breakeven("powersgd", 2, n, p, NET, 1e11, dims=dims)["bandwidth"] > 0
    with pytest.raises(ValueError, match="needs the tensors' shapes"):
        scale.exchange_terms("powersgd", 2, n, p, NET)


def test_the_trace_has_the_training_traces_fields(tmp_path):
    from minidp.comm.trace import TRACKS, Timeline

    measured = Timeline()
    measured.add("forward", "compute", measured.t0, measured.t0 + 1.0)
    fields = set(measured.events[0]) | {"pid"}  # Timeline.save adds the rank as pid
    path = tmp_path / "sim.json"
    layout = Layout("dp", dp=4, overlap=True, bucket_mb=1, shm=False)
    spans = chrome.step_spans(layout, SMALL.shapes(), COMPUTE, NET, batch_size=4)
    chrome.write_trace(str(path), spans, ranks=4)
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(set(e) == fields for e in spans)
    assert {e["tid"] for e in spans} <= set(TRACKS.values())
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    names = {e["name"] for e in spans}
    assert {"forward", "backward", "optimizer", "allreduce bucket 0"} <= names
    meta = [e for e in events if e["ph"] == "M"]
    assert {e["name"] for e in meta} == {"process_name", "thread_name"}


def test_the_command_runs(tmp_path, capsys):
    record = tmp_path / "sim.json"
    argv = ["--nprocs", "64", "--json", str(record), "--trace", str(tmp_path / "t.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for title in ("allreduce", "data parallelism", "compression", "ZeRO", "pipeline", "memory"):
        assert f"## {title}" in out
    saved = json.loads(record.read_text())
    assert saved["zero"][3]["vs_dp"] == pytest.approx(1.5, rel=1e-6)
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--nprocs", "0"], "--nprocs must be a positive integer"),
        (["--bandwidth-gbs", "-1"], "--bandwidth-gbs must be positive"),
        (["--tokens-per-rank", "1000"], "--tokens-per-rank must be a multiple"),
        (["--strategy", "hybrid", "--tp", "3"], "--tp 3 must divide --nprocs 1024"),
        (["--calibration", "/no/such/file.json"], "--calibration /no/such/file.json"),
        (["--nprocs", "many"], "--nprocs"),
    ],
)
def test_a_bad_flag_is_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err
