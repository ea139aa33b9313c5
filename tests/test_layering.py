"""Layering that reads bottom up: what imports without MPI, and who may import whom.

    engine   chunks  autograd  tensor_ops  functional  grad_mode  weight_grads  nn  gpt
             units  optim  data  log  prune/  parser  plots  backend        no MPI
             (torch_ref, backend_torch: torch, not MPI)
    comm     comm/  trace                                          on MPI (mpi4py)
             cost/ (no MPI until it resolves algo="auto" through comm/auto.py)
    pieces   parallel/
    face     training/  strategies/  cli  bench/  (training/config imports without MPI)

Arrows point down only: a piece never imports the face (it takes plain arguments, never
TrainConfig), comm never imports a piece, the engine never imports comm.

Everything marked no MPI must import, and tutorials 01 and 02 must run, where mpi4py
cannot load an MPI library. The tests block mpi4py in a fresh interpreter with a
`sys.meta_path` finder that refuses it, so a new path from the first row to mpi4py fails
here, not on a laptop without MPI.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
NO_MPI_MODULES = (
    "minidp",
    "minidp.chunks",
    "minidp.data",
    "minidp.nn",
    "minidp.gpt",
    "minidp.tensor_ops",
    "minidp.optim",
    "minidp.training.config",
    "minidp.log",
    "minidp.parser",
    "minidp.plots",
    "minidp.backend",
    "minidp.grad_mode",
    "minidp.weight_grads",
    "minidp.functional",
    "minidp.prune.magnitude",
    "minidp.prune.functions",
    "minidp.cost",
    "minidp.cost.calls",
    "minidp.cost.compute",
    "minidp.cost.step",
    "minidp.units",
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


LAYERS = {  # a package or module of minidp -> its layer, lowest first
    "engine": 0,
    "comm": 1,
    "trace": 1,
    "cost": 1,
    "parallel": 2,
    "training": 3,
    "strategies": 3,
    "cli": 3,
    "bench": 3,
    "torch_train": 3,
    "__main__": 3,
}


def layer_of(module: str) -> int:
    """minidp.parallel.zero.flat -> 2; anything not named in LAYERS is the engine's."""
    parts = module.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0


def test_arrows_point_down_only():
    """Every import inside minidp (at the top or inside a function) names a module of the
    same layer or one below it."""
    upward = []
    for path in sorted((ROOT / "minidp").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if module == "minidp":  # the package's face re-exports the engine only
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module == "minidp":
                names = [f"minidp.{a.name}" for a in node.names]  # from minidp import comm
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("minidp.") and layer_of(name) > layer_of(module):
                    upward.append(f"{module} line {node.lineno} imports {name}")
    assert not upward, "\n".join(upward)


def test_every_module_reads_in_one_sitting():
    """STYLE.md: one idea per file, short enough to read in one sitting (~300 lines)."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "minidp").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 320
    }
    assert not long, f"modules over ~300 lines: {long}"


def test_chunks_stay_reexported_by_comm():
    from minidp import chunks, comm

    assert comm.chunk_bounds is chunks.chunk_bounds and comm.chunk_range is chunks.chunk_range


def test_benchmarks_do_not_import_the_command_line():
    """A benchmark takes its Parser from minidp.parser, below cli.py (and the trainer)."""
    names = sorted(p.stem for p in (ROOT / "minidp" / "bench").glob("[!_]*.py"))
    code = imports(f"minidp.bench.{n}" for n in names) + (
        'import sys\nassert "minidp.cli" not in sys.modules, "a benchmark imports minidp.cli"\n'
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
