"""Groups and what they keep: sub-groups side by side, threads, byte counters, no new arrays."""

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
        if sub.rank == 0:
            assert got.ravel().tolist() == listed
    else:
        assert sub is None
    assert world.split(None if r == 0 else 1) is None or r != 0


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


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3])
def test_repeated_calls_of_one_size_allocate_nothing():
    g = comm.world().dup()
    n = 1 << 20  # 4 MiB of float32: even one chunk-sized temporary is over 1 MiB
    x = np.random.default_rng(g.rank).standard_normal(n).astype(np.float32)
    out, chunk = np.empty_like(x), np.empty(comm.chunk_bounds(n, g.size)[1], np.float32)
    b = comm.chunk_bounds(n, g.size)
    mine = x[b[g.rank] : b[g.rank + 1]].copy()
    calls = {
        **{
            f"allreduce {a}": (lambda a=a: comm.allreduce(x, algo=a, group=g, out=out))
            for a in comm.ALGORITHMS["allreduce"]
            if a != "mpi"
        },
        "reduce_scatter": lambda: comm.reduce_scatter(
            x, algo="ring", group=g, out=chunk[: b[g.rank + 1] - b[g.rank]]
        ),
        "allgather": lambda: comm.allgather(mine, algo="ring", group=g, out=out),
        "broadcast ring": lambda: comm.broadcast(out, algo="ring", group=g),
        "broadcast tree": lambda: comm.broadcast(out, algo="tree", group=g),
        "reduce tree": lambda: comm.reduce(x, algo="tree", group=g, out=out),
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
