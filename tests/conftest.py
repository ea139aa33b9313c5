"""Shared test set-up.

Parallel tests use mpi-pytest's marker, `@pytest.mark.parallel(nprocs=[2, 3, 4])`: the plain
`python -m pytest` run launches each one under `mpiexec -n N`. A failing assertion on one
rank must fail the test on every rank together, never leave the others waiting in a
collective, so a parallel child that fails prints its report and calls `MPI_Abort`.
"""

import os

import pytest

os.environ.setdefault("MINIDP_CHECKS", "1")  # cross-rank fingerprint checks on in tests


def _in_parallel_child() -> bool:
    if "_PYTEST_MPI_CHILD_PROCESS" not in os.environ:
        return False
    from mpi4py import MPI

    return MPI.COMM_WORLD.size > 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _in_parallel_child():
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.rank
        print(
            f"\n[rank {rank}] FAILED {item.nodeid} ({report.when}):\n{report.longreprtext}",
            flush=True,
        )
        MPI.COMM_WORLD.Abort(1)
