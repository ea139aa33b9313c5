"""Every hand-written collective against MPI's own, on 1 to 5 ranks.

This file walks dtypes x ops x lengths on one kind of group, `world().dup()` with checks on;
test_comm_group_kinds.py runs every collective over other kinds of group (reversed, split,
alternating, checks off: the fast path), on up to 7 ranks, and times the barrier.

Each test loops over algorithms x ops x dtypes x lengths inside one MPI launch (a launch
costs seconds on a small machine; a loop iteration costs microseconds). Inputs are small
integers stored in each dtype, so sums, products, maxima and minima are exact in any order:
every algorithm must match the builtin bit for bit, and every rank must hold the same bits.
`test_float_sums_are_close` covers the inexact case with random floats.

Lengths: 0, 1, p - 1, 7, 1000 for every combination; one of 2^20 + 3 elements for every
algorithm (on two dtypes and two ops, to keep the suite quick), large enough that a send/send
ordering which relies on MPI's eager buffering would deadlock.
"""

import zlib

import numpy as np
import pytest
from mpi4py import MPI

from minidp import comm

SIZES = [1, 2, 3, 4, 5]
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
BIG = (1 << 20) + 3


def lengths(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), 7, 1000})


def make(n: int, dtype, op: str, seed: int) -> np.ndarray:
    """Small integers: exact under every op in every order (prod: 1, 2, -1 only)."""
    rng = np.random.default_rng(seed)
    values = rng.choice([-1, 1, 2], n) if op == "prod" else rng.integers(-9, 10, n)
    return values.astype(dtype)


def same_on_every_rank(a: np.ndarray | None, what: str) -> None:
    digest = None if a is None else zlib.crc32(np.ascontiguousarray(a).tobytes())
    digests = MPI.COMM_WORLD.allgather(digest)
    assert len(set(digests)) == 1, f"{what}: ranks differ: {digests}"


