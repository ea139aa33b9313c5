"""The README's quickstart is what CI runs: keep the two in sync."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_quickstart_is_two_commands_that_install_and_run():
    install_and_run, install_and_test = quickstart_commands()
    assert "pip install" in install_and_run and "mpiexec -n 4 python -m minidp" in install_and_run
    assert "pip install" in install_and_test and "pytest" in install_and_test


def test_ci_runs_the_readme_commands_verbatim_before_it_installs_torch():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    install_and_run, install_and_test = quickstart_commands()
    assert "rm -rf .venv" in lines and install_and_run.startswith("python3 -m venv .venv")
    assert install_and_run in lines and install_and_test in lines, "the README's commands, verbatim"
    torch = next(
        i for i, line in enumerate(lines) if line.startswith("pip install") and "torch" in line
    )
    assert lines.index(install_and_run) < lines.index(install_and_test) < torch
    assert "MINIDP_REQUIRE_TORCH=1 python -m pytest -m torch" in lines[torch:]


def test_ci_installs_the_same_package_the_readme_runs():
    install_and_run, _ = quickstart_commands()
    venv = install_and_run.split(" && ")[0]
    assert venv in (ROOT / ".ci" / "run").read_text()
