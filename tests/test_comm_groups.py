"""Groups and what they keep: sub-groups side by side, threads, byte counters, no new arrays."""

import functools
import threading
import tracemalloc

import numpy as np
import pytest

from minidp import comm


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[3, 4, 5])
def test_split_subgroups_run_side_by_side():
    world = comm.world()
    p, r = world.size, world.rank
    evens_odds = world.split(color=r % 2, key=-r)  # key -r: reversed rank order
    members = [i for i in range(p) if i % 2 == r % 2]
    assert evens_odds.size == len(members)
    assert evens_odds.world_ranks == tuple(reversed(members))
    assert (evens_odds.left, evens_odds.right) == (
        (evens_odds.rank - 1) % evens_odds.size,
        (evens_odds.rank + 1) % evens_odds.size,
    )
    for algo in comm.ALGORITHMS["allreduce"]:  # both halves at once, big enough to overlap
        x = np.full(300_000, r, np.int64)
        total = comm.allreduce(x, algo=algo, group=evens_odds)
        assert (total == sum(members)).all(), algo
    bounds = comm.chunk_bounds(10, evens_odds.size)
    mine = comm.reduce_scatter(np.arange(10.0) * r, group=evens_odds)
    assert np.array_equal(
        mine, np.arange(10.0)[bounds[evens_odds.rank] : bounds[evens_odds.rank + 1]] * sum(members)
    )

    listed = [p - 1, 0, 1]
    sub = world.subgroup(listed)
    if r in listed:
        assert sub.rank == listed.index(r) and sub.world_ranks == tuple(listed)
        got = comm.gather(np.array([r]), root=0, group=sub)
        assert (got.ravel().tolist() == listed) if sub.rank == 0 else got is None
    else:
        assert sub is None
    rest = world.split(None if r == 0 else 1)  # color None: rank 0 joins no group
    if r == 0:
        assert rest is None
    else:
        assert (rest.size, rest.rank, rest.world_ranks) == (p - 1, r - 1, tuple(range(1, p)))
        assert comm.allreduce(np.array([r]), group=rest)[0] == sum(range(1, p))


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 4])
def test_threads_each_with_their_own_dup():
    world = comm.world()
    p = world.size
    results = {}

    def work(name: int, group: comm.Group) -> None:
        x = np.full(50_000, world.rank + 10 * name, np.float64)
        for _ in range(20):
            out = comm.allreduce(x, algo="ring", group=group)
        results[name] = out

    groups = [world.dup(), world.dup()]
    threads = [threading.Thread(target=work, args=(i, g)) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in (0, 1):
        assert (results[name] == sum(range(p)) + 10 * name * p).all()
        assert groups[name].counters["allreduce"]["calls"] == 20


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3, 4, 5])
def test_counters_show_the_bytes_each_algorithm_sends():
    g = comm.world().dup()
    p, r = g.size, g.rank
    for n in (1000, 1001, 7, 1 << 16):
        x = np.ones(n, np.float32)
        b = comm.chunk_bounds(n, p)
        size = [(b[i + 1] - b[i]) * 4 for i in range(p)]

        g.reset_counters()
        comm.allreduce(x, algo="ring", group=g)
        ring = g.counters["allreduce"]
        # reduce-scatter sends every chunk but r and receives all but r - 1;
        # allgather sends every chunk but r + 1 and receives all but r
        sent = 2 * n * 4 - size[r] - size[(r + 1) % p]
        received = 2 * n * 4 - size[(r - 1) % p] - size[r]
        assert ring == {
            "calls": 1,
            "bytes_sent": sent,
            "bytes_recv": received,
            "messages_sent": 2 * (p - 1),
        }
        assert abs(sent - 2 * (p - 1) / p * n * 4) <= 2 * 4  # the textbook 2(p-1)/p·n
        assert "checks" in g.counters  # fingerprints are counted apart from the data

        g.reset_counters()
        comm.reduce_scatter(x, algo="ring", group=g)
        comm.allgather(x[b[r] : b[r + 1]].copy(), algo="ring", group=g, out=np.empty(n, "f4"))
        assert g.counters["reduce_scatter"]["bytes_sent"] == n * 4 - size[r]
        assert g.counters["allgather"]["bytes_sent"] == n * 4 - size[(r + 1) % p]
        gathered = g.counters["allgather"]
        totals = comm.allreduce(np.array([gathered["bytes_sent"], gathered["bytes_recv"]]), group=g)
        assert totals[0] == totals[1]  # what is sent is received

        if p & (p - 1) == 0:  # recursive doubling: lg p full vectors
            g.reset_counters()
            comm.allreduce(x, algo="recursive_doubling", group=g)
            assert g.counters["allreduce"]["bytes_sent"] == (p.bit_length() - 1) * n * 4


def calls_with_out(g: comm.Group, n: int) -> dict:
    """One call per entry of comm.ALGORITHMS ("allreduce ring", ...), each into out= where
    the collective takes one (broadcast fills its x; barrier carries nothing)."""
    p, r = g.size, g.rank
    b, m = comm.chunk_bounds(n, p), n // p
    x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
    out, chunk, mine = np.empty_like(x), np.empty(b[r + 1] - b[r], "f4"), x[b[r] : b[r + 1]].copy()
    rows, row, stacked = x[: p * m].reshape(p, m), np.empty(m, np.float32), np.empty((p, m), "f4")
    run = {
        "allreduce": lambda a: comm.allreduce(x, algo=a, group=g, out=out),
        "reduce_scatter": lambda a: comm.reduce_scatter(x, algo=a, group=g, out=chunk),
        "allgather": lambda a: comm.allgather(mine, algo=a, group=g, out=out),
        "broadcast": lambda a: comm.broadcast(out, algo=a, group=g),
        "reduce": lambda a: comm.reduce(x, algo=a, group=g, out=out),
        "gather": lambda a: comm.gather(row, algo=a, group=g, out=stacked),
        "scatter": lambda a: comm.scatter(rows, algo=a, group=g, out=row),
        "alltoall": lambda a: comm.alltoall(rows, algo=a, group=g, out=stacked),
        "barrier": lambda a: comm.barrier(group=g, algo=a),
    }
    return {
        f"{name} {a}": functools.partial(run[name], a)
        for name, algos in comm.ALGORITHMS.items()
        for a in algos
    }


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3])
def test_repeated_calls_of_one_size_allocate_nothing():
    """Every algorithm of every collective, with checks on and off (the fast path)."""
    world = comm.world()
    n = 1 << 18  # 1 MiB of float32: even one chunk-sized temporary is over 256 KiB
    quick = comm.Group(world.comm.Dup(), checks=False, timeout=None)
    calls = {
        f"{name}, checks {'on' if g.checks else 'off'}": call
        for g in (world.dup(), quick)
        for name, call in calls_with_out(g, n).items()
    }
    # NumPy reports every array it allocates to tracemalloc, so the peak of new allocations
    # over five calls is exact. (Counting page faults is not: glibc hands a freed block back
    # to the next temporary of the same size without faulting, and MPI faults on its own.)
    tracemalloc.start()
    try:
        for name, call in calls.items():
            for _ in range(2):  # warm-up: scratch buffers are allocated here
                call()
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(5):
                call()
            peak = tracemalloc.get_traced_memory()[1] - before
            assert peak < 64 * 1024, f"{name}: {peak} bytes allocated in 5 calls after warm-up"
    finally:
        tracemalloc.stop()
