"""algo="auto": pick an algorithm by message size and group size, as MPICH does.

Short messages are latency-bound (the α terms), long ones bandwidth-bound (the nβ terms), so
the choice flips with size: lg p messages of the whole vector win when n is small, 2(p-1)
messages of n/p win when it is large. The thresholds come from
`mpiexec -n P python -m minidp bench collectives` at P = 2 and 4 on the 2-core development
machine (one run's table is in the README's "Benchmarks" section):

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
"""

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
