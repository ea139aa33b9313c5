"""Layering that reads bottom up: the folders of minidp are its layers, in the order the
package's docstring lists them; what imports without MPI; who may import whom.

    engine/ fast/ tools/ models/     no MPI (engine/backend_torch and models/torch_ref: torch)
    comm/                            on MPI (mpi4py)
    parallel/                        the pieces
    cli/                             the face (cli/training/config: no MPI)
    cost/                            beside the face, above it: the face runs its commands
                                     by name (commands.TOOLS); its model (cost/step.py) no
                                     MPI until it resolves algo="auto" (comm/auto.py)

Arrows point down only: a piece never imports the face (it takes plain arguments, never
TrainConfig), comm never imports a piece, the engine never imports comm or its speed tricks
(they plug in through engine/registry.py). No two modules import each other at the top.

Everything below comm must import, and tutorials 01 and 02 must run, where mpi4py cannot
load an MPI library. The tests block mpi4py in a fresh interpreter with a `sys.meta_path`
finder that refuses it, so a new path from those folders to mpi4py fails here, not on a
laptop without MPI.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
BELOW_COMM = ("engine", "fast", "tools", "models")
NEEDS_TORCH = ("minidp.engine.backend_torch", "minidp.models.torch_ref")
NO_MPI_MODULES = (
    "minidp",
    *(
        name
        for folder in BELOW_COMM
        for path in sorted((ROOT / "minidp" / folder).rglob("*.py"))
        if (
            name := ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        )
        not in NEEDS_TORCH
    ),
    "minidp.nn",
    "minidp.optim",
    "minidp.functional",
    "minidp.cli.training.config",
    "minidp.tools.parser",
    "minidp.cost",
    "minidp.cost.calls",
    "minidp.cost.compute",
    "minidp.cost.step",
)
BLOCK_MPI4PY = """
import sys
assert "mpi4py" not in sys.modules, "mpi4py was imported before the block"

class NoMPI:  # as if mpi4py could not load an MPI library
    def find_spec(self, name, path=None, target=None):
        if name == "mpi4py" or name.startswith("mpi4py."):
            raise ImportError(f"{name} is blocked: this process has no MPI")
        return None

sys.meta_path.insert(0, NoMPI())
"""


def python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter at the repository root (so `minidp` is this tree)."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def imports(modules) -> str:
    return "".join(f"import {m}\n" for m in modules)


def test_the_block_refuses_mpi4py():
    """Without this, the tests below could pass with mpi4py importable after all."""
    result = python(BLOCK_MPI4PY + "import minidp.comm\n")
    assert result.returncode != 0 and "mpi4py is blocked" in result.stderr


def test_lower_modules_import_without_mpi():
    result = python(BLOCK_MPI4PY + imports(NO_MPI_MODULES))
    assert result.returncode == 0, result.stderr


def test_lower_modules_do_not_import_mpi4py():
    code = imports(NO_MPI_MODULES) + 'import sys\nassert "mpi4py" not in sys.modules\n'
    result = python(code)
    assert result.returncode == 0, result.stderr


def folders_in_order() -> list[str]:
    """The layers, lowest first, as minidp/__init__.py's docstring lists its folders."""
    import minidp

    return re.findall(r"^    (\w+)/ ", minidp.__doc__, re.M)


def layer_of(module: str, order: list[str]) -> int:
    """minidp.parallel.zero.flat -> the index of "parallel" in the docstring's order."""
    return order.index(module.split(".")[1])


