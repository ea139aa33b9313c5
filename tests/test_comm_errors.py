"""Ranks that disagree: every rank that takes part raises, names the culprits, never hangs.

Each case runs on its own duplicate of the world group with a short timeout, because a group
that saw a CollectiveTimeout or CollectiveMismatch is broken afterwards (messages of the
failed call may still be in flight); the world group itself stays healthy throughout.
The default settings (checks and deadline on, with MINIDP_CHECKS unset) are tested in a
subprocess, since conftest.py sets MINIDP_CHECKS for the suite.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

from minidp import comm
from minidp.cli.training import config
from minidp.comm import collectives, rooted
from minidp.comm.errors import MessageSizeMismatch
from minidp.comm.p2p import irecv
from minidp.tools import names


def group(timeout: float = 2.0, checks: bool = True) -> comm.Group:
    g = comm.world().dup()
    g.checks, g.timeout = checks, timeout
    return g


def expect(error, call, *fragments) -> str:
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3, 5])
def test_mismatched_arguments_raise_collective_mismatch_on_every_rank():
    world = comm.world()
    p, r, last = world.size, world.rank, world.size - 1

    g = group()  # one rank passes another shape
    x = np.ones(11 if r == last else 10, np.float32)
    expect(
        comm.CollectiveMismatch,
        lambda: comm.allreduce(x, algo="ring", group=g),
        f"rank {last}: #1 allreduce(algo=ring, op=sum, dtype=float32, shape=(11,))",
        "shape=(10,)",
    )
    expect(comm.CollectiveError, lambda: comm.allreduce(x, group=g), "broken")

    g = group()  # one rank passes another root
    expect(
        comm.CollectiveMismatch,
        lambda: comm.broadcast(np.ones(4), root=1 if r == 0 else 0, group=g, algo="tree"),
        "rank 0: #1 broadcast(algo=tree, dtype=float64, root=1, shape=(4,))",
    )

    g = group()  # one rank calls another collective
    call = (
        (lambda: comm.reduce(np.ones(4), group=g))
        if r == last
        else (lambda: comm.allreduce(np.ones(4), group=g))
    )
    expect(comm.CollectiveMismatch, call, "reduce(", "allreduce(")

    g = group()  # one rank passes another dtype and op
    y = np.ones(4, np.float64 if r == last else np.float32)
    expect(
        comm.CollectiveMismatch,
        lambda: comm.allreduce(y, op="max" if r == last else "sum", algo="naive", group=g),
        "op=max, dtype=float64",
    )
    assert comm.allreduce(np.ones(3), group=world)[0] == p  # the world is fine


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 5])
def test_a_rank_that_skips_a_collective_times_out_the_others():
    world = comm.world()
    r, last = world.rank, world.size - 1
    for checks, algo in ((True, "ring"), (False, "ring"), (False, "mpi"), (True, "tree")):
        g = group(timeout=1.0, checks=checks)
        if r != last:  # the last rank never calls; everyone else must give up, not hang
            message = expect(
                comm.CollectiveTimeout,
                lambda a=algo, g=g: comm.allreduce(np.ones(100_000), algo=a, group=g),
                "heard nothing from rank(s)",
                "within 1 s",
            )
            if checks:
                assert f"rank(s) {last} (world {last})" in message
                assert "fingerprint exchange" in message
            expect(comm.CollectiveError, lambda g=g: comm.barrier(group=g), "broken")
        world.comm.Barrier()
    assert comm.allreduce(np.ones(3), group=world)[0] == world.size


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[3])
def test_a_rank_later_than_the_deadline_gives_up_too_instead_of_waiting_alone():
    """The others timed out after sending their fingerprints: the late rank finds every
    fingerprint, and must still raise rather than go on into the data exchange alone."""
    world = comm.world()
    late = world.size - 1
    for algo in ("ring", "mpi"):
        g = group(timeout=1.0, checks=True)
        if world.rank == late:
            time.sleep(1.6)
            expected = "have given up"
        else:
            expected = "heard nothing from rank(s)"
        expect(
            comm.CollectiveTimeout,
            lambda a=algo, g=g: comm.allreduce(np.ones(50_000), algo=a, group=g),
            expected,
        )
        world.comm.Barrier()
    assert comm.allreduce(np.ones(3), group=world)[0] == world.size


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[3])
def test_bad_arguments_on_one_rank_raise_value_error_there_and_time_out_elsewhere():
    world = comm.world()
    g, fresh = group(timeout=1.0), group()
    if world.rank == 0:
        expect(ValueError, lambda: comm.broadcast(np.ones(4), root=world.size, group=g), "root")
        assert g.counters == {}  # nothing sent
    else:
        expect(
            comm.CollectiveTimeout, lambda: comm.broadcast(np.ones(4), root=0, group=g), "rank(s) 0"
        )
        # off the root, `out` alone gives scatter its dtype: objects are refused, not written
        objects = np.empty(3, object)
        expect(ValueError, lambda: comm.scatter(None, group=fresh, out=objects), "dtype")
        assert fresh.counters == {}
    world.comm.Barrier()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_any_error_inside_a_collective_breaks_the_group(monkeypatch):
    def fails_midway(g, src, out, op):
        irecv(g, out, g.left)  # a receive that nobody will ever match
        raise RuntimeError("interrupted")

    monkeypatch.setitem(collectives.ALLREDUCE, "ring", fails_midway)
    g = group()
    expect(RuntimeError, lambda: comm.allreduce(np.ones(8), algo="ring", group=g), "interrupted")
    assert g.broken.startswith("RuntimeError") and len(g.abandoned) == 1  # cancelled, kept
    expect(comm.CollectiveError, lambda: comm.barrier(group=g), "broken")
    MPI.COMM_WORLD.Barrier()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_one_group_refuses_a_second_thread():
    import threading

    g = group(timeout=30.0)
    if g.rank == 0:
        worker = threading.Thread(target=lambda: comm.allreduce(np.ones(8), group=g))
        worker.start()
        while not g._lock.locked():  # the worker is inside its collective
            pass
        expect(RuntimeError, lambda: comm.allreduce(np.ones(8), group=g), "dup()")
        MPI.COMM_WORLD.Barrier()
        worker.join()
    else:
        MPI.COMM_WORLD.Barrier()
        comm.allreduce(np.ones(8), group=g)


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_a_shorter_or_longer_message_raises_on_its_receiver_on_every_wait_path():
    r = comm.world().rank
    n = 5 if r == 0 else 4  # rank 0 gets 32 bytes for its 40; rank 1 gets 40 for its 32
    patient = group(timeout=None, checks=False)
    patient.patient = True
    paths = {  # checks off: only the size of what arrives can tell
        "Sendrecv (the fast path)": (group(None, False), comm.allgather, "ring", np.ones(n)),
        "Waitall": (group(None, False), comm.alltoall, "naive", np.ones((2, n))),
        "Testall against a deadline": (group(30.0, False), comm.allgather, "ring", np.ones(n)),
        "Testall, patient": (patient, comm.allgather, "ring", np.ones(n)),
    }
    for path, (g, collective, algo, x) in paths.items():
        message = expect(
            MessageSizeMismatch,
            lambda: collective(x, algo=algo, group=g),  # noqa: B023 (called at once)
            f"rank {r} of 2 (world {r}): {collective.__name__} #1 (algo={algo}) got ",
            "different shapes",
        )
        if r == 0:
            assert "got 32 bytes from rank 1 (world 1), 40 expected" in message, path
        else:
            assert "more bytes than the 32 expected from rank 0 (world 0)" in message, path
        assert g.broken, path
    MPI.COMM_WORLD.Barrier()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=[2, 3])
def test_turning_checks_on_after_construction_turns_the_deadline_on(monkeypatch):
    monkeypatch.delenv("MINIDP_TIMEOUT", raising=False)
    monkeypatch.setattr(
        "minidp.comm.checks.DEFAULT_TIMEOUT_S", 1.0
    )  # the default, short for the test
    world = comm.world()
    g = comm.Group(world.comm.Dup(), checks=False)
    assert g.timeout is None
    g.checks = True  # what tutorial 03 does
    assert g.timeout == 1.0 and g.dup().timeout == 1.0
    fixed = comm.Group(MPI.COMM_SELF, checks=True, timeout=5.0)
    fixed.checks = False
    assert fixed.timeout == 5.0  # set explicitly: it stays
    if world.rank != world.size - 1:  # the last rank never arrives
        expect(comm.CollectiveTimeout, lambda: comm.allreduce(np.ones(4), group=g), "within 1 s")
    world.comm.Barrier()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_every_algorithm_of_every_collective_runs_a_checked_call():
    g = group(timeout=30.0)
    x, rows = np.arange(6.0), np.arange(12.0).reshape(2, 6)
    calls = {
        "allreduce": lambda a: comm.allreduce(x, algo=a, group=g),
        "reduce_scatter": lambda a: comm.reduce_scatter(x, algo=a, group=g),
        "allgather": lambda a: comm.allgather(x, algo=a, group=g),
        "broadcast": lambda a: comm.broadcast(x.copy(), root=1, algo=a, group=g),
        "reduce": lambda a: comm.reduce(x, root=1, algo=a, group=g),
        "gather": lambda a: comm.gather(x, root=1, algo=a, group=g),
        "scatter": lambda a: comm.scatter(rows, root=1, algo=a, group=g),
        "alltoall": lambda a: comm.alltoall(rows, algo=a, group=g),
        "barrier": lambda a: comm.barrier(algo=a, group=g),
    }
    assert tuple(calls) == names.COLLECTIVES
    for collective, algos in comm.ALGORITHMS.items():
        for algo in algos:
            calls[collective](algo)
    assert g.counters["checks"]["calls"] == sum(len(a) for a in names.ALGORITHMS.values())


def test_one_list_of_names_for_the_tables_auto_checks_and_config():
    tables = {
        "allreduce": collectives.ALLREDUCE,
        "reduce_scatter": collectives.REDUCE_SCATTER,
        "allgather": collectives.ALLGATHER,
        "broadcast": rooted.BROADCAST,
        "reduce": rooted.REDUCE,
        "gather": rooted.GATHER,
        "scatter": rooted.SCATTER,
        "alltoall": collectives.ALLTOALL,
        "barrier": collectives.BARRIER,
    }
    assert {c: tuple(t) for c, t in tables.items()} == names.ALGORITHMS == comm.ALGORITHMS
    assert comm.OPS == names.OPS
    choices = {f.name: f.metadata.get("choices") for f in config.fields(config.TrainConfig)}
    assert choices["allreduce"] == ("auto", *names.ALGORITHMS["allreduce"])
    with pytest.raises(ValueError, match="names.py"):  # a new algorithm must be listed there
        names.table("allreduce", {**collectives.ALLREDUCE, "butterfly": None})


DEFAULTS_SCRIPT = """
import json
import sys
import numpy as np
from mpi4py import MPI
from minidp import comm

