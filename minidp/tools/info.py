"""`python -m minidp info`: what this process runs on, and whether MPI sees the whole world.

    mpiexec -n 4 python -m minidp info

Rank 0 prints what it sees. "world size 1" under `mpiexec -n 4` means the `mpiexec` belongs
to another MPI than the one mpi4py was built against (each process is then a world alone).
"""

import os
import platform
import sys

import numpy as np

from minidp.tools.log import print0


def blas_info() -> str:
    """'openblas 0.3.27 (Haswell), 1 thread' style summary of the BLAS numpy uses."""
    try:
        from threadpoolctl import threadpool_info

        pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    except Exception:  # threadpoolctl missing or unable to inspect: say so, do not fail
        return "blas: unknown"
    if not pools:
        return "blas: none found"
    p = pools[0]
    return (
        f"{p.get('internal_api')} {p.get('version')} ({p.get('architecture')}), "
        f"{p.get('num_threads')} threads"
    )


def mpi_library() -> str:
    """The first line of MPI_Get_library_version, e.g. 'MPICH Version: 5.0.2'."""
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_ranks() -> int:
    """How many ranks of this job share this machine, from the launcher (1 without one)."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return 1


def cores_per_rank() -> float:
    """The cores this rank can count on. A launcher that binds ranks to cores leaves each an
    affinity mask smaller than the machine: that mask is the rank's share. Unbound, the
    ranks on the machine share all its cores."""
    mask, machine = cores(), os.cpu_count() or 1
    return mask if mask < machine else machine / local_ranks()


def one_blas_thread(threads: int = 1) -> None:
    """Cap this process's BLAS pool at `threads` (default one), for the rest of the process.

    Call it once at the top of a tutorial or script that runs several ranks on one machine:
    4 ranks on 2 cores, each with OpenBLAS's own pool of spinning threads, run many times
    slower than 4 ranks of one thread each, and any timing they print is the fight, not the
    idea (`train` does the same through `--threads`). Without threadpoolctl: nothing."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=threads, user_api="blas")


def main(argv: list[str]) -> int:
    if argv:
        from minidp.tools.log import die

        raise die(f"info takes no arguments, got {' '.join(argv)}")
    from mpi4py import MPI

    import minidp

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    print0(
        f"minidp {minidp.__version__} | python {platform.python_version()} | "
        f"numpy {np.__version__}",
        rank=rank,
    )
    print0(f"BLAS: {blas_info()}", rank=rank)
    try:
        import torch

        print0(
            f"torch {torch.__version__} (cuda available: {torch.cuda.is_available()})", rank=rank
        )
    except ImportError:
        print0("torch: not installed (optional: pip install 'minidp[torch]')", rank=rank)
    print0(
        f"mpi4py {__import__('mpi4py').__version__} | MPI library: {mpi_library()}",
        rank=rank,
    )
    levels = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    print0(f"world size {size} | MPI thread level {levels[MPI.Query_thread()]}", rank=rank)
    launched = [k for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE") if int(os.environ.get(k, 1)) > 1]
    if size == 1 and launched:
        print(
            f"minidp: warning: launched as one of {os.environ[launched[0]]} processes, but MPI "
            "sees a world of size 1: the mpiexec belongs to another MPI than mpi4py's. Use the "
            "mpiexec of the same MPI (the venv's bin/ with the mpich wheel).",
            file=sys.stderr,
            flush=True,
        )
    return 0
