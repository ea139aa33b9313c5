"""Ranks that disagree: every rank that takes part raises, names the culprits, never hangs.

Each case runs on its own duplicate of the world group with a short timeout, because a group
that saw a CollectiveTimeout or CollectiveMismatch is broken afterwards (messages of the
failed call may still be in flight); the world group itself stays healthy throughout.
"""

import numpy as np
import pytest
from mpi4py import MPI

from minidp import comm
from minidp.comm import collectives
from minidp.comm.p2p import irecv


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
@pytest.mark.parallel(nprocs=[2, 3, 5])
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
@pytest.mark.parallel(nprocs=[2, 3])
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
