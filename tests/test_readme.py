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


def test_ci_runs_the_readme_test_command_in_a_fresh_venv():
    ci = (ROOT / ".ci" / "run").read_text()
    _, install_and_test = quickstart_commands()
    assert "python3 -m venv .venv" in ci
    assert install_and_test in ci.splitlines(), "CI must run the README's test command verbatim"


def test_ci_installs_the_same_package_the_readme_runs():
    install_and_run, _ = quickstart_commands()
    venv = install_and_run.split(" && ")[0]
    assert venv in (ROOT / ".ci" / "run").read_text()
