"""Shared test set-up.

Parallel tests use mpi-pytest's marker, `@pytest.mark.parallel(nprocs=[2, 3, 4])`: the plain
`python -m pytest` run launches each one under `mpiexec -n N`. A failing assertion on one
rank must fail the test on every rank together, never leave the others waiting in a
collective, so a parallel child that fails prints its report and calls `MPI_Abort`.

mpi-pytest only sees a parallel child's exit code, so a skip there would read as a pass: a
parallel child that skips fails instead (keep skips in serial tests).

`MINIDP_REQUIRE_TORCH=1` (CI sets it) makes a missing or broken torch an error of the whole
run, where the torch comparisons would otherwise skip.
"""

import os

import pytest

os.environ.setdefault("MINIDP_CHECKS", "1")  # checks on, as by default (unless set to 0)


def _in_parallel_child() -> bool:
    if "_PYTEST_MPI_CHILD_PROCESS" not in os.environ:
        return False
    from mpi4py import MPI

    return MPI.COMM_WORLD.size > 1


def pytest_configure(config):
    if (
        os.environ.get("MINIDP_REQUIRE_TORCH") == "1"
        and "_PYTEST_MPI_CHILD_PROCESS" not in os.environ
    ):
        try:
            import torch  # noqa: F401
        except Exception as error:  # ImportError, or a broken install's OSError and others
            raise pytest.UsageError(
                f"MINIDP_REQUIRE_TORCH=1 but torch does not import ({type(error).__name__}: "
                f"{error}): the torch comparisons must run, not skip"
            ) from error


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _in_parallel_child():
        report.outcome = "failed"  # the parent would count the skip as a pass
        report.longrepr = f"a parallel test skipped ({report.longrepr}): restructure it"
    if report.failed and _in_parallel_child():
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.rank
        print(
            f"\n[rank {rank}] FAILED {item.nodeid} ({report.when}):\n{report.longreprtext}",
            flush=True,
        )
        MPI.COMM_WORLD.Abort(1)
