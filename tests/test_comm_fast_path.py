"""The fast path of small collectives (comm/fast_path.py) against the plain path, bit for bit.

    python -m pytest -q tests/test_comm_fast_path.py

Every call the fast path takes is run twice in one launch, through the fast path and inside
`fast_path.plain()`, on random floats (so a changed order of operands would change bits),
and must give the same bytes and count the same messages and bytes: sizes 0, 1, odd, not
divisible by the group, 4 KiB and 64 KiB, each trick on and off, at 2, 3 and 4 ranks.
"""

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from minidp import comm
from minidp.comm import fast_path
from minidp.comm.collectives import FAST


def lengths(p: int) -> list[int]:
    """0, 1, odd, not divisible by p, 4 KiB and 64 KiB of float32."""
    return [0, 1, 7, 5 * p + 1, 1024, 16384]


def both_paths(call, g: comm.Group):
    """(fast result, plain result, fast counters, plain counters) of call()."""
    g.reset_counters()
    fast = call().copy()
    counted = g.counters
    g.reset_counters()
    with fast_path.plain():
        plain = call().copy()
    return fast, plain, counted, g.counters


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_allreduce_fast_equals_plain_bit_for_bit():
    g = comm.world().dup()
    rng = np.random.default_rng(g.rank)
    taken, staged, bound = 0, 0, 0
    for persistent in (True, False):
        fast_path.TRICKS["persistent"] = persistent
        for n in lengths(g.size):
            for dtype in (np.float32, np.float64):
                x = rng.standard_normal(n).astype(dtype)
                for algo in ("ring", "recursive_doubling", "auto"):
                    for op in ("sum", "avg", "max"):
                        for where in ("new", "out", "in place"):
                            what = f"{algo} {op} {dtype.__name__} n={n} {where} {persistent}"

                            def call(x=x, where=where, algo=algo, op=op):
                                y = x.copy()
                                out = {"new": None, "out": np.empty_like(x), "in place": y}
                                return comm.allreduce(y, op=op, algo=algo, group=g, out=out[where])

                            fast, plain, counted, counted_plain = both_paths(call, g)
                            assert fast.tobytes() == plain.tobytes(), what
                            assert counted == counted_plain, what
        taken += len(g.plans)
        staged += sum(getattr(plan, "staged", None) is not None for plan in g.plans.values())
        bound += sum(len(getattr(plan, "bound", ())) for plan in g.plans.values())
    fast_path.TRICKS["persistent"] = True
    assert taken > 0 and staged > 0 and bound > 0  # the fast path ran, staged and bound
    g.free()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=[2, 3])
def test_bound_steps_reused_on_new_values():
    """The same x and out, called again and again with new values (as a training loop
    calls): the requests bound to their addresses are made once and give the plain bits;
    a call with other buffers of the same size binds them too."""
    g = comm.world().dup()
    rng = np.random.default_rng(g.rank)
    for algo, n in (("ring", 16384), ("ring", 65536), ("recursive_doubling", 1000)):
        x, out, other = (np.empty(n, np.float32) for _ in range(3))
        for i in range(4):
            x[:] = rng.standard_normal(n)
            target = other if i == 3 else out
            fast, plain, counted, counted_plain = both_paths(
                lambda x=x, algo=algo, target=target: comm.allreduce(
                    x, algo=algo, group=g, out=target
                ),
                g,
            )
            assert fast.tobytes() == plain.tobytes() and counted == counted_plain, (algo, n, i)
        plan = g.plans[("allreduce", n, x.dtype, "sum", algo, True)]
        assert len(plan.bound) == (2 if algo == "ring" or g.size == 2 else 0), (algo, n)
    g.free()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=[2, 3])
def test_fast_path_catches_mismatched_calls():
    """Checks on: a rank with another size raises CollectiveMismatch on every rank; checks
    off, two ranks whose first messages both differ: the staged messages' size check raises
    MessageSizeMismatch on both (fewer bytes on one, MPI's truncation on the other)."""
    g = comm.world().dup()
    x = np.ones(100 + (g.rank == 0), np.float32)
    with pytest.raises(comm.CollectiveMismatch, match="different arguments"):
        comm.allreduce(x, algo="ring", group=g)
    if g.size != 2:
        return
    quiet = comm.Group(MPI.COMM_WORLD.Dup(), checks=False, timeout=None)
    comm.allreduce(np.ones(4, np.float32), algo="ring", group=quiet)  # a plan, staged
    with pytest.raises(comm.MessageSizeMismatch):  # chunks of 3 against 2
        comm.allreduce(np.ones(6 if quiet.rank == 0 else 4, np.float32), algo="ring", group=quiet)


