"""The names every part of minidp agrees on: collectives, their algorithms, reduction ops.

One list, read by everyone, so that a name added in one place cannot be missing in another:

    comm/collectives.py, comm/rooted.py   build their tables of functions with `table()`,
                                          which refuses one that disagrees with ALGORITHMS
    comm/checks.py                        numbers these names in the fingerprint
    comm/auto.py                          picks among them (checked when it is imported)
    comm/reduce_ops.py                    the reduction ops, OPS
    training/config.py                    --allreduce choices: AUTO + ALGORITHMS["allreduce"];
                                          --schedule choices: PIPELINE_SCHEDULES
    parallel/pipeline/schedules.py        SCHEDULES, refused at import unless it names
                                          exactly PIPELINE_SCHEDULES
    benchmarks, tests                     loop over them (as comm.ALGORITHMS, the same dict)

Pure Python, no MPI: training/config.py imports it without starting MPI. To add an
algorithm, write it, add its name here, and add the function to its collective's table.
"""

AUTO = "auto"
"""The algorithm name that means "let comm/auto.py choose"; never sent in a fingerprint."""

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("ring", "recursive_doubling", "rabenseifner", "tree", "naive", "shm", "mpi"),
    "reduce_scatter": ("ring", "recursive_halving", "naive", "mpi"),
    "allgather": ("ring", "recursive_doubling", "naive", "mpi"),
    "broadcast": ("tree", "ring", "naive", "mpi"),
    "reduce": ("tree", "ring", "naive", "mpi"),
    "gather": ("tree", "naive", "mpi"),
    "scatter": ("tree", "naive", "mpi"),
    "alltoall": ("pairwise", "naive", "mpi"),
    "barrier": ("dissemination", "mpi"),
}
"""The algorithms each collective accepts besides AUTO, in the order benchmarks list them."""

COLLECTIVES: tuple[str, ...] = tuple(ALGORITHMS)
"""Every collective of minidp.comm."""

OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "prod")
"""The reduction ops of allreduce, reduce_scatter and reduce."""

PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")
"""The pipeline schedules (parallel/pipeline/schedules.py's SCHEDULES), in its order."""


def table(collective: str, functions: dict) -> dict:
    """functions ({algorithm name: function}), checked to name exactly ALGORITHMS[collective].

    ValueError (at import of the module that builds the table) if the names or their order
    differ, so a new algorithm cannot run unless it is listed here too.
    """
    listed = ALGORITHMS[collective]
    if tuple(functions) != listed:
        raise ValueError(
            f"the {collective} table names {tuple(functions)} but minidp/tools/names.py lists "
            f"{listed}: add the name to names.ALGORITHMS[{collective!r}] (same order)"
        )
    return functions
