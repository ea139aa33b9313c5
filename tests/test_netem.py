"""Network emulation (comm/netem.py): off costs nothing, on delays each send α + n·β.

No test here reads a clock: the Link's wait is replaced by a recorder, and the MPI job
compares bits and the straggler's per-rank delay, never times.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidp.comm import netem

ALPHA, GBITS = 50e-6, 1.0
BETA = 8 / (GBITS * 1e9)


def test_off_by_default_the_group_sends_through_its_communicator(monkeypatch):
    for name in netem.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    netem.network.cache_clear()
    from minidp import comm

    group = comm.world()
    assert netem.network() is None
    assert group.wire is group.comm  # the very object MPI sends through: nothing between
    marker = object()
    assert netem.wire(marker, group) is marker


def test_from_env_reads_the_three_variables():
    env = {
        "MINIDP_NET_LATENCY_US": "50",
        "MINIDP_NET_GBITS": "1",
        "MINIDP_NET_STRAGGLER": "1:5, 3:2.5",
    }
    net = netem.from_env(env)
    assert net.latency_s == pytest.approx(ALPHA)
    assert net.seconds_per_byte == pytest.approx(BETA)
    assert net.straggler_s == {1: pytest.approx(5e-3), 3: pytest.approx(2.5e-3)}
    assert netem.from_env({}) is None
    assert netem.from_env({"MINIDP_NET_GBITS": "10"}).latency_s == 0


@pytest.mark.parametrize(
    "name, value",
    [
        ("MINIDP_NET_LATENCY_US", "-1"),
        ("MINIDP_NET_LATENCY_US", "fast"),
        ("MINIDP_NET_GBITS", "0"),
        ("MINIDP_NET_GBITS", "inf"),
        ("MINIDP_NET_STRAGGLER", "1"),
        ("MINIDP_NET_STRAGGLER", "a:5"),
        ("MINIDP_NET_STRAGGLER", "1:-5"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(name, value):
    with pytest.raises(ValueError) as error:
        netem.from_env({name: value})
    assert str(error.value).startswith(f"{name}={value!r}: ")
    assert "\n" not in str(error.value)


class FakeComm:
    name = "fake"

    def __init__(self):
        self.sent = []

    def Isend(self, buf, dest, tag):
        self.sent.append(("Isend", buf[0].nbytes, dest))
        return "request"

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag, status=None):
        self.sent.append(("Sendrecv", sendbuf[0].nbytes, dest))


class FakeGroup:
    """What a Link reads of its group: world ranks, the call counter, inside or outside."""

    def __init__(self, world_rank: int):
        self.world_ranks, self.rank = (5, 6, 7), world_rank - 5
        self._outside = self.current = [0, 0, 0, 0]
        self._seq = 0


def link(world_rank: int, straggler: dict):
    waits = []
    group = FakeGroup(world_rank)
    net = netem.Network(ALPHA, BETA, straggler)
    return netem.Link(FakeComm(), group, net, pause=waits.append), group, waits


def test_each_send_waits_alpha_plus_n_beta_before_mpi_gets_it():
    wire, group, waits = link(5, {})
    group.current, group._seq = [1, 0, 0, 0], 1  # inside a collective call
    buf = np.zeros(1000, np.float32)
    assert wire.Isend([buf, None], 1, 7) == "request"
    wire.Sendrecv([buf[:10], None], 1, 7, [buf, None], 2, 7)
    assert waits == [pytest.approx(ALPHA + 4000 * BETA), pytest.approx(ALPHA + 40 * BETA)]
    assert wire.comm.sent == [("Isend", 4000, 1), ("Sendrecv", 40, 1)]
    assert wire.name == "fake"  # anything else is the communicator's own
    with pytest.raises(AttributeError):
        wire.no_such_method  # noqa: B018


def test_a_straggler_is_late_once_per_collective_call_and_only_on_its_rank():
    late = 5e-3
    wire, group, waits = link(6, {6: late})
    other, other_group, other_waits = link(5, {6: late})
    buf = np.zeros(10, np.uint8)
    for g in (group, other_group):
        g.current = [1, 0, 0, 0]
    for seq in (1, 2):
        for w, g in ((wire, group), (other, other_group)):
            g._seq = seq
            w.Isend([buf, None], 0, 7)
            w.Isend([buf, None], 0, 7)
    first, then = ALPHA + 10 * BETA + late, ALPHA + 10 * BETA
    assert waits == [pytest.approx(x) for x in (first, then, first, then)]
    assert other_waits == [pytest.approx(then)] * 4
    group.current = group._outside  # outside any collective: each message is a call
    wire.Isend([buf, None], 0, 7)
    wire.Isend([buf, None], 0, 7)
    assert waits[-2:] == [pytest.approx(first)] * 2


CHILD = """
import json, sys
import numpy as np
from minidp import comm
g = comm.world()
rng = np.random.default_rng(g.rank)
out = {"late_s": getattr(g.wire, "late_s", 0.0), "wire": type(g.wire).__name__}
for algo in ("ring", "tree", "recursive_doubling", "rabenseifner"):
    x = rng.standard_normal(1001).astype(np.float32)
    out[algo] = comm.allreduce(x, algo=algo).tobytes().hex()