def test_the_docstring_names_every_folder_and_nothing_lies_loose():
    """The tree is the layering: each folder of minidp is a layer the docstring names, and
    no module lies beside them (only the package's __init__ and __main__)."""
    order = folders_in_order()
    folders = sorted(p.name for p in (ROOT / "minidp").iterdir() if (p / "__init__.py").exists())
    assert sorted(order) == folders, f"docstring {order} != folders {folders}"
    loose = sorted(p.name for p in (ROOT / "minidp").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"], f"modules outside a layer's folder: {loose}"


def test_arrows_point_down_only():
    """Every import inside minidp (at the top or inside a function) names a module of the
    same layer (folder) or one below it, in the docstring's order."""
    order = folders_in_order()
    upward = []
    for path in sorted((ROOT / "minidp").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if module in ("minidp", "minidp.__main__"):  # the package's face; the CLI's entry
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module == "minidp":
                names = [f"minidp.{a.name}" for a in node.names]  # from minidp import comm
            elif isinstance(node, ast.ImportFrom) and node.level:  # from ..cost import x
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                names = [".".join([*parts, *([node.module] if node.module else [])])]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name == "minidp" or not name.startswith("minidp."):
                    continue
                if name.split(".")[1] not in order:  # minidp.nn: an alias of the package's
                    upward.append(f"{module} line {node.lineno} imports {name}, not a layer")
                elif layer_of(name, order) > layer_of(module, order):
                    upward.append(f"{module} line {node.lineno} imports {name}")
    assert not upward, "\n".join(upward)


def test_the_face_names_the_tools_above_it_only_in_its_table():
    """cli/ runs cost/'s commands and the prediction by module name (importlib), which the
    arrows above cannot see: those names appear in commands.py's TOOLS and PREDICTION only."""
    import minidp.cli.commands as commands

    allowed = {*commands.TOOLS.values(), commands.PREDICTION}
    for path in sorted((ROOT / "minidp" / "cli").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("minidp.cost") and node.value not in allowed:
                    raise AssertionError(f"{path.name} line {node.lineno} names {node.value}")


def top_level_imports(path: Path, module: str, known: set) -> set:
    """The modules of minidp that `module` imports when it is imported: every import not
    inside a function or class body (inside a top-level if, try or with too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from ..y import z
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            found |= {
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            }
        todo.extend(ast.iter_child_nodes(node))
    return (found & known) - {module}


def test_no_module_level_import_cycles():
    """Two modules that import each other at the top (directly or round a loop) work only in
    one import order: there are none. A depth-first walk meets a module still on its path."""
    paths = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (ROOT / "minidp").rglob("*.py")
    }
    graph = {m: top_level_imports(p, m, set(paths)) for m, p in paths.items()}
    done, loops = set(), []

    def walk(module, path):
        if module in path:
            loops.append(" -> ".join([*path[path.index(module) :], module]))
            return
        if module in done:
            return
        for name in sorted(graph[module]):
            walk(name, [*path, module])
        done.add(module)

    for module in sorted(graph):
        walk(module, [])
    assert not loops, "\n".join(loops)


def test_every_module_reads_in_one_sitting():
    """STYLE.md: one idea per file, short enough to read in one sitting (~300 lines)."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "minidp").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 320
    }
    assert not long, f"modules over ~300 lines: {long}"


def test_chunks_stay_reexported_by_comm():
    from minidp import comm
    from minidp.tools import chunks

    assert comm.chunk_bounds is chunks.chunk_bounds and comm.chunk_range is chunks.chunk_range


def test_benchmarks_do_not_import_the_command_line():
    """A benchmark takes its Parser from minidp.tools.parser, below cli/commands.py (and the
    trainer). torch_train.py, a helper that needs torch, is not a benchmark (HELPERS)."""
    import minidp_bench

    names = sorted(p.stem for p in (ROOT / "minidp_bench").glob("[!_]*.py"))
    names = [n for n in names if n not in minidp_bench.HELPERS and n != "__init__"]
    code = imports(f"minidp_bench.{n}" for n in names) + (
        'import sys\nassert "minidp.cli.commands" not in sys.modules, '
        '"a benchmark imports minidp.cli.commands"\n'
    )
    result = python(code)
    assert result.returncode == 0, result.stderr


# ---- what the tutorials and docstrings promise ---------------------------------------------

TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorials_import_only_public_names(path):
    """No module or name with a leading underscore: what a tutorial shows, a reader may use."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            dotted = [*node.module.split("."), *(a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            dotted = [part for a in node.names for part in a.name.split(".")]
        else:
            continue
        private = [part for part in dotted if part.startswith("_")]
        assert not private, f"{path.name} line {node.lineno} imports private {private}"


def test_comm_reading_order_names_every_module():
    import minidp.comm

    modules = sorted(p.name for p in (ROOT / "minidp" / "comm").glob("[!_]*.py"))
    missing = [m for m in modules if m not in minidp.comm.__doc__]
    assert not missing, f"minidp.comm's reading order skips {missing}"


def test_docs_point_only_at_markdown_files_in_the_repository():
    """A docstring that says "see X.md" must name a file a reader of the repository has."""
    sources = [ROOT / "README.md", *ROOT.glob("minidp/**/*.py"), *ROOT.glob("tutorials/*.py")]
    sources += [p for p in ROOT.glob("tests/*.py") if p.name != Path(__file__).name]
    have = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    for path in sources:
        for name in re.findall(r"[\w.-]+\.md\b", path.read_text()):
            assert name in have, f"{path.relative_to(ROOT)} points at {name}, not in the repo"
