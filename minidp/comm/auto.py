"""algo="auto": pick an algorithm by message size and group size, as MPICH does.

Short messages are latency-bound (the α terms), long ones bandwidth-bound (the nβ terms), so
the choice flips with size: lg p messages of the whole vector win when n is small, 2(p-1)
messages of n/p win when it is large. The thresholds come from
`mpiexec -n P python -m minidp bench collectives` at P = 2 and 4 on the 2-core development
machine (one run's table is in docs/collectives.md):

    allreduce        n <= 64 KiB: recursive_doubling   fastest of ours at 4 and 64 KiB on 2 and
                                                       4 ranks (each call is dominated by its
                                                       ~lg p message latencies)
                     otherwise: ring                   fastest from 1 MiB up (Rabenseifner, the
                                                       same bytes in lg p steps, ties with it
                                                       on these few ranks and needs the fold)
    reduce_scatter,  p a power of 2 and n <= 64 KiB:   recursive_halving / recursive_doubling
    allgather        otherwise: ring
    broadcast,       n <= 8 MiB or p <= 2: tree        lg p·nβ is no worse than the ~2nβ of
    reduce           otherwise: ring                   scatter + allgather until lg p > 2 and
                                                       messages are long (tree and ring tie at
                                                       16 MiB on 4 ranks; ring wins at 64 MiB)
    gather, scatter  tree when p > 2, else naive;   alltoall: pairwise;
    barrier          dissemination

An allreduce of an array in shared memory (shared_zeros; DDP's buckets, shm_arena.py) may
also be reduced by loads, "shm" (shm.py), whose three synchronizations of all ranks cost
more than the ring's messages on small arrays (2 ranks: shm 36 µs against the ring's 19 at
64 KiB, 55 against 38 at 256 KiB, a tie at 512 KiB; docs/collectives.md). `choose_shared`
picks "shm" from SHM_MIN up and the ring below: shm sums each chunk in the ring's order, so
the bits are the same on either side of the threshold, and retuning it never changes a
training run's bits (recursive doubling, faster at 4 KiB by ~1.5 µs a call, would change
them at 4 ranks and more). DDP's buckets (collectives.allreduce_coalesced, and one by one
with overlap) and the cost model's pricing of them (cost/calls.py) both ask this one
function, so they cannot differ.

Rerun the benchmark to retune these for another machine: the crossover moves with α/β.
Every name choose() can return is one of minidp/tools/names.py's, checked when this module loads.
"""

from minidp.tools.names import ALGORITHMS

SHORT = 64 * 1024
LONG = 8 * 1024 * 1024
SHM_MIN = 512 * 1024  # shm from here up; below, it lost to the ring (docs/collectives.md)


def _power_of_two(p: int) -> bool:
    return p & (p - 1) == 0


def choose(collective: str, nbytes: int, p: int) -> str:
    """The algorithm "auto" means for this collective, message size and group size."""
    if collective == "allreduce":
        return "recursive_doubling" if nbytes <= SHORT else "ring"
    if collective in ("reduce_scatter", "allgather"):
        if _power_of_two(p) and nbytes <= SHORT:
            return "recursive_halving" if collective == "reduce_scatter" else "recursive_doubling"
        return "ring"
    if collective in ("broadcast", "reduce"):
        return "tree" if nbytes <= LONG or p <= 2 else "ring"
    if collective in ("gather", "scatter"):
        return "tree" if p > 2 else "naive"
    return {"alltoall": "pairwise", "barrier": "dissemination"}[collective]


def choose_shared(nbytes: int, p: int) -> str:
    """The algorithm "auto" means for an allreduce of nbytes lying in shared memory (p, the
    group's size, for a rule that one day depends on it)."""
    return "shm" if nbytes >= SHM_MIN else "ring"


def _check_choices() -> None:
    """ValueError unless every branch of choose() names an algorithm names.ALGORITHMS lists.

    These sizes and group sizes reach every branch above: n small or past each threshold,
    p = 1, 2, 4 (powers of two, p <= 2) and 3 (neither)."""
    for collective, listed in ALGORITHMS.items():
        for nbytes in (0, SHORT + 1, LONG + 1):
            for p in (1, 2, 3, 4):
                algo = choose(collective, nbytes, p)
                if algo not in listed:
                    raise ValueError(
                        f"auto.choose({collective!r}, {nbytes}, {p}) returns {algo!r}, which "
                        f"minidp/tools/names.py does not list for {collective}: {listed}"
                    )


_check_choices()
