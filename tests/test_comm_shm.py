"""algo="shm": the allreduce by loads from each other's memory (comm/shm.py).

The collectives table (test_comm_collectives.py) runs it on plain arrays, through the shared
scratch, beside every other algorithm. Here: arrays made in shared memory, reduced in place
with no message; what "auto" picks; disagreements between ranks; freeing; DDP's buckets.
These small arrays stand for large ones: "auto" picks "shm" for them because the tests set
comm/auto.py's SHM_MIN to 0 (test_comm_fast_path.py tests the threshold itself)."""

import numpy as np
import pytest

from minidp import Tensor, comm, nn
from minidp.comm import auto, shm, shm_memory
from minidp.comm.shm import SharedMemory
from minidp.parallel import DistributedDataParallel


@pytest.fixture(autouse=True)
def shm_from_any_size(monkeypatch):
    """auto picks shm for a shared array of any size, as it does from auto.SHM_MIN up."""
    monkeypatch.setattr(auto, "SHM_MIN", 0)


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 4])
def test_a_shared_array_is_reduced_in_place_by_auto_with_no_message_and_the_rings_bits():
    g = comm.world().dup()
    p, r = g.size, g.rank
    rng = np.random.default_rng(r)
    for n in (1, 1000, 100_003):
        x = rng.standard_normal(n).astype(np.float32)
        ring = comm.allreduce(x, algo="ring", group=g)
        mpi = comm.allreduce(x, algo="mpi", group=g)
        shared = comm.shared_zeros(n, np.float32, g)
        assert comm.in_shared_memory(shared, g) and not comm.in_shared_memory(x, g)
        shared[...] = x
        g.reset_counters()
        comm.allreduce(shared, group=g, out=shared)  # auto: in shared memory, so shm
        counts = g.counters["allreduce"]
        assert counts["messages_sent"] == 0  # loads only (and MPI's barriers)
        chunk = comm.chunk_bounds(n, p)
        mine = chunk[r + 1] - chunk[r]
        assert counts["bytes_sent"] == (n + (p - 2) * mine) * 4  # what the others read of ours
        assert np.array_equal(shared, ring)  # the ring's order of additions, so its bits
        np.testing.assert_allclose(shared, mpi, rtol=1e-5, atol=1e-5)
    g.free()


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3])
def test_ranks_that_pass_different_shared_arrays_all_raise_instead_of_reading_the_wrong_one():
    for plain_on_rank_0 in (False, True):  # an error breaks the group: a fresh one each
        g = comm.world().dup()
        a = comm.shared_zeros(8, np.float64, g)
        b = comm.shared_zeros(8, np.float64, g)
        if plain_on_rank_0:  # a plain array beside shared ones, all with algo="shm"
            x = np.zeros(8) if g.rank == 0 else a
        else:  # another shared array of the same shape: the fingerprint agrees
            x = b if g.rank == 1 else a
        with pytest.raises(comm.CollectiveMismatch, match="different arrays"):
            comm.allreduce(x, algo="shm", group=g, out=x)
        g.free()


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 4])
def test_coalesced_shared_arrays_are_one_call_with_the_bits_of_one_allreduce_each():
    g = comm.world().dup()
    p, r = g.size, g.rank
    sizes = (7, 1, 30_001, 2)  # chunks of each array by itself, some smaller than p
    x = np.random.default_rng(r).standard_normal(sum(sizes))
    edges = np.cumsum((0, *sizes))
    want = [comm.allreduce(x[a:b], algo="ring", group=g) for a, b in zip(edges, edges[1:])]
    shared = comm.shared_zeros(len(x), np.float64, g)
    pieces = [shared[a:b] for a, b in zip(edges, edges[1:])]
    for op in ("sum", "avg"):
        shared[...] = x
        g.reset_counters()
        comm.allreduce_coalesced(pieces, op=op, group=g)  # auto: all shared, so one shm call
        assert g.counters["allreduce"]["calls"] == 1
        moved = sum(n + (p - 2) * int(np.diff(comm.chunk_bounds(n, p))[r]) for n in sizes)
        assert g.counters["allreduce"]["bytes_sent"] == moved * 8
        for got, ring in zip(pieces, want, strict=True):
            assert np.array_equal(got, ring / (p if op == "avg" else 1))
    plain = [x[a:b].copy() for a, b in zip(edges, edges[1:])]  # not shared: one call each
    g.reset_counters()
    comm.allreduce_coalesced(plain, group=g, algo="ring")
    assert g.counters["allreduce"]["calls"] == len(sizes)
    assert all(np.array_equal(a, b) for a, b in zip(plain, want, strict=True))
    g.free()


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3])
def test_ranks_that_coalesce_other_arrays_all_raise_instead_of_reading_the_wrong_ones():
    world = comm.world()
    a = comm.shared_zeros(12, np.float32, world)
    plain = np.zeros(6, np.float32)
    r = world.rank
    calls = {  # what rank 0 passes, and what the others pass
        "another split of the same bytes": ([a[:6], a[6:]], [a[:5], a[5:]]),
        "another order": ([a[6:], a[:6]], [a[:6], a[6:]]),
        "a plain array where the others have a shared one": ([plain, a[6:]], [a[:6], a[6:]]),
    }
    for checks in (True, False):  # caught by the fingerprint, or by shm's own agreement
        for first, others in calls.values():  # an error breaks the group: a fresh one each
            g = comm.Group(world.comm.Dup(), checks=checks)
            with pytest.raises(comm.CollectiveMismatch):
                comm.allreduce_coalesced(first if r == 0 else others, algo="shm", group=g)
            g.free()
        g = comm.Group(world.comm.Dup(), checks=checks)
        with pytest.raises(ValueError, match="overlap"):  # alike on every rank
            comm.allreduce_coalesced([a[:8], a[4:]], algo="shm", group=g)
        g.free()


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3])
def test_coalesced_plain_arrays_with_shm_go_through_the_scratch_one_by_one():
    g = comm.world().dup()
    rng = np.random.default_rng(g.rank)
    xs = [rng.standard_normal(n) for n in (5, 1000)]
    want = [comm.allreduce(x, algo="ring", group=g) for x in xs]
    shared = comm.shared_zeros(3, np.float64, g)
    shared[...] = g.rank + 1
    comm.allreduce_coalesced([xs[0], shared, xs[1]], algo="shm", group=g)
    assert all(np.array_equal(x, w) for x, w in zip(xs, want, strict=True))
    assert np.array_equal(shared, np.full(3, g.size * (g.size + 1) / 2))
    g.free()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=[2, 3])
