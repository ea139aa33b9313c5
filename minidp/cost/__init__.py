"""The cost of every collective algorithm of minidp.comm, without running it.

    sent("allreduce", "ring", p=4, rank=1, n=10)   -> Traffic(messages=6, bytes=120)
    time("allreduce", "ring", p=4, n=1 << 20, alpha=5e-6, beta=1e-10, gamma=1e-10, delta=8e-11)

`sent` is exact: the messages and bytes rank `rank` of p sends in one call, the same
numbers `group.counters[collective]` adds up ("messages_sent", "bytes_sent"; the tests check
every algorithm at p = 2..7). It walks each algorithm's step table (messages.py). `time` is
the α-β-γ model of the whole call, the slowest rank's path (formulas.py, one formula a
function), plus δ per byte it copies in memory beside its messages (`copied`); None for
"mpi" and "shm", which are not made of minidp's messages.

n is the whole vector in elements (the gathered result for allgather, gather, scatter and
alltoall), itemsize its bytes per element; `root` matters to the rooted collectives only.
algo="auto" is the algorithm minidp.comm.auto would pick for these bytes and p (for
allreduce, "shm" only when the array lies in shared memory: pass "shm" then).

Pure Python: this package imports without MPI, except that resolving "auto" reads
minidp.comm.auto, so that the thresholds live in one place.

Read in this order: messages.py and formulas.py (one collective) -> calls.py (the
collectives of a step) -> compute.py -> step.py (one training step: Layout, Network,
predict), ps_step.py and pp_step.py (the parameter server's, the pipeline's) -> scale.py,
report.py, chrome.py (simulate's sweep, its tables and trace). Then the cost model applied
to the command line's runs, a tool beside the face (it reads TrainConfig; the face runs it
by name): predict.py (`python -m minidp predict`, with predict_compute, predict_compress,
predict_pp, predict_ps), predicted.py (a --json run's predicted_* fields, made on its
ranks), simulate.py (`python -m minidp simulate`) and schedule.py (`python -m minidp
schedule`: a pipeline schedule's bubble in unit time).
"""

from collections.abc import Callable
from typing import NamedTuple

from minidp.cost import formulas as f
from minidp.cost import messages as m
from minidp.cost.formulas import Terms
from minidp.cost.messages import shm_loaded
from minidp.tools.names import table


class Traffic(NamedTuple):
    """What one rank sends in one call: as group.counters counts it."""

    messages: int
    bytes: int


class Model(NamedTuple):
    """One algorithm's cost: the messages a rank sends, and the time of the whole call."""

    sent: Callable  # (p, rank, n, root) -> sizes in elements, one per message
    time: Callable  # (Terms, α, β, γ) -> seconds, or None


def _costs(collective: str, **algorithms: tuple) -> dict:
    """{algorithm: Model} for one collective, checked against names.ALGORITHMS."""
    return table(collective, {name: Model(*pair) for name, pair in algorithms.items()})