world = MPI.COMM_WORLD
rank, last = world.rank, world.size - 1
outcome = {}

def attempt(case, call):
    try:
        call()
        outcome[case] = "returned"
    except comm.CollectiveError as error:
        outcome[case] = type(error).__name__ + ": " + " ".join(str(error).split())
    world.Barrier()  # the next case starts together

x = np.arange(23.0)  # chunks of 5, 5, 5, 4, 4 on five ranks
g = comm.Group(world.Dup())  # the default settings
assert g.checks and g.timeout == 3.0, (g.checks, g.timeout)
part = comm.reduce_scatter(x, op="sum", group=g)
attempt("defect", lambda: comm.allgather(part, group=g))  # ranks pass different shapes

g = comm.Group(world.Dup())
attempt("skip", lambda: rank == last or comm.allreduce(np.ones(4), group=g))

g = comm.Group(world.Dup(), checks=False)  # no fingerprints: the sizes and the deadline
part = comm.reduce_scatter(x, op="sum", group=g)
attempt("unchecked", lambda: comm.allgather(part, group=g))
with open(f"{sys.argv[1]}/{rank}.json", "w") as file:
    json.dump(outcome, file)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nprocs", [5])
def test_by_default_mismatched_shapes_raise_on_every_rank_and_the_job_ends(tmp_path, nprocs):
    script = tmp_path / "defaults.py"
    script.write_text(DEFAULTS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "MINIDP_CHECKS"}
    env["MINIDP_TIMEOUT"] = "3"
    job = subprocess.run(
        ["mpiexec", "-n", str(nprocs), sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=150,  # the job ends: no rank hangs, and MPI_Finalize returns
        env=env,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    outcome = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(nprocs)}
    sizes = np.diff(comm.chunk_bounds(23, nprocs))
    p, last = nprocs, nprocs - 1
    for r in range(p):
        defect = outcome[r]["defect"]
        assert defect.startswith("CollectiveMismatch: "), defect
        assert f"allgather(algo=ring, dtype=float64, shape=({p}, {sizes[-1]}))" in defect
        assert f"allgather(algo=ring, dtype=float64, shape=({p}, {sizes[0]}))" in defect
        skip = outcome[r]["skip"]
        if r == last:
            assert skip == "returned"
        else:
            assert skip.startswith("CollectiveTimeout: ") and f"rank(s) {last} " in skip, skip
        # without fingerprints: a wrong size raises where it lands (ring: from the left),
        # the ranks waiting on those raise CollectiveTimeout; none returns a wrong result
        unchecked = outcome[r]["unchecked"]
        landed = "MessageSizeMismatch" if sizes[r - 1] != sizes[r] else "CollectiveTimeout"
        assert unchecked.startswith(landed + ": "), (r, unchecked)