def test_shared_arrays_of_different_sizes_are_refused_on_every_rank():
    g = comm.world().dup()
    with pytest.raises(comm.CollectiveMismatch, match="different sizes"):
        comm.shared_zeros(10 + g.rank, np.float32, g)
    g.free()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_a_group_spread_over_machines_refuses_shm_and_ddp_keeps_plain_buckets(monkeypatch):
    g = comm.world().dup()
    g.shared = SharedMemory(g)
    g.shared.local = False  # what Split_type(COMM_TYPE_SHARED) says across two machines
    with pytest.raises(ValueError, match="not all on one machine"):
        comm.allreduce(np.ones(4), algo="shm", group=g)
    with pytest.raises(ValueError, match="not all on one machine"):
        comm.shared_zeros(4, np.float32, g)
    g.free()
    monkeypatch.setattr(comm, "on_one_machine", lambda group: False)
    ddp = DistributedDataParallel(_mlp(), comm.world(), algo="auto")
    assert ddp.arena is None
    assert not any(comm.in_shared_memory(b.data, ddp.comm_group) for b in ddp.buckets)
    ddp.close()


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_ddp_keeps_plain_buckets_when_dev_shm_has_no_room(monkeypatch):
    monkeypatch.setattr(shm_memory, "_room", lambda: 0)  # a small /dev/shm (Docker's is 64 MiB)
    auto = DistributedDataParallel(_mlp(), comm.world(), algo="auto")
    assert auto.arena is None
    forced = DistributedDataParallel(_mlp(), comm.world(), algo="shm")  # asked for: tried
    assert comm.in_shared_memory(forced.buckets[0].data, forced.comm_group)
    auto.close()
    forced.close()


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=2)
def test_closed_ddps_hand_their_shared_memory_back_for_the_next_one():
    world = comm.world()
    x, y = np.ones((2, 6)), np.array([0, 1])
    segments, before = len(shm.pool(world)), None
    for i in range(30):  # a process that builds many models holds one segment, not thirty
        ddp = DistributedDataParallel(_mlp(), world, algo="auto")
        nn.cross_entropy(ddp(Tensor(x * i)), y).backward()  # other gradients each time
        ddp.finish_gradient_sync()
        if before is not None:  # the last DDP's gradients moved out of the reused memory
            for p, k in zip(*before, strict=True):
                assert np.array_equal(p.grad, k)
        ddp.close()
        before = ddp.parameters(), [p.grad.copy() for p in ddp.parameters()]
    assert len(shm.pool(world)) <= segments + 1
    with pytest.raises(ValueError, match="not an array shared_zeros made"):
        comm.release_shared(np.zeros(3), world)


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_ranks_whose_pools_differ_are_refused_on_every_rank_not_left_waiting():
    g = comm.world().dup()
    a = comm.shared_zeros(16, np.float32, g)
    if g.rank == 0:
        comm.release_shared(a, g)  # rank 0 would reuse it; rank 1 would allocate
    with pytest.raises(comm.CollectiveMismatch, match="pools differ"):
        comm.shared_zeros(16, np.float32, g)
    g.free()


def _mlp():
    return nn.MLP([6, 5, 3], rng=np.random.default_rng(0), dtype=np.float64)


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3])
def test_ddp_buckets_live_in_shared_memory_with_the_rings_bits():
    world = comm.world()
    x = np.random.default_rng(world.rank).standard_normal((4, 6))
    y = np.arange(4) % 3
    grads = {}
    for algo in ("auto", "shm", "ring"):
        for overlap in (False, True):
            ddp = DistributedDataParallel(
                _mlp(), world, bucket_cap_mb=1e-4, algo=algo, overlap=overlap
            )
            shared = [comm.in_shared_memory(b.data, ddp.comm_group) for b in ddp.buckets]
            assert all(shared) if algo != "ring" else not any(shared), algo
            ddp.comm_group.reset_counters()
            nn.cross_entropy(ddp(Tensor(x)), y).backward()
            ddp.finish_gradient_sync()
            # without overlap every bucket goes at the finish: in shared memory, in one call
            one_call = algo != "ring" and not overlap
            calls = ddp.comm_group.counters["allreduce"]["calls"]
            assert len(ddp.buckets) > 1 and calls == (1 if one_call else len(ddp.buckets))
            grads[algo, overlap] = [p.grad.copy() for p in ddp.parameters()]
            ddp.close()
    for key, grad in grads.items():
        for ours, ring in zip(grad, grads["ring", False], strict=True):
            assert np.array_equal(ours, ring), key


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=2)
def test_a_second_backward_before_the_sync_is_refused_not_weighed_twice():
    world = comm.world()
    x, y = np.ones((2, 6)), np.array([0, 1])
    ddp = DistributedDataParallel(_mlp(), world, algo="ring", overlap=False)
    nn.cross_entropy(ddp(Tensor(x)), y).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        nn.cross_entropy(ddp(Tensor(x)), y).backward()
    ddp.close()