NONE = (m.none, f.unknown)  # MPI's own: no minidp message, no formula
COSTS = {
    "allreduce": _costs(
        "allreduce",
        ring=(m.ring_allreduce, f.ring_allreduce),
        recursive_doubling=(m.recursive_doubling_allreduce, f.recursive_doubling_allreduce),
        rabenseifner=(m.rabenseifner_allreduce, f.rabenseifner_allreduce),
        tree=(m.tree_allreduce, f.tree_allreduce),
        naive=(m.naive_allreduce, f.naive_allreduce),
        shm=(m.none, f.unknown),  # no messages; sent() adds the bytes others load
        mpi=NONE,
    ),
    "reduce_scatter": _costs(
        "reduce_scatter",
        ring=(m.ring_reduce_scatter, f.ring_reduce_scatter),
        recursive_halving=(m.recursive_halving_reduce_scatter, f.recursive_halving_reduce_scatter),
        naive=(m.naive_reduce_scatter, f.naive_reduce_scatter),
        mpi=NONE,
    ),
    "allgather": _costs(
        "allgather",
        ring=(m.ring_allgather, f.ring_allgather),
        recursive_doubling=(m.recursive_doubling_allgather, f.recursive_doubling_allgather),
        naive=(m.naive_allgather, f.naive_allgather),
        mpi=NONE,
    ),
    "broadcast": _costs(
        "broadcast",
        tree=(m.tree_broadcast, f.tree_broadcast),
        ring=(m.ring_broadcast, f.ring_broadcast),
        naive=(m.naive_broadcast, f.naive_broadcast),
        mpi=NONE,
    ),
    "reduce": _costs(
        "reduce",
        tree=(m.tree_reduce, f.tree_reduce),
        ring=(m.ring_reduce, f.ring_reduce),
        naive=(m.naive_reduce, f.naive_reduce),
        mpi=NONE,
    ),
    "gather": _costs(
        "gather",
        tree=(m.tree_gather, f.tree_scatter),
        naive=(m.naive_gather, f.naive_rows),
        mpi=NONE,
    ),
    "scatter": _costs(
        "scatter",
        tree=(m.tree_scatter, f.tree_scatter),
        naive=(m.naive_scatter, f.naive_rows),
        mpi=NONE,
    ),
    "alltoall": _costs(
        "alltoall", pairwise=(m.alltoall, f.naive_rows), naive=(m.alltoall, f.naive_rows), mpi=NONE
    ),
    "barrier": _costs("barrier", dissemination=(m.dissemination_barrier, f.barrier), mpi=NONE),
}
"""collective -> algorithm -> Model, in the order of minidp/tools/names.py."""


def resolve(collective: str, algo: str, p: int, nbytes: int) -> str:
    """The algorithm that runs: algo itself, or auto's choice for nbytes on p ranks."""
    if algo != "auto":
        if algo not in COSTS[collective]:
            raise ValueError(f"unknown algo {algo!r} for {collective}")
        return algo
    from minidp.comm.auto import choose  # the one copy of the thresholds (imports MPI)

    return choose(collective, nbytes, p)


def sent(
    collective: str, algo: str, p: int, rank: int, n: int, itemsize: int = 8, root: int = 0
) -> Traffic:
    """Messages and bytes rank `rank` of p sends in one call on n elements of itemsize."""
    if not 0 <= rank < p or not 0 <= root < p:
        raise ValueError(f"rank {rank} and root {root} must lie in [0, {p})")
    algo = resolve(collective, algo, p, n * itemsize)
    if p == 1:  # a group of one sends nothing
        return Traffic(0, 0)
    sizes = COSTS[collective][algo].sent(p, rank, n, root)
    loaded = shm_loaded(p, rank, n) if algo == "shm" else 0
    return Traffic(len(sizes), (sum(sizes) + loaded) * itemsize)


def time(
    collective: str,
    algo: str,
    p: int,
    n: int,
    itemsize: int = 8,
    *,
    alpha: float,
    beta: float,
    gamma: float = 0.0,
    delta: float = 0.0,
    in_place: bool = False,
) -> float | None:
    """Seconds for the whole call in the α-β-γ model (formulas.py); None: no model.

    delta: seconds per byte copied in memory (`copied`: an allgather's own chunk, unless
    in_place, a reduce-scatter's result out of an accumulator, an alltoall's own row), which
    the messages' formulas do not count; in_place=True: the allgather's chunk lies in out."""
    algo = resolve(collective, algo, p, n * itemsize)
    if p == 1:
        return 0.0
    terms = Terms(p, n, itemsize)
    seconds = COSTS[collective][algo].time(terms, alpha, beta, gamma)
    if seconds is not None:
        seconds += copied(collective, algo, terms, in_place) * delta
    return seconds


def copied(collective: str, algo: str, t: Terms, in_place: bool = False) -> float:
    """Bytes a call copies in memory beside its messages, on its slowest path: an allgather
    its own chunk into out (collectives.allgather, unless it is there already), recursive
    halving and the naive root their reduced chunk out of an accumulator (recursive.py,
    naive.py), an alltoall its own row (alltoall.py). tests/test_cost.py counts the comm
    code's copies against these. Not counted: gather's and scatter's own row (and the root's
    rotation)."""
    if collective == "allgather":
        return 0 if in_place else t.C
    if collective == "reduce_scatter" and algo in ("recursive_halving", "naive"):
        return t.C
    return t.M if collective == "alltoall" else 0


__all__ = ["COSTS", "Model", "Traffic", "copied", "resolve", "sent", "time"]