def test_switched_off_by_the_environment():
    code = "from minidp import comm; from minidp.comm.collectives import FAST; print(len(FAST))"
    for value, want in (("0", "0"), ("1", str(len(fast_path.PATHS)))):
        env = {**os.environ, "MINIDP_FAST_COMM": value}
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert got.stdout.strip() == want, got.stderr
    with fast_path.plain():
        assert not FAST
    assert FAST


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=[2, 3])
def test_auto_reduces_small_shared_arrays_by_messages_and_large_ones_by_shm():
    """auto on arrays in shared memory (DDP's buckets): below auto.SHM_MIN, the ring (its
    messages counted, the bits of the ring, and so of shm, on a plain array);
    from SHM_MIN up, shm (no message). allreduce_coalesced splits a list the same way, and
    the cost model prices DDP's buckets by the same rule (auto.choose_shared)."""
    from minidp import cost
    from minidp.comm import auto
    from minidp.cost.calls import Shapes, data_parallel
    from minidp.cost.step import Layout

    g = comm.world().dup()
    p, small, large = g.size, 1000, auto.SHM_MIN // 4  # float32 elements
    rng = np.random.default_rng(g.rank)
    values = [rng.standard_normal(n).astype(np.float32) for n in (small, large)]
    shared = [comm.shared_zeros(n, np.float32, g) for n in (small, large)]
    for coalesced in (False, True):
        for x, v in zip(shared, values):
            x[:] = v
        g.reset_counters()
        if coalesced:
            comm.allreduce_coalesced(shared, group=g)
        else:
            for x in shared:
                comm.allreduce(x, group=g, out=x)
        counted = g.counters["allreduce"]
        for x, v in zip(shared, values):
            algo = auto.choose_shared(v.nbytes, p)
            assert (algo == "shm") == (v.size == large), algo
            want = comm.allreduce(v, algo=algo, group=g)
            assert x.tobytes() == want.tobytes(), (algo, coalesced)
        algos = [auto.choose_shared(v.nbytes, p) for v in values]
        priced = sum(
            cost.sent("allreduce", a, p, g.rank, v.size, 4).bytes for a, v in zip(algos, values)
        )
        assert counted["calls"] == 2 and counted["bytes_sent"] == priced, counted
    layout = Layout("dp", dp=p, algo="auto", bucket_mb=auto.SHM_MIN / 2**20)
    priced = [c.algo for c in data_parallel(layout, Shapes([small, large], []), 4)[2:]]
    assert priced == ["shm", "ring"]  # the buckets: the large one first (reverse order)
    for x in shared:
        comm.release_shared(x, g)
    g.free()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_fast_path_judges_out_as_the_plain_path_does():
    """out=x read-only raises on both paths and leaves x as it was (the bound requests
    would write through it); a partial overlap raises on both; in place through another
    view of x gives the plain bits."""
    g = comm.world().dup()
    x = np.random.default_rng(g.rank).standard_normal(1024).astype(np.float32)
    frozen = x.tobytes()
    before = bytes(bytearray(frozen))  # a copy apart: a write through read_only changes frozen
    for algo in ("ring", "recursive_doubling", "auto"):
        for plain in (False, True):
            with fast_path.plain() if plain else contextlib.nullcontext():
                read_only = np.frombuffer(frozen, np.float32)
                with pytest.raises(ValueError, match="out is read-only"):
                    comm.allreduce(read_only, algo=algo, group=g, out=read_only)
                assert read_only.tobytes() == frozen == before, (algo, plain)
                buf = np.concatenate([x, x])
                with pytest.raises(ValueError, match="overlaps the input"):
                    comm.allreduce(buf[:1024], algo=algo, group=g, out=buf[1:1025])

        def call(algo=algo):
            y = x.copy()
            return comm.allreduce(y, algo=algo, group=g, out=y[:])  # same memory, not y

        fast, plain, counted, counted_plain = both_paths(call, g)
        assert fast.tobytes() == plain.tobytes() and counted == counted_plain, algo
    assert g.plans  # the fast path ran
    g.free()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_settings_changed_after_the_first_fast_call_are_obeyed():
    """A plan made before the group's wire, timeout or checks change: the emulated network's
    waits apply (one per message sent) and a deadline set afterwards (or one that follows
    checks turned off) raises CollectiveTimeout against a rank that skips, as the plain
    path would."""
    from minidp.comm import netem

    g = comm.world().dup()
    x = np.ones(1024, np.float32)
    comm.allreduce(x, algo="ring", group=g)  # a plan, made on the communicator as the wire
    waits = []
    g.wire = netem.Link(g.comm, g, netem.Network(latency_s=1e-6), pause=waits.append)
    g.reset_counters()
    assert comm.allreduce(x, algo="ring", group=g).tolist() == [2.0] * 1024
    assert len(waits) == g.counters["allreduce"]["messages_sent"] == 2, waits
    timed = comm.Group(MPI.COMM_WORLD.Dup(), checks=False, timeout=None)
    checked = comm.Group(MPI.COMM_WORLD.Dup(), checks=True, timeout=1.0)  # a loaded runner
    for group, change in ((timed, "timeout"), (checked, "checks")):
        comm.allreduce(x, algo="ring", group=group)  # a plan, made while MPI may block
        if change == "timeout":
            group.timeout = 0.3
        else:
            group.checks = False  # the explicit deadline is now polled by the waits
        if group.rank == 0:  # rank 1 skips the call
            with pytest.raises(comm.CollectiveTimeout, match="heard nothing from rank"):
                comm.allreduce(x, algo="ring", group=group)
        MPI.COMM_WORLD.Barrier()
    g.free()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_a_second_thread_neither_makes_nor_frees_plans(monkeypatch):
    """While the group's lock is held (another thread inside a collective on it), a call
    that would make a plan and start the plans over raises the plain RuntimeError and
    frees nothing."""
    monkeypatch.setattr(fast_path, "MAX_PLANS", 2)
    g = comm.world().dup()
    for n in (8, 16):
        comm.allreduce(np.ones(n, np.float32), algo="ring", group=g)
    plans = dict(g.plans)
    assert len(plans) == 2 and all(plan.staged.steps for plan in plans.values())
    with g._lock:  # as a thread inside a collective on g holds it
        with pytest.raises(RuntimeError, match="give each thread its own group.dup()"):
            comm.allreduce(np.ones(32, np.float32), algo="ring", group=g)
    assert g.plans == plans and all(plan.staged.steps for plan in plans.values())
    assert comm.allreduce(np.ones(32, np.float32), algo="ring", group=g).tolist() == [2.0] * 32
    g.free()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_failed_bound_steps_keep_the_callers_arrays_alive_for_mpi(monkeypatch):
    """Steps bound to the caller's x and out hold raw addresses: if they fail, messages may
    still be in flight, so the group keeps x and out (group.abandoned), as p2p keeps its
    requests; and the group is broken."""
    from minidp.comm import persistent

    g = comm.world().dup()
    x, out = np.ones(1024, np.float32), np.empty(1024, np.float32)

    def fails(requests, statuses):
        MPI.Request.Waitall(requests, statuses)  # the messages done, then an MPI error
        raise MPI.Exception(MPI.ERR_OTHER)

    monkeypatch.setattr(persistent, "_waitall", fails)
    with pytest.raises(MPI.Exception):
        comm.allreduce(x, algo="ring", group=g, out=out)
    assert any(a is x for a in g.abandoned) and any(a is out for a in g.abandoned)
    assert g.broken


def test_persistent_steps_map_only_truncation_to_message_size_mismatch(monkeypatch):
    """A receive that gets more bytes than posted is MessageSizeMismatch; any other MPI
    error from the wait is raised as MPI raised it (as p2p.sendrecv does)."""
    from minidp.comm import persistent

    g = comm.Group(MPI.COMM_SELF.Dup(), checks=False, timeout=None)
    steps = persistent.Steps(g)
    steps.add(np.ones(2, np.float32), 0, np.empty(1, np.float32), 0)  # 8 bytes into 4
    with pytest.raises(comm.MessageSizeMismatch, match="MPI truncated the message"):
        steps.run(g)

    def fails(requests, statuses):
        raise MPI.Exception(MPI.ERR_OTHER)

    monkeypatch.setattr(persistent, "_startall", lambda requests: None)
    monkeypatch.setattr(persistent, "_waitall", fails)
    with pytest.raises(MPI.Exception) as raised:
        steps.run(g)
    assert raised.value.Get_error_class() == MPI.ERR_OTHER
    steps.free()
    g.comm.Free()
