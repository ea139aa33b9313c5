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


DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(page: Path) -> str:
    """The page without its fenced code blocks (where brackets are not links)."""
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, - for space."""
    headings = re.findall(r"^#+ (.*)$", prose(page), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_in_the_readme_and_docs_points_at_a_file_that_exists():
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in LINK.findall(prose(page)):
            if re.match(r"[a-z]+://", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)} links to {target}"
            assert linked.exists() and ROOT in linked.parents, where
            assert not anchor or anchor in anchors(linked), where + ": no such heading"


def tables(page: Path) -> list[str]:
    """Every markdown table of the page, each as one string of its lines."""
    return re.findall(r"(?:^\|.*\n)+", page.read_text(), flags=re.MULTILINE)


def test_the_tables_in_benchmarks_md_are_the_ones_on_the_scheme_pages():
    """A re-measured table is changed on its scheme's page and in docs/benchmarks.md alike."""
    pages = [page for page in DOCS.glob("*.md") if page.name != "benchmarks.md"]
    on_pages = {table for page in pages for table in tables(page)}
    for table in tables(DOCS / "benchmarks.md"):
        assert table in on_pages, "docs/benchmarks.md has a table no scheme page has:\n" + table
