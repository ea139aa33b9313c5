"""The examples are tests: each runs under the launch line in its docstring and checks
itself against one process with asserts (examples/*.py, the short scripts a PyTorch user
recognizes)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
LAUNCH = re.compile(r"^\s+mpiexec -n (\d+) python (examples/\S+\.py)\s*$", re.MULTILINE)


def test_there_are_examples_each_short_and_with_its_launch_line():
    assert EXAMPLES
    for path in EXAMPLES:
        text = path.read_text()
        match = LAUNCH.search("\n".join(text.splitlines()[:5]))
        assert match and match.group(2) == f"examples/{path.name}", f"{path.name}: launch line"
        assert len(text.splitlines()) <= 120, f"{path.name} is longer than 120 lines"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path):
    nprocs, script = LAUNCH.search(path.read_text()).groups()
    # `-m mpi4py`: an uncaught error on one rank aborts every rank, never a hang
    cmd = ["mpiexec", "-n", nprocs, sys.executable, "-m", "mpi4py", script]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(
        cmd, cwd=path.parent.parent, env=env, capture_output=True, text=True, timeout=240
    )
    output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{' '.join(cmd)} exited {result.returncode}\n{output}"


@pytest.mark.timeout(120)
def test_the_readmes_own_model_snippet_runs_as_written(tmp_path):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"## Your own model.*?```python\n(.*?)```", readme, re.DOTALL).group(1)
    assert len(code.splitlines()) <= 25, "the README's snippet is longer than 25 lines"
    script = tmp_path / "snippet.py"
    script.write_text(code + "\nassert model.head.weight.grad is not None\n")
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", str(script)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