out["bcast"] = comm.broadcast(rng.standard_normal(77), root=1).tobytes().hex()
everyone = g.comm.gather(out)
if g.rank == 0:
    json.dump(everyone, open(sys.argv[1], "w"))
"""


def run_child(tmp_path, name: str, env: dict) -> list:
    script, result = tmp_path / "child.py", tmp_path / f"{name}.json"
    script.write_text(CHILD)
    environ = {k: v for k, v in os.environ.items() if k not in netem.VARIABLES}
    job = subprocess.run(
        ["mpiexec", "-n", "3", sys.executable, str(script), str(result)],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert job.returncode == 0, job.stderr
    return json.loads(result.read_text())


def test_emulated_results_are_the_bits_of_the_plain_ones_and_only_the_straggler_is_late(
    tmp_path,
):
    plain = run_child(tmp_path, "plain", {})
    slow = {"MINIDP_NET_LATENCY_US": "20", "MINIDP_NET_GBITS": "5", "MINIDP_NET_STRAGGLER": "1:1"}
    emulated = run_child(tmp_path, "emulated", slow)
    assert [r["wire"] for r in plain] == ["Intracomm"] * 3
    assert [r["wire"] for r in emulated] == ["Link"] * 3
    assert [r["late_s"] for r in emulated] == [0.0, pytest.approx(1e-3), 0.0]
    for a, b in zip(plain, emulated):
        assert {k: v for k, v in a.items() if k not in ("wire", "late_s")} == {
            k: v for k, v in b.items() if k not in ("wire", "late_s")
        }


def test_the_command_line_says_a_bad_variable_in_one_line():
    job = subprocess.run(
        [sys.executable, "-m", "minidp", "info"],
        env={**os.environ, "MINIDP_NET_STRAGGLER": "slow"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert job.returncode == 2
    assert job.stderr.strip().splitlines() == [
        "minidp: error: MINIDP_NET_STRAGGLER='slow': give RANK:MS pairs, e.g. 1:5 or 1:5,3:2 "
        "(ranks >= 0, milliseconds >= 0)"
    ]


def test_bench_netem_predicts_with_the_machines_alpha_beta_plus_the_emulated_ones(tmp_path):
    from minidp import cost

    fit = {"points": [], "r2": 1.0, "max_rel_error": 0.0, "intercept": 3e-6, "slope": 2e-10}
    model = {"alpha": 2e-6, "beta": 1e-10, "gamma": 3e-10, "date": "today", "nprocs": 2}
    model.update(ping_pong=fit, reduction=fit, exchange=fit)
    calibration, rows = tmp_path / "calibration.json", tmp_path / "rows.json"
    calibration.write_text(json.dumps(model))
    environ = {k: v for k, v in os.environ.items() if k not in netem.VARIABLES}
    job = subprocess.run(
        ["mpiexec", "-n", "2", sys.executable, "-m", "minidp", "bench", "netem"]
        + ["--calibration", str(calibration), "--sizes", "4K", "--iters", "1", "--warmup", "0"]
        + ["--algos", "ring,tree", "--json", str(rows)],
        env={**environ, "MINIDP_NET_LATENCY_US": "10", "MINIDP_NET_GBITS": "100"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert job.returncode == 0, job.stderr
    assert "emulated network: α 10 us, 100 Gb/s" in job.stdout
    got = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [(r["op"], r["algo"], r["bytes"]) for r in got] == [
        ("allreduce", "ring", 4096),
        ("allreduce", "tree", 4096),
    ]
    alpha, beta = 2e-6 + 10e-6, 1e-10 + 8 / 100e9
    for row in got:
        want = cost.time("allreduce", row["algo"], 2, 1024, 4, alpha=alpha, beta=beta, gamma=3e-10)
        assert row["predicted_us"] == pytest.approx(want * 1e6)
        assert row["measured_us"] > 0
