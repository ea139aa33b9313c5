"""Shared test set-up.

Parallel tests use mpi-pytest's marker, `@pytest.mark.parallel(nprocs=[2, 3, 4])`: the plain
`python -m pytest` run launches each one under `mpiexec -n N`. A failing assertion on one
rank must fail the test on every rank together, never leave the others waiting in a
collective, so a parallel child that fails prints its report and calls `MPI_Abort`.

mpi-pytest only sees a parallel child's exit code, so a skip there would read as a pass: a
parallel child that skips fails instead (keep skips in serial tests).

Tests that need PyTorch carry `@pytest.mark.torch`. Where torch does not import they are
skipped here, at collection, so no parallel child is ever launched for them (mpi-pytest would
read a skip inside a child as a pass, and an ImportError there as a failure). CI runs the
README's commands first, without torch, then installs it and selects only these with
`MINIDP_REQUIRE_TORCH=1 python -m pytest -m torch`: with that variable a missing or broken
torch is an error of the whole run instead of a skip.
"""

import functools
import os

import pytest

os.environ.setdefault("MINIDP_CHECKS", "1")  # checks on, as by default (unless set to 0)
if "_PYTEST_MPI_CHILD_PROCESS" not in os.environ:
    # mpi-pytest starts a pytest in every rank of each parallel test. Only serial tests use
    # hypothesis, and its plugin's import took 0.7 of a child's 1.2 s start here: children
    # (which inherit this variable; this process read its own options already) skip it
    os.environ["PYTEST_ADDOPTS"] = f"{os.environ.get('PYTEST_ADDOPTS', '')} -p no:hypothesispytest"


def _in_parallel_child() -> bool:
    if "_PYTEST_MPI_CHILD_PROCESS" not in os.environ:
        return False
    from mpi4py import MPI

    return MPI.COMM_WORLD.size > 1


@functools.cache
def torch_import_error() -> Exception | None:
    """None if torch imports, else why not (an ImportError, or a broken install's OSError)."""
    try:
        import torch  # noqa: F401
    except Exception as error:
        return error
    return None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "torch: needs PyTorch; skipped at collection where torch does not import"
    )
    if (
        os.environ.get("MINIDP_REQUIRE_TORCH") == "1"
        and "_PYTEST_MPI_CHILD_PROCESS" not in os.environ
    ):
        error = torch_import_error()
        if error is not None:
            raise pytest.UsageError(
                f"MINIDP_REQUIRE_TORCH=1 but torch does not import ({type(error).__name__}: "
                f"{error}): the torch comparisons must run, not skip"
            ) from error


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked `torch` at collection where torch does not import."""
    marked = [item for item in items if item.get_closest_marker("torch")]
    if not marked or torch_import_error() is None:
        return
    skip = pytest.mark.skip(
        reason="torch is not installed (a CPU build: pip install torch==2.13.0, or PyTorch's "
        "CPU package index)"
    )
    for item in marked:
        item.add_marker(skip)


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
