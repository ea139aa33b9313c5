"""Tutorials are tests: each runs under the launch line its header declares, with a timeout.

A tutorial's header names its launch line, `python tutorials/NN_name.py` or
`mpiexec -n N python tutorials/NN_name.py`; the tutorial checks itself with asserts. A
one-process tutorial runs with mpi4py's import blocked: it must work where no MPI library
loads (test_layering.py has the block).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_layering import BLOCK_MPI4PY

TUTORIALS = sorted((Path(__file__).parent.parent / "tutorials").glob("[0-9][0-9]_*.py"))
LAUNCH = re.compile(r"^#\s+(?:mpiexec -n (\d+) )?python (tutorials/\S+\.py)\s*$", re.MULTILINE)


def launch_line(path: Path) -> tuple[int, str]:
    match = LAUNCH.search(path.read_text())
    assert match, f"{path.name} does not declare its launch line in its header"
    assert match.group(2) == f"tutorials/{path.name}", f"{path.name} names another file"
    return int(match.group(1) or 1), match.group(2)


def test_there_are_tutorials():
    assert TUTORIALS, "no numbered tutorials found"


def with_marks(path: Path):
    """A tutorial that imports torch is marked torch (skipped at collection without it)."""
    needs_torch = re.search(r"^(import|from) torch\b", path.read_text(), re.MULTILINE)
    return pytest.param(path, id=path.stem, marks=[pytest.mark.torch] if needs_torch else [])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", [with_marks(p) for p in TUTORIALS])
def test_tutorial_runs(path):
    nprocs, script = launch_line(path)
    run = f"import runpy\nrunpy.run_path({script!r}, run_name='__main__')\n"
    cmd = [sys.executable, "-c", BLOCK_MPI4PY + run]
    if nprocs > 1:  # `-m mpi4py`: an uncaught error on one rank aborts all, never a hang
        cmd = ["mpiexec", "-n", str(nprocs), sys.executable, "-m", "mpi4py", script]
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    result = subprocess.run(
        cmd, cwd=path.parent.parent, env=env, capture_output=True, text=True, timeout=540
    )
    output = f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert result.returncode == 0, f"{' '.join(cmd)} exited {result.returncode}\n{output}"
