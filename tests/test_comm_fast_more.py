"""The fast path of reduce_scatter, allgather and broadcast (comm/fast_collectives.py) against
the plain path, bit for bit.

    python -m pytest -q tests/test_comm_fast_more.py

As tests/test_comm_fast_path.py does for allreduce: every call runs through the fast path
and inside `fast_path.plain()`, on random floats, and must give the same bytes, count the
same messages and bytes and send the same fingerprints (checks on): sizes 0, 1, odd, not
divisible by the group, 4 KiB and 64 KiB, each algorithm the fast path has (and auto), out
given or not (and in place where allowed), at 2, 3 and 4 ranks.
"""

import contextlib

import numpy as np
import pytest

from minidp import comm
from minidp.comm import checks, fast_path
from minidp.comm.collectives import FAST
from tests.test_comm_fast_path import lengths

NAMES = ("reduce_scatter", "allgather", "broadcast")


@pytest.fixture
def fingerprints(monkeypatch):
    """The fingerprint tuples the calls send (checks on), in order; every plan kept."""
    monkeypatch.setattr(fast_path, "MAX_PLANS", 1000)  # for assert_staged_and_bound
    sent = []
    exchange = checks.Fingerprints.exchange

    def recording(self, group, seq, call):
        sent.append(call)
        return exchange(self, group, seq, call)

    monkeypatch.setattr(checks.Fingerprints, "exchange", recording)
    return sent


def both_paths(call, g: comm.Group, sent: list):
    """(fast result, plain result, fast (counters, fingerprints), plain's) of call()."""
    seen = []
    for plain in (False, True):
        g.reset_counters()
        sent.clear()
        with fast_path.plain() if plain else contextlib.nullcontext():
            seen.append((call().tobytes(), g.counters, list(sent)))
    return seen[0], seen[1]


def check_both(call, g: comm.Group, sent: list, what: str) -> None:
    """The same bytes, counters and fingerprints through the fast path and the plain path."""
    fast, plain = both_paths(call, g, sent)
    assert fast == plain, what


def assert_staged_and_bound(g: comm.Group, name: str) -> None:
    """The fast path ran, for name only: on staged steps and on bound ones, for both algorithms
    at a power of two."""
    plans = [plan for plan in g.plans.values() if plan is not fast_path.NOT_FAST]
    assert {key[0] for key in g.plans} == {name}
    assert any(plan.staged for plan in plans) and any(plan.bound for plan in plans)
    algos = {plan.algo for plan in plans if plan.bound}
    assert len(algos) == (2 if g.size & (g.size - 1) == 0 else 1), algos


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_reduce_scatter_fast_equals_plain_bit_for_bit(fingerprints):
    g = comm.world().dup()
    p, rng = g.size, np.random.default_rng(g.rank)
    for persistent in (True, False):
        fast_path.TRICKS["persistent"] = persistent
        for n in lengths(p):
            for dtype in (np.float32, np.float64):
                x = rng.standard_normal(n).astype(dtype)
                lo, hi = comm.chunk_range(n, p, g.rank)
                for algo in ("ring", "recursive_halving", "auto"):
                    for op in ("sum", "avg", "max"):
                        for given in (False, True):

                            def call(x=x, algo=algo, op=op, m=(hi - lo) if given else None):
                                out = None if m is None else np.empty(m, x.dtype)
                                return comm.reduce_scatter(x, op=op, algo=algo, group=g, out=out)

                            what = f"{algo} {op} {dtype.__name__} n={n} out={given} {persistent}"
                            check_both(call, g, fingerprints, what)
    fast_path.TRICKS["persistent"] = True
    assert_staged_and_bound(g, "reduce_scatter")
    g.free()


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_allgather_fast_equals_plain_bit_for_bit(fingerprints):
    """out=None (rows of x), out given (chunk_bounds of out: chunks may differ by one), and
    in place (x is this rank's chunk of out)."""
    g = comm.world().dup()
    p, r, rng = g.size, g.rank, np.random.default_rng(g.rank)
    for persistent in (True, False):
        fast_path.TRICKS["persistent"] = persistent
        for n in lengths(p):
            b = comm.chunk_bounds(n, p)
            for dtype in (np.float32, np.float64):
                x = rng.standard_normal(n).astype(dtype)
                mine = x[b[r] : b[r + 1]].copy()
                for algo in ("ring", "recursive_doubling", "auto"):
                    for where in ("new", "out", "in place"):

                        def call(x=x, mine=mine, algo=algo, where=where, lo=b[r], hi=b[r + 1]):
                            if where == "new":
                                return comm.allgather(x, algo=algo, group=g)
                            out = np.full(x.size, np.nan, x.dtype)
                            if where == "in place":
                                out[lo:hi] = mine
                                mine = out[lo:hi]
                            return comm.allgather(mine, algo=algo, group=g, out=out)

                        what = f"{algo} {dtype.__name__} n={n} {where} {persistent}"
                        check_both(call, g, fingerprints, what)
    fast_path.TRICKS["persistent"] = True
    assert_staged_and_bound(g, "allgather")
    g.free()


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_broadcast_fast_equals_plain_bit_for_bit(fingerprints):
    """From root 0 and the last rank; each x broadcast three times in a row at one address
    (staged, then bound), with new values each time."""
    g = comm.world().dup()
    p, rng = g.size, np.random.default_rng(g.rank)
    bound = 0
    for persistent in (True, False):
        fast_path.TRICKS["persistent"] = persistent
        for n in lengths(p):
            for dtype in (np.float32, np.float64):
                x = np.empty((n, 1), dtype)  # 2-D: the fingerprint carries its shape
                for algo in ("tree", "auto"):
                    for root in (0, p - 1):
                        for i in range(3):
                            values = rng.standard_normal((n, 1)).astype(dtype)

                            def call(x=x, values=values, algo=algo, root=root):
                                x[...] = values
                                return comm.broadcast(x, root=root, algo=algo, group=g)

                            what = f"{algo} root={root} {dtype.__name__} n={n} #{i} {persistent}"
                            check_both(call, g, fingerprints, what)
        bound += sum(len(plan.bound) for plan in g.plans.values() if plan is not fast_path.NOT_FAST)
    fast_path.TRICKS["persistent"] = True
    assert {key[0] for key in g.plans} == {"broadcast"} and bound > 0
    g.free()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=[2, 3])
