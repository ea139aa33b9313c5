"""Benchmarks, one module per family: `python -m minidp bench NAME` calls NAME.main(argv).

Each prints a table of medians and ratios measured side by side in one run (docs/benchmarks.md
has each one's command and current table) and can write JSON lines with `--json FILE`.
Timing lives here, never in the tests.
"""