def check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """The same shape, dtype and bytes (stricter than ==, which takes -0.0 for 0.0)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    same = np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()
    assert same, f"{what}: got {got.ravel()[:6]}, want {want.ravel()[:6]}"


def fresh_group() -> comm.Group:
    return comm.world().dup()


@pytest.mark.timeout(240)
@pytest.mark.parallel(nprocs=SIZES)
def test_allreduce_every_algorithm_op_dtype_and_length():
    g = fresh_group()
    for n in lengths(g.size):
        for dtype in DTYPES:
            for op in comm.OPS:
                x = make(n, dtype, op, seed=g.rank * 7919 + n).reshape(-1, 1)
                want = comm.allreduce(x, op=op, algo="mpi", group=g)
                for algo in comm.ALGORITHMS["allreduce"]:
                    what = f"allreduce {algo} {op} {np.dtype(dtype)} n={n} p={g.size}"
                    got = comm.allreduce(x, op=op, algo=algo, group=g)
                    check(got, want, what)
                    inplace = x.copy()
                    assert (
                        comm.allreduce(inplace, op=op, algo=algo, group=g, out=inplace) is inplace
                    )
                    check(inplace, want, what + " in place")
                    same_on_every_rank(got, what)
    for dtype in (np.float32, np.int64):
        for op in ("sum", "max"):
            x = make(BIG, dtype, op, seed=g.rank)
            want = comm.allreduce(x, op=op, algo="mpi", group=g)
            out = np.empty_like(x)
            for algo in comm.ALGORITHMS["allreduce"]:
                comm.allreduce(x, op=op, algo=algo, group=g, out=out)
                check(out, want, f"allreduce {algo} {op} n={BIG}")
            same_on_every_rank(out, "allreduce big")


@pytest.mark.timeout(240)
@pytest.mark.parallel(nprocs=SIZES)
def test_float_sums_are_close_and_identical_across_ranks():
    g = fresh_group()
    for dtype, rtol in ((np.float32, 1e-5), (np.float64, 1e-12), (np.float16, 1e-2)):
        for n in (1000, BIG if dtype == np.float32 else 1000):
            x = np.random.default_rng(g.rank).standard_normal(n).astype(dtype)
            want = comm.allreduce(x.astype(np.float64), algo="mpi", group=g)
            for algo in comm.ALGORITHMS["allreduce"]:
                got = comm.allreduce(x, op="avg", algo=algo, group=g)
                np.testing.assert_allclose(got, want / g.size, rtol=rtol, atol=rtol * 4)
                same_on_every_rank(got, f"{algo} avg {np.dtype(dtype)}")
            chunk = comm.reduce_scatter(x, algo="ring", group=g)
            b = comm.chunk_bounds(n, g.size)
            np.testing.assert_allclose(
                chunk, want[b[g.rank] : b[g.rank + 1]], rtol=rtol, atol=rtol * 4
            )


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_signed_zeros_and_nans_still_give_the_same_bits_on_every_rank():
    """max(-0.0, 0.0) and max(0.0, -0.0) differ in bits, as do NaN sums in either order."""
    g = fresh_group()
    rng = np.random.default_rng(g.rank)
    x = rng.choice([0.0, -0.0, np.nan, -np.nan, 1.0], 64)
    for algo in comm.ALGORITHMS["allreduce"]:
        if algo == "mpi":  # MPICH's own allreduce gives ranks NaNs of different signs here
            continue
        for op in ("sum", "max", "min"):
            same_on_every_rank(comm.allreduce(x, op=op, algo=algo, group=g), f"{algo} {op}")


@pytest.mark.timeout(240)
@pytest.mark.parallel(nprocs=SIZES)
def test_reduce_scatter_and_allgather_are_inverse_through_chunk_bounds():
    g = fresh_group()
    p, r = g.size, g.rank
    for n in lengths(p) + [BIG]:
        b = comm.chunk_bounds(n, p)
        for dtype in DTYPES if n < BIG else [np.float32]:
            for op in comm.OPS if n < BIG else ["sum"]:
                x = make(n, dtype, op, seed=r * 31 + n)
                full = comm.allreduce(x, op=op, algo="mpi", group=g)
                for algo in comm.ALGORITHMS["reduce_scatter"]:
                    chunk = comm.reduce_scatter(x, op=op, algo=algo, group=g)
                    check(chunk, full[b[r] : b[r + 1]], f"reduce_scatter {algo} {op} n={n}")
            whole = make(n, dtype, "sum", seed=n)  # the same on every rank
            mine = whole[b[r] : b[r + 1]].copy()
            for algo in comm.ALGORITHMS["allgather"]:
                out = np.zeros(n, dtype)
                assert comm.allgather(mine, algo=algo, group=g, out=out) is out
                check(out, whole, f"allgather {algo} n={n}")
                inplace = np.zeros(n, dtype)
                inplace[b[r] : b[r + 1]] = mine
                comm.allgather(inplace[b[r] : b[r + 1]], algo=algo, group=g, out=inplace)
                check(inplace, whole, f"allgather {algo} n={n} in place")
    row = np.full((2, 3), r, np.int32)
    stacked = comm.allgather(row, group=g)
    check(stacked, np.arange(p, dtype=np.int32).repeat(6).reshape(p, 2, 3), "allgather rows")


@pytest.mark.timeout(240)
@pytest.mark.parallel(nprocs=SIZES)
def test_rooted_collectives_from_every_root():
    g = fresh_group()
    p, r = g.size, g.rank
    for root in range(p):
        for n in lengths(p) + [BIG]:
            dtypes = DTYPES if n < BIG else [np.float64]
            for dtype in dtypes:
                theirs = make(n, dtype, "sum", seed=1000 + root + n)
                for algo in comm.ALGORITHMS["broadcast"]:
                    x = theirs.copy() if r == root else np.zeros(n, dtype)
                    assert comm.broadcast(x, root=root, algo=algo, group=g) is x
                    check(x, theirs, f"broadcast {algo} root={root} n={n}")
                for op in comm.OPS if n < BIG else ["sum"]:
                    x = make(n, dtype, op, seed=r * 13 + n)
                    want = comm.allreduce(x, op=op, algo="mpi", group=g)
                    for algo in comm.ALGORITHMS["reduce"]:
                        got = comm.reduce(x, op=op, root=root, algo=algo, group=g)
                        assert (got is None) == (r != root)
                        if r == root:
                            check(got, want, f"reduce {algo} {op} root={root} n={n}")
                        y = x.copy()
                        comm.reduce(y, op=op, root=root, algo=algo, group=g, out=y)
                        if r == root:
                            check(y, want, f"reduce {algo} in place root={root} n={n}")
        rows = np.arange(p * 3, dtype=np.int64).reshape(p, 3) * (root + 1)
        mine = make(5, np.float32, "sum", seed=r).reshape(5, 1)
        everyone = np.stack([make(5, np.float32, "sum", seed=i).reshape(5, 1) for i in range(p)])
        for algo in comm.ALGORITHMS["gather"]:
            got = comm.gather(mine, root=root, algo=algo, group=g)
            if r == root:
                check(got, everyone, f"gather {algo} root={root}")
            else:
                assert got is None
        for algo in comm.ALGORITHMS["scatter"]:
            x = rows if r == root else np.zeros_like(rows)
            check(comm.scatter(x, root=root, algo=algo, group=g), rows[r], f"scatter {algo}")
            out = np.empty(3, np.int64)
            comm.scatter(rows if r == root else None, root=root, algo=algo, group=g, out=out)
            check(out, rows[r], f"scatter {algo} root={root} into out")


@pytest.mark.timeout(120)
@pytest.mark.parallel(nprocs=SIZES)
def test_alltoall_transposes():
    g = fresh_group()
    p, r = g.size, g.rank
    for m in (0, 1, 1000, 70_000):
        x = (np.arange(p)[:, None] * 100 + r + np.zeros((p, m))).astype(np.int64)
        want = (r * 100 + np.arange(p)[:, None] + np.zeros((p, m))).astype(np.int64)
        for algo in comm.ALGORITHMS["alltoall"]:
            check(comm.alltoall(x, algo=algo, group=g), want, f"alltoall {algo} m={m}")
