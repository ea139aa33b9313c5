"""minidp.cost against the counters: every algorithm of every collective, p = 2..7.

One launch of 7 ranks splits into groups of p = 2..7 (as many side by side as fit); each
group runs every (collective, algorithm) of names.ALGORITHMS, "auto" included, on lengths
0, 1, p - 1 and 1000 of float64 (rooted ones at root 0 and the last rank), plus 16 MiB
for the ring and Rabenseifner's allreduce, and each rank checks that its own counters grew
by exactly cost.sent()'s messages and bytes. Then, without MPI, the time formulas against the
docstrings' closed forms.
"""

import contextlib

import numpy as np
import pytest

from minidp import comm, cost
from minidp.comm import fast_path
from minidp.cost.formulas import Terms
from minidp.tools.names import ALGORITHMS

BIG = 2 * 1024 * 1024  # float64 elements: 16 MiB


def run(collective: str, algo: str, group, n: int, root: int) -> None:
    """One call of the collective on n float64 elements in all (as cost.sent counts n)."""
    from minidp import comm
    from minidp.tools.chunks import chunk_bounds

    p, r = group.size, group.rank
    x = np.ones(n)
    if collective in ("allreduce", "reduce_scatter"):
        getattr(comm, collective)(x, algo=algo, group=group)
    elif collective == "allgather":
        lo, hi = chunk_bounds(n, p)[r : r + 2]
        comm.allgather(x[lo:hi].copy(), algo=algo, group=group, out=np.empty(n))
    elif collective in ("broadcast", "reduce"):
        getattr(comm, collective)(x, root=root, algo=algo, group=group)
    elif collective == "gather":
        comm.gather(np.ones(n // p), root=root, algo=algo, group=group)
    elif collective == "scatter":
        comm.scatter(x.reshape(p, -1), root=root, algo=algo, group=group)
    elif collective == "alltoall":
        comm.alltoall(x.reshape(p, -1), algo=algo, group=group)
    else:
        comm.barrier(group=group, algo=algo)


def cases(p: int):
    """(collective, algorithm, n, root): n is p rows of 0, 1, p - 1 or 1000 for the
    collectives that take rows; the rooted ones run at root 0 and at the last rank."""
    rows = ("gather", "scatter", "alltoall")
    for collective, algos in ALGORITHMS.items():
        lengths = [0] if collective == "barrier" else [0, 1, p - 1, 1000]
        roots = [0, p - 1] if collective in ("broadcast", "reduce", "gather", "scatter") else [0]
        for algo in ("auto", *algos):
            for n in lengths:
                for root in roots:
                    yield collective, algo, n * p if collective in rows else n, root
    for algo in ("ring", "rabenseifner"):
        yield "allreduce", algo, BIG, 0


@pytest.mark.parallel(nprocs=[7])
@pytest.mark.timeout(120)
def test_sent_is_what_the_counters_count():
    from minidp import comm

    world, wrong, checked, joined = comm.world(), [], 0, []
    for p in range(2, 8):
        color = world.rank // p
        group = world.split(color if color < world.size // p else None)
        if group is None:
            continue
        joined.append(p)
        for collective, algo, n, root in cases(p):
            before = dict(group.counters.get(collective, {}))
            run(collective, algo, group, n, root)
            after = group.counters[collective]
            got = cost.Traffic(
                after["messages_sent"] - before.get("messages_sent", 0),
                after["bytes_sent"] - before.get("bytes_sent", 0),
            )
            want = cost.sent(collective, algo, p, group.rank, n, 8, root)
            checked += 1
            if got != want:
                wrong.append(
                    f"{collective} {algo} p={p} root={root} rank={group.rank} n={n}: {got} {want}"
                )
        group.free()
    assert not wrong, "\n".join(wrong)
    assert joined and checked == sum(len(list(cases(p))) for p in joined)


# ---- the formulas, without MPI -------------------------------------------------------------
A, B, G = 3e-6, 2e-10, 5e-11  # α, β, γ: distinct scales, so a misplaced term shows


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8])
def test_ring_and_tree_match_their_docstrings(p):
    n = 12 * 35 * 8  # divisible by every p here, so C = N/p
    N = n * 8
    L = (p - 1).bit_length()
    want = {
        ("allreduce", "ring"): 2 * (p - 1) * A + 2 * (p - 1) / p * N * B + (p - 1) / p * N * G,
        ("reduce_scatter", "ring"): (p - 1) * A + (p - 1) / p * N * (B + G),
        ("allgather", "ring"): (p - 1) * A + (p - 1) / p * N * B,
        ("allreduce", "tree"): 2 * L * (A + N * B) + L * N * G,
        ("allreduce", "naive"): 2 * (p - 1) * (A + N * B) + (p - 1) * N * G,
        ("broadcast", "tree"): L * (A + N * B),
        ("gather", "tree"): L * A + (p - 1) / p * N * B,
        ("alltoall", "pairwise"): (p - 1) * (A + N / p * B),
        ("barrier", "dissemination"): L * A,
    }
    for (collective, algo), seconds in want.items():
        got = cost.time(collective, algo, p, n, alpha=A, beta=B, gamma=G)
        assert got == pytest.approx(seconds, rel=1e-12), (collective, algo)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_butterflies_match_their_docstrings_at_powers_of_two(p):
    n, lg = 1 << 12, p.bit_length() - 1
    N = n * 8
    want = {
        ("allreduce", "recursive_doubling"): lg * (A + N * B + N * G),
        ("allreduce", "rabenseifner"): 2 * lg * A + (p - 1) / p * N * (2 * B + G),
        ("reduce_scatter", "recursive_halving"): lg * A + (p - 1) / p * N * (B + G),
        ("allgather", "recursive_doubling"): lg * A + (p - 1) / p * N * B,
    }
    for (collective, algo), seconds in want.items():
        got = cost.time(collective, algo, p, n, alpha=A, beta=B, gamma=G)
        assert got == pytest.approx(seconds, rel=1e-12), (collective, algo)


def test_the_fold_adds_two_messages_of_the_vector():
    """p = 6 folds onto p' = 4: α + Nβ + Nγ before the butterfly, α + Nβ after."""
    n, N = 4096, 4096 * 8
    at4 = cost.time("allreduce", "recursive_doubling", 4, n, alpha=A, beta=B, gamma=G)
    at6 = cost.time("allreduce", "recursive_doubling", 6, n, alpha=A, beta=B, gamma=G)
    assert at6 == pytest.approx(at4 + 2 * A + 2 * N * B + N * G, rel=1e-12)


@pytest.mark.parametrize("p", [2, 3, 5, 7])
def test_delta_prices_what_a_call_copies_beside_its_messages(p):
    """collectives.allgather copies x into its chunk of out first: C bytes at δ, nothing in
    place; recursive halving copies its chunk out, an alltoall its own row; a ring, none."""
    n, D = 1001, 3e-11
    C = -(-n // p) * 8
    for algo in ("ring", "recursive_doubling", "naive"):
        plain = cost.time("allgather", algo, p, n, alpha=A, beta=B, gamma=G)
        copied = cost.time("allgather", algo, p, n, alpha=A, beta=B, gamma=G, delta=D)
        assert copied == pytest.approx(plain + C * D, rel=1e-12), algo
        in_place = cost.time("allgather", algo, p, n, alpha=A, beta=B, delta=D, in_place=True)
        assert in_place == cost.time("allgather", algo, p, n, alpha=A, beta=B)
    for collective, algo, extra in (
        ("allreduce", "ring", 0),
        ("reduce_scatter", "ring", 0),
        ("reduce_scatter", "recursive_halving", C),  # its chunk, out of the accumulator
        ("alltoall", "pairwise", n * 8 / p),  # its own row
    ):
        with_delta = cost.time(collective, algo, p, n, alpha=A, beta=B, gamma=G, delta=D)
        plain = cost.time(collective, algo, p, n, alpha=A, beta=B, gamma=G)
        assert with_delta == pytest.approx(plain + extra * D, rel=1e-12), (collective, algo)


def test_ring_bytes_are_2_p_minus_1_over_p_n_on_average():
    """Uneven chunks: rank r sends n - c_r and n - c_(r+1), 2(p-1)n over all ranks."""
    for p in range(2, 8):
        for n in (0, 1, p - 1, 1001):
            total = sum(cost.sent("allreduce", "ring", p, r, n).bytes for r in range(p))
            assert total == 2 * (p - 1) * n * 8


def test_what_has_no_model_says_so():
    assert cost.time("allreduce", "mpi", 4, 100, alpha=A, beta=B) is None
    assert cost.time("allreduce", "shm", 4, 100, alpha=A, beta=B) is None
    assert cost.sent("allreduce", "shm", 4, 0, 100).messages == 0
    assert cost.sent("allreduce", "mpi", 4, 0, 100) == (0, 0)
    assert cost.time("allreduce", "ring", 1, 100, alpha=A, beta=B) == 0.0
    with pytest.raises(ValueError, match="unknown algo"):
        cost.sent("allreduce", "bogus", 4, 0, 100)


COPIED = (
    [  # (collective, algorithm): every one with a formula whose call copies or may
        ("allreduce", a) for a in ("ring", "recursive_doubling", "rabenseifner", "tree", "naive")
    ]
    + [("reduce_scatter", a) for a in ("ring", "recursive_halving", "naive")]
    + [("allgather", a) for a in ("ring", "recursive_doubling", "naive")]
    + [("alltoall", "pairwise"), ("alltoall", "naive")]
)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(60)
def test_copied_is_what_the_slowest_rank_copies_in_memory(monkeypatch):
    """Every np.copyto the comm code makes during one call, counted on each rank: the most
    any rank copies is cost.copied's bytes on the plain path (the slowest), and no more on
    the fast path (whose recursive halving sums its last step straight into out)."""
    group = comm.Group(comm.world().comm.Dup(), checks=False)
    p, n = group.size, 12 * 35  # elements; float64
    copied = [0]
    real = np.copyto

    def counting(dst, src, *args, **kwargs):
        copied[0] += np.asarray(dst).nbytes
        return real(dst, src, *args, **kwargs)

    monkeypatch.setattr(np, "copyto", counting)
    x = np.arange(n, dtype=np.float64) + group.rank
    for collective, algo in COPIED:
        want = cost.copied(collective, algo, Terms(p, n, 8))
        for plain in (True, False):
            copied[0] = 0
            with fast_path.plain() if plain else contextlib.nullcontext():
                if collective == "allreduce":
                    comm.allreduce(x, algo=algo, group=group, out=np.empty_like(x))
                elif collective == "reduce_scatter":
                    comm.reduce_scatter(x, algo=algo, group=group, out=np.empty(n // p))
                elif collective == "allgather":
                    comm.allgather(x[: n // p], algo=algo, group=group, out=np.empty(n))
                else:
                    out = np.empty((p, n // p))
                    comm.alltoall(x.reshape(p, -1), algo=algo, group=group, out=out)
            most = comm.allreduce(np.array(copied), op="max", group=group)[0]
            assert most == want if plain else most <= want, (collective, algo, plain, most, want)
    group.free()