def test_fast_paths_catch_a_rank_with_another_size():
    """Checks on: rank 0 passes one element more; every rank raises CollectiveMismatch, as
    on the plain path (each on a group of its own: the error leaves a group unusable)."""
    world = comm.world()
    calls = {
        "reduce_scatter": lambda x, g: comm.reduce_scatter(x, algo="ring", group=g),
        "allgather": lambda x, g: comm.allgather(x, algo="ring", group=g),
        "broadcast": lambda x, g: comm.broadcast(x, root=0, algo="tree", group=g),
    }
    for name, call in calls.items():
        for plain in (False, True):
            g = world.dup()
            call(np.ones(100, np.float32), g)  # a plan for the size every rank passes
            x = np.ones(100 + (g.rank == 0), np.float32)
            with fast_path.plain() if plain else contextlib.nullcontext():
                with pytest.raises(comm.CollectiveMismatch, match="different arguments"):
                    call(x, g)
            assert plain or any(key[0] == name for key in g.plans), name


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_fast_paths_judge_arguments_as_the_plain_path_does():
    """Bad arguments raise the plain path's errors, before any message, on both paths."""
    g = comm.world().dup()
    x = np.arange(8, dtype=np.float32)
    frozen = np.arange(8, dtype=np.float32)
    frozen.flags.writeable = False
    buf = np.zeros(16, np.float32)
    bad = [
        (lambda: comm.reduce_scatter(x, algo="ring", group=g, out=x[:4]), "must not overlap"),
        (lambda: comm.reduce_scatter(x, group=g, out=np.empty(3, np.float32)), "must have shape"),
        (lambda: comm.reduce_scatter(x, group=g, out=buf[::4]), "contiguous"),
        (lambda: comm.reduce_scatter(x, op="mean", group=g), "unknown op"),
        (lambda: comm.reduce_scatter(x, algo="rings", group=g), "unknown algo"),
        (lambda: comm.allgather(x, group=g, out=np.empty(16, np.float64)), "dtype"),
        (lambda: comm.allgather(x, group=g, out=np.empty(14, np.float32)), "chunk of out"),
        (lambda: comm.allgather(buf[4:12], group=g, out=buf), "overlaps the input"),
        (lambda: comm.broadcast(frozen, group=g), "read-only"),
        (lambda: comm.broadcast(x, root=2, group=g), "root must be a rank"),
        (lambda: comm.broadcast(x, algo="trees", group=g), "unknown algo"),
    ]
    for plain in (False, True):
        with fast_path.plain() if plain else contextlib.nullcontext():
            for call, message in bad:
                with pytest.raises(ValueError, match=message):
                    call()
    assert comm.broadcast(x.copy(), group=g).tolist() == x.tolist()  # the group still works
    g.free()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_plain_switches_them_off_and_a_replaced_algorithm_is_obeyed(monkeypatch):
    g = comm.world().dup()
    x = np.ones(64, np.float32)
    with fast_path.plain():
        assert not FAST
        comm.reduce_scatter(x, algo="ring", group=g)
        comm.allgather(x, algo="ring", group=g)
        comm.broadcast(x, algo="tree", group=g)
    assert not g.plans and all(name in FAST for name in NAMES)
    comm.broadcast(x, algo="tree", group=g)
    assert list(g.plans)[0][0] == "broadcast"
    seen = []
    monkeypatch.setitem(comm.rooted.BROADCAST, "tree", lambda *args: seen.append(args))
    comm.broadcast(x, algo="tree", group=g)  # the replaced entry runs, not the plan's steps
    assert len(seen) == 1
    g.free()
