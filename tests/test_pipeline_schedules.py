"""Pipeline schedules as checked data (minidp/parallel/pipeline/): every schedule over a
matrix of (pp, micro-batches, V) is built, lowered, validated and dry-run; hand-made broken
schedules are refused naming the rank and the step; the simulated bubble equals the
formulas where they are exact; the command line. Serial and fast: no MPI, no arrays."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minidp.cli.commands import main
from minidp.cost.schedule import schedule_flags
from minidp.parallel.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
)
from minidp.parallel.pipeline.dry_run import Deadlock, dry_run
from minidp.parallel.pipeline.lowering import add_send_recv, needs
from minidp.parallel.pipeline.schedules import SCHEDULES, build_schedule
from minidp.parallel.pipeline.simulate import (
    bubble_table,
    formula_bubble,
    formula_holds,
    formula_peak_first_rank,
    peak_activations_per_rank,
    simulate,
    summary,
)
from minidp.parallel.pipeline.validate import validate

ROOT = Path(__file__).parent.parent
CASES = [  # (pp, micro-batches, V): V is used by the interleaved schedule only
    (1, 3, 2),
    (2, 1, 2),
    (2, 2, 1),
    (2, 4, 2),
    (3, 5, 1),
    (3, 5, 2),
    (4, 2, 2),
    (4, 8, 1),
    (4, 10, 2),
    (4, 8, 3),
    (5, 7, 3),
    (8, 16, 2),
    (8, 32, 4),
]


def schedule_cases():
    seen = set()
    for name in SCHEDULES:
        for pp, m, V in CASES:
            V = V if SCHEDULES[name].needs_virtual else 1
            if (name, pp, m, V) not in seen:
                seen.add((name, pp, m, V))
                yield pytest.param(name, pp, m, V, id=f"{name}-pp{pp}-m{m}-V{V}")


@pytest.mark.parametrize("name, pp, m, V", list(schedule_cases()))
def test_every_schedule_lowers_validates_and_runs(name, pp, m, V):
    schedule = build_schedule(name, pp, m, V)
    compute = schedule.compute_actions()
    lowered = schedule.actions()  # validated and dry-run inside
    assert dry_run(lowered, pp) >= 1
    for rank in range(pp):  # lowering only adds messages, in the compute order
        assert [a for a in lowered[rank] if a.is_compute] == compute[rank]
    kinds = [a.kind for row in lowered for a in row]
    assert kinds.count(SEND_F) == kinds.count(RECV_F) and kinds.count(SEND_B) == kinds.count(RECV_B)
    per_stage = 3 if schedule.split_backward else 2  # F, B (and W) per micro-batch
    assert sum(a.is_compute for row in lowered for a in row) == per_stage * m * pp * V
    timeline = simulate(lowered, pp, schedule.num_stages, schedule.split_backward)
    assert timeline.length >= 2 * m * V  # a rank's own work
    assert 0 <= timeline.bubble_fraction < 1
    peaks = timeline.peak_activations
    if name == "gpipe":
        assert all(n == m for n in peaks.values())
    if name == "1f1b":  # Narayanan et al.: stage s holds at most pp - s
        assert peaks == {s: min(m, pp - s) for s in range(pp)}
    if name == "zb-h1":  # W deferred, yet no stage holds more than 1F1B's peak, pp
        assert peaks == {s: min(m, pp) for s in range(pp)}
    per_rank = summary(schedule)["peak_activations_per_rank"]
    for rank in range(pp):  # a rank's stages together: at most the sum of their peaks
        assert per_rank[rank] <= sum(peaks[s] for s in schedule.stages_of(rank))
        if V == 1:
            assert per_rank[rank] == peaks[rank]


def test_a_ranks_stages_peak_at_different_times():
    """Interleaved p=2 m=4 V=2: rank 0's stages 0 and 2 peak at 4 and 2, but hold at most 5
    together: they peak at different times, not at once."""
    got = summary(build_schedule("interleaved", 2, 4, 2))
    assert got["peak_activations_per_stage"] == {0: 4, 1: 3, 2: 2, 3: 1}
    assert got["peak_activations_per_rank"] == [5, 3]


@pytest.mark.parametrize("name", SCHEDULES)
def test_simulated_bubble_equals_the_formula_where_it_is_exact(name):
    checked = 0
    for pp in (1, 2, 3, 4, 8):
        for m in (1, 2, 4, 8, 16):
            for V in (1, 2, 3, 4) if SCHEDULES[name].needs_virtual else (1,):
                if not formula_holds(name, pp, m):
                    continue
                schedule = build_schedule(name, pp, m, V)
                timeline = simulate(
                    schedule.compute_actions(), pp, schedule.num_stages, schedule.split_backward
                )
                assert timeline.bubble_fraction == pytest.approx(
                    formula_bubble(name, pp, m, V), abs=1e-12
                ), (pp, m, V)
                checked += 1
    assert checked >= 15


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_first_ranks_peak_activations_equal_the_formula(name):
    """Rank 0 holds the most, as the formula says: interleaved p (1 + (p-1)/(pV)) full-size
    stages, V p + p - 1 of the simulator's stages (1/V of a rank), when pp divides m; else at
    least as many (p 3, m 8, V 2: rounds of g = 4, 9 against 8); no other rank holds more."""
    checked = 0
    for pp in (1, 2, 3, 4, 8):
        for m in (1, 2, 3, 4, 8, 12, 16):
            for V in (1, 2, 3, 4) if SCHEDULES[name].needs_virtual else (1,):
                try:
                    schedule = build_schedule(name, pp, m, V)
                except ValueError:  # interleaved: m not in equal rounds
                    continue
                per_rank = peak_activations_per_rank(
                    schedule.compute_actions(), schedule.split_backward
                )
                formula = formula_peak_first_rank(name, pp, m, V)
                assert max(per_rank) == per_rank[0], (pp, m, V)
                if name != "interleaved" or m % pp == 0:
                    assert per_rank[0] == formula, (pp, m, V)
                    checked += 1
                else:
                    assert per_rank[0] >= formula, (pp, m, V)
    assert checked >= 15
    if name == "interleaved":  # p = 4, V = 2: 11 stages of 1/8, i.e. 5.5 = 4 (1 + 3/8) full ones
        assert formula_peak_first_rank(name, 4, 8, 2) == 11 == 2 * 4 * (1 + 3 / 8)
        schedule = build_schedule(name, 3, 8, 2)
        got = peak_activations_per_rank(schedule.compute_actions(), schedule.split_backward)
        assert got[0] == 9 > formula_peak_first_rank(name, 3, 8, 2) == 8


def test_1f1b_grid_p2_m3():
    from minidp.parallel.pipeline.diagram import grid

    schedule = build_schedule("1f1b", 2, 3)
    timeline = simulate(schedule.compute_actions(), 2, 2, False)
    assert grid(timeline).splitlines() == [
        "rank 0: 0F0 0F1 .   0B0 0F2 0B1 .   0B2",
        "rank 1: .   1F0 1B0 1F1 1B1 1F2 1B2 .",
    ]


def test_the_pipeline_folder_imports_nothing_that_needs_mpi():
    """Schedules are data: no module of parallel/pipeline/ written here imports comm or mpi4py
    (the schedule files; stage.py and communications.py, which send, are another matter)."""
    import ast

    for name in ("actions", "schedules", "lowering", "validate", "dry_run", "simulate", "diagram"):
        tree = ast.parse((ROOT / "minidp/parallel/pipeline" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                modules.append(getattr(node, "module", None) or "")
                for module in modules:
                    assert "mpi4py" not in module and "comm" not in module.split("."), (
                        name,
                        module,
                    )


def random_compute_order(rng, pp: int, m: int, V: int, split: bool) -> list[list[Action]]:
    """Per rank, a random order of its F, B (and W) that keeps each rank's own rules (F
    before B before W; a stage's input from the same rank first), whatever the others do."""
    num_stages, kinds = pp * V, (F, B, W) if split else (F, B)
    orders = []
    for rank in range(pp):
        left = [
            Action(s, k, j) for s in range(rank, num_stages, pp) for k in kinds for j in range(m)
        ]
        order: list[Action] = []
        while left:
            ready = []
            for a in left:
                earlier = {
                    F: [],
                    B: [Action(a.stage, F, a.micro_batch)],
                    W: [Action(a.stage, B, a.micro_batch)],
                }[a.kind]
                need = needs(a, num_stages)
                if need is not None and need.stage % pp == rank:
                    earlier.append(need)
                if all(e in order for e in earlier):
                    ready.append(a)
            order.append(rng.choice(ready))
            left.remove(order[-1])
        orders.append(order)
    return orders


