"""Benchmarks, one module per family: `python -m minidp bench NAME` calls NAME.main(argv).

Each prints a table of medians and ratios measured side by side in one run (docs/benchmarks.md
has each one's command and current table) and can write JSON lines with `--json FILE`.
Timing lives here, never in the tests. Beside them, apart from the library: torch_train.py,
minidp's training loop in plain PyTorch (and PyTorch DDP), which `bench compare` and
tutorial 13 train against; it is not a benchmark of its own (HELPERS).
"""

HELPERS = ("torch_train",)  # public modules here that `python -m minidp bench` does not list
