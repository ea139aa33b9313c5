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

Rerun the benchmark to retune these for another machine: the crossover moves with α/β.
Every name choose() can return is one of minidp/tools/names.py's, checked when this module loads.
"""

from minidp.tools.names import ALGORITHMS

SHORT = 64 * 1024
LONG = 8 * 1024 * 1024


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