def test_any_order_that_can_run_lowers_to_lists_that_cannot_deadlock():
    """Random per-rank orders: the lowering refuses exactly those the simulation finds stuck
    (a circular wait between ranks), and what it lowers always dry-runs to the end."""
    rng = random.Random(0)
    lowered_count = refused = 0
    for _ in range(400):
        pp, m, V, split = (
            rng.choice((1, 2, 3, 4)),
            rng.choice((1, 2, 3)),
            rng.choice((1, 2)),
            rng.random() < 0.5,
        )
        compute = random_compute_order(rng, pp, m, V, split)
        validate(compute, pp, pp * V, m, split)
        try:
            simulate(compute, pp, pp * V, split)
            can_run = True
        except ValueError:
            can_run = False
        try:
            lowered = add_send_recv(compute, pp, pp * V)
        except ValueError as error:
            assert not can_run and "every rank waits" in str(error)
            refused += 1
            continue
        assert can_run
        validate(lowered, pp, pp * V, m, split)
        dry_run(lowered, pp)
        lowered_count += 1
    assert lowered_count > 50 and refused > 50, (lowered_count, refused)


def test_the_grids_in_the_docs_are_what_the_command_prints(capsys):
    """docs/pipeline.md pastes `python -m minidp schedule ...` blocks: they must stay true."""
    text = (ROOT / "docs/pipeline.md").read_text()
    blocks = re.findall(r"```\n\$ python -m minidp (schedule [^\n]*)\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    for command, printed in blocks:
        assert main(command.split()) == 0
        assert capsys.readouterr().out == printed, command
    assert bubble_table() in text  # `python -m minidp schedule --table`, pasted


# ---- hand-made schedules that must be refused, naming the rank and the step -----------------
def test_a_backward_before_its_forward_is_refused():
    compute = [[Action(0, F, 0), Action(0, B, 0)], [Action(1, B, 0), Action(1, F, 0)]]
    with pytest.raises(ValueError, match=r"rank 1 step 0: 1B0 comes before 1F0"):
        validate(compute, pp=2, num_stages=2, micro_batches=1)


def test_a_weight_gradient_before_its_backward_is_refused():
    compute = [[Action(0, F, 0), Action(0, W, 0), Action(0, B, 0)]]
    with pytest.raises(ValueError, match=r"rank 0 step 1: 0W0 comes before 0B0"):
        validate(compute, pp=1, num_stages=1, micro_batches=1, split_backward=True)


def test_w_is_required_exactly_when_the_backward_is_split():
    """Whether the backward is split is the schedule's word, not guessed from the lists."""
    plain = [[Action(0, F, 0), Action(0, B, 0)]]
    split = [[Action(0, F, 0), Action(0, B, 0), Action(0, W, 0)]]
    validate(plain, pp=1, num_stages=1, micro_batches=1)
    validate(split, pp=1, num_stages=1, micro_batches=1, split_backward=True)
    with pytest.raises(ValueError, match=r"rank 0 step 2: 0W0: a W, but the backward is not"):
        validate(split, pp=1, num_stages=1, micro_batches=1, split_backward=False)
    with pytest.raises(
        ValueError, match=r"rank 0 step 2 \(the end\): stage 0 micro-batch 0 has no W"
    ):
        validate(plain, pp=1, num_stages=1, micro_batches=1, split_backward=True)


@pytest.mark.parametrize(
    "compute, words",
    [
        ([[Action(0, F, 0), Action(0, B, 0)], [Action(1, F, 0)]], "rank 1 step 1 (the end)"),
        ([[Action(0, F, 0), Action(1, F, 0)], []], "rank 0 step 1: 1F0: stage 1 belongs on"),
        ([[Action(0, F, 0), Action(0, F, 0)], []], "rank 0 step 1: 0F0 again (first at step 0)"),
        ([[Action(0, F, 3)], []], "rank 0 step 0: 0F3: micro-batch 3 is not in 0..0"),
        ([[Action(2, F, 0)], []], "rank 0 step 0: 2F0: stage 2 is not in 0..1"),
    ],
)
def test_counts_placement_and_ranges_are_checked(compute, words):
    with pytest.raises(ValueError) as error:
        validate(compute, pp=2, num_stages=2, micro_batches=1)
    assert words in str(error.value)


def test_a_deadlock_is_found_with_the_stuck_steps_marked():
    """Both ranks receive before they send: each waits for the other (PR #130378's hang)."""
    lowered = [
        [Action(0, F, 0), Action(0, RECV_B, 0), Action(0, SEND_F, 0), Action(0, B, 0)],
        [Action(1, RECV_F, 0), Action(1, F, 0), Action(1, B, 0), Action(1, SEND_B, 0)],
    ]
    validate(lowered, pp=2, num_stages=2, micro_batches=1)  # each list alone is fine
    with pytest.raises(Deadlock) as error:
        dry_run(lowered, pp=2)
    assert error.value.stuck == {0: 1, 1: 0}
    message = str(error.value)
    assert "rank 0 step 1 (0RECV_B0)" in message and "rank 1 step 0 (1RECV_F0)" in message
    assert "rank 0: 0F0 [0RECV_B0] 0SEND_F0 0B0" in message


def test_a_circular_compute_order_is_refused_by_the_lowering():
    compute = [
        [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
        [Action(1, F, 1), Action(1, B, 1), Action(1, F, 0), Action(1, B, 0)],
    ]
    validate(compute, pp=2, num_stages=2, micro_batches=2)
    with pytest.raises(ValueError, match="every rank waits") as error:
        add_send_recv(compute, pp=2, num_stages=2)
    assert "rank 0 step 1 (0B0" in str(error.value) and "rank 1 step 0 (1F1" in str(error.value)


def test_a_send_never_received_is_refused():
    lowered = [[Action(0, F, 0), Action(0, SEND_F, 0)], []]
    with pytest.raises(ValueError, match=r"rank 0 step 1: 0SEND_F0 is never received"):
        dry_run(lowered, pp=2)


@pytest.mark.parametrize(
    "name, pp, m, V, words",
    [
        ("1f1b", 0, 4, 1, "pp must be a positive integer"),
        ("gpipe", 2, 0, 1, "micro_batches must be a positive integer"),
        ("interleaved", 2, 4, 0, "virtual must be a positive integer"),
        ("1f1b", 2, 4, 2, "1f1b puts one stage on each rank"),
        ("interleaved", 3, 7, 2, "does not split into 2 rounds"),
        ("pipedream", 2, 4, 1, "schedule must be one of"),
    ],
)
def test_bad_arguments_are_named(name, pp, m, V, words):
    with pytest.raises(ValueError, match=words):
        build_schedule(name, pp, m, V)


# ---- the command line ---------------------------------------------------------------------
def test_cli_prints_grid_length_bubble_and_peaks(tmp_path, capsys):
    path = tmp_path / "s.json"
    assert main(["schedule", "--pp", "4", "--micro-batches", "8", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "rank 3: .   .   .   3F0 3B0 3F1" in out
    assert "length: 22 (unit time, F = B = 1)" in out
    assert "bubble fraction: 0.2727 (formula (p-1)/(m+p-1) = 0.2727)" in out
    assert "peak activations per stage (micro-batches held): 0:4 1:3 2:2 3:1" in out
    record = json.loads(path.read_text())
    assert record["schedule"] == "1f1b" and record["length"] == 22
    assert record["actions"][0][:3] == ["0F0", "0SEND_F0", "0F1"]


def test_cli_zero_bubble_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "zb.png"
    argv = ["schedule", "--schedule", "zb-h1", "--pp", "4", "--micro-batches", "8"]
    assert main(argv + ["--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "bubble fraction: 0.1579 (formula (p-1)/(2*m+p-1) = 0.1579)" in out
    assert png.stat().st_size > 1000


def test_cli_names_flags_only_where_the_library_names_its_arguments():
    assert schedule_flags("pp must be a positive integer") == "--pp must be a positive integer"
    assert schedule_flags("virtual must be 1, not 2") == "--virtual must be 1, not 2"
    assert (
        schedule_flags("rounds of pp=3: micro_batches=7") == "rounds of --pp=3: --micro-batches=7"
    )
    for untouched in ("stage 1 (stage s on rank s % pp)", "the pp ranks", "--pp must be"):
        assert schedule_flags(untouched) == untouched


@pytest.mark.parametrize(
    "args, words",
    [
        (["--pp", "0"], "--pp must be a positive integer, not 0"),
        (["--micro-batches", "0"], "--micro-batches must be a positive integer"),
        (["--schedule", "interleaved", "--virtual", "0"], "--virtual must be a positive"),
        (["--schedule", "gpipe", "--virtual", "2"], "--virtual must be 1, not 2"),
        (["--schedule", "interleaved", "--pp", "3", "--micro-batches", "7"], "--pp=3: --micro"),
        (["--schedule", "zb"], "invalid choice: 'zb'"),
    ],
)
def test_cli_bad_input_is_one_line(args, words, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["schedule", *args])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("minidp: error:") and words in err, err


def test_cli_bubble_table(capsys):
    assert main(["schedule", "--table"]) == 0
    out = capsys.readouterr().out
    assert "| zb-h1 | 4 | 8 | 1 | 19 | 0.1579 | (p-1)/(2*m+p-1) | 0.1579 |" in out
    assert "| interleaved | 4 | 2 | 2 | 18 | 0.5556 | (p-1)/(V*m+p-1) | 0.4286 (not exact) |" in out


def test_python_m_minidp_schedule():
    result = subprocess.run(
        [sys.executable, "-m", "minidp", "schedule", "--schedule", "interleaved", "--pp", "2",
         "--micro-batches", "4", "--virtual", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "rank 1: .   1F0 1F1 3F0 3B0" in result.stdout
    assert "bubble fraction: 0.1111 (formula (p-1)/(V*m+p-1) = 0.1111)" in result.stdout


def test_schedule_help_reads_whole(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["schedule", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "--micro-batches" in out and "simulate a pipeline schedule (unit time; no MPI)." in out
