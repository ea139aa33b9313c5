"""minidp.comm pieces that need no second process: chunking, scratch, checks, bad arguments.

A group of one is still a group: every collective works on it (and must validate its
arguments the same way), so the ValueError paths are tested here, in one process.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

from minidp import comm
from minidp.comm import p2p
from minidp.comm.buffers import Scratch
from minidp.comm.checks import FIELDS, fingerprint, mismatch_report, ranges


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_chunk_bounds_cover_the_vector_in_near_equal_pieces(n, p):
    b = comm.chunk_bounds(n, p)
    assert len(b) == p + 1 and b[0] == 0 and b[-1] == n
    sizes = np.diff(b)
    assert sizes.min() >= 0 and sizes.max() - sizes.min() <= 1
    assert list(sizes) == sorted(sizes, reverse=True)  # the longer chunks come first
    assert all(comm.chunk_range(n, p, i) == (b[i], b[i + 1]) for i in range(p))
    assert [len(a) for a in np.array_split(np.arange(n), p)] == list(sizes)


def test_chunk_bounds_rejects_nonsense():
    with pytest.raises(ValueError):
        comm.chunk_bounds(5, 0)
    with pytest.raises(ValueError):
        comm.chunk_bounds(-1, 2)


def test_scratch_reuses_memory_and_only_grows():
    s = Scratch()
    a = s.get("recv", 100, np.float32)
    b = s.get("recv", 50, np.float64)
    assert a.shape == (100,) and b.shape == (50,) and np.shares_memory(a, b)
    c = s.get("recv", 1000, np.float32)
    assert not np.shares_memory(a, c) and s.nbytes >= 4000
    assert np.shares_memory(s.get("recv", 10, np.int64), c)
    assert s.get("other", 0, np.float16).size == 0


def test_fingerprint_report_names_each_call_and_its_ranks():
    table = np.zeros((4, FIELDS), np.int64)
    for rank in range(4):
        shape = (11,) if rank == 2 else (10,)
        fingerprint(table[rank], 3, "allreduce", "ring", "sum", np.dtype(np.float32), None, shape)
    report = mismatch_report(table)
    assert "ranks 0-1, 3: #3 allreduce(algo=ring, op=sum, dtype=float32, shape=(10,))" in report
    assert "rank 2: #3 allreduce(algo=ring, op=sum, dtype=float32, shape=(11,))" in report
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_auto_picks_latency_then_bandwidth_algorithms():
    assert comm.choose("allreduce", 4096, 4) == "recursive_doubling"
    assert comm.choose("allreduce", 64 << 20, 4) == "ring"
    assert comm.choose("allreduce", 64 << 20, 5) == "ring"
    for collective, algos in comm.ALGORITHMS.items():
        for nbytes in (0, 4096, 1 << 20, 64 << 20):
            for p in (1, 2, 3, 4, 8):
                assert comm.choose(collective, nbytes, p) in algos


def _one():
    return comm.Group(MPI.COMM_SELF.Dup(), checks=True)


def test_a_group_of_one_runs_every_collective():
    g, x = _one(), np.arange(6.0).reshape(2, 3)
    for algo in comm.ALGORITHMS["allreduce"]:
        assert np.array_equal(comm.allreduce(x, op="avg", algo=algo, group=g), x)
    assert np.array_equal(comm.reduce_scatter(x, group=g), x.ravel())
    assert np.array_equal(comm.allgather(x, group=g), x[None])
    assert comm.broadcast(x, root=0, group=g) is x
    assert np.array_equal(comm.reduce(x, root=0, group=g), x)
    assert np.array_equal(comm.gather(x, root=0, group=g), x[None])
    assert np.array_equal(comm.scatter(x[None], root=0, group=g), x)
    assert np.array_equal(comm.alltoall(x[None], group=g), x[None])
    comm.barrier(group=g)
    assert g.counters["allreduce"]["calls"] == len(comm.ALGORITHMS["allreduce"])


def test_max_tag_is_mpis_tag_upper_bound():
    g = _one()
    assert p2p.max_tag(g) == MPI.COMM_SELF.Get_attr(MPI.TAG_UB) >= 32767  # MPI's minimum


def _raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bad_local_arguments_raise_value_error_before_sending():
    g = _one()
    x = np.zeros(8, np.float32)
    _raises(lambda: comm.allreduce(x, op="mean", group=g), "unknown op")
    _raises(lambda: comm.allreduce(x, algo="butterfly", group=g), "unknown algo")
    _raises(lambda: comm.allreduce(x[::2], group=g), "contiguous")
    _raises(lambda: comm.allreduce([1.0, 2.0], group=g), "NumPy array")
    _raises(lambda: comm.allreduce(x, group=g, out=np.zeros(7, np.float32)), "shape")
    _raises(lambda: comm.allreduce(x, group=g, out=np.zeros(8, np.float64)), "dtype")
    _raises(lambda: comm.allreduce(x.astype(np.complex64), group=g), "dtype")
    _raises(lambda: comm.allreduce(x.astype(np.uint8), group=g), "cannot reduce")
    frozen = np.zeros(8, np.float32)
    frozen.flags.writeable = False
    _raises(lambda: comm.allreduce(x, group=g, out=frozen), "read-only")
    _raises(lambda: comm.broadcast(frozen, group=g), "read-only")
    y = np.zeros(16, np.float32)
    _raises(lambda: comm.allreduce(y[:8], group=g, out=y[4:12]), "overlaps")
    _raises(lambda: comm.broadcast(x, root=1, group=g), "root")
    _raises(lambda: comm.reduce(x, root=-1, group=g), "root")
    _raises(lambda: comm.gather(x, root=2, group=g), "root")
    _raises(lambda: comm.scatter(x, root=0, group=g), r"shape \(p, ...\)")
    _raises(lambda: comm.scatter(None, root=0, group=g), "required")
    _raises(lambda: comm.alltoall(np.zeros((2, 3)), group=g), r"shape \(p, ...\)")
    _raises(lambda: comm.allgather(x, group=g, out=np.zeros(9, np.float32)), "chunk")
    _raises(lambda: comm.allgather(y[2:10], group=g, out=y[:8]), "overlaps")
    _raises(lambda: comm.reduce_scatter(y, group=g, out=y[:16]), "overlap|shape")
    _raises(lambda: comm.barrier(group=g, algo="ring"), "unknown algo")
    _raises(lambda: g.subgroup([0, 0]), "distinct")
    assert g.counters == {}  # nothing was started, let alone sent
