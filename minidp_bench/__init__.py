"""Benchmarks, one module per family: `python -m minidp bench NAME` calls NAME.main(argv).

Each prints a table of medians and ratios measured side by side in one run (docs/benchmarks.md
has each one's command and current table) and can write JSON lines with `--json FILE`.
Timing lives here, never in the tests. Beside them, apart from the library: torch_train.py,
minidp's training loop in plain PyTorch (and PyTorch DDP), which `bench compare` and
tutorial 13 train against, and low_rank_train.py, a low-rank factorized run (`bench prune
--structured`'s contender, which no flag sets); neither is a benchmark of its own (HELPERS).
"""

# public modules here that `python -m minidp bench` does not list
HELPERS = ("torch_train", "low_rank_train")


def benchmarks() -> list[str]:
    """The benchmarks' names: this package's public modules but the helpers."""
    import pkgutil

    return sorted(
        m.name
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in HELPERS
    )


def main(argv: list[str]) -> int:
    """`python -m minidp bench NAME [options]`: NAME.main(options)."""
    import importlib

    from minidp.tools.log import die, print0

    names = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print0("usage: python -m minidp bench NAME [options]\n\nbenchmarks: " + ", ".join(names))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        raise die(f"unknown benchmark {name!r}; choose from: {', '.join(names)}")
    return importlib.import_module(f"minidp_bench.{name}").main(rest) or 0
