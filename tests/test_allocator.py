"""allocator.py: glibc keeps freed memory mapped, so a step's arrays fault only once.

Each check runs in a fresh interpreter: mallopt changes the whole process for good."""

import subprocess
import sys
from pathlib import Path

import pytest

from minidp.fast import allocator

ROOT = Path(__file__).parent.parent

# A step in small: 40 arrays of 512 KiB (20 MiB, every page written) held together, then all
# freed. Round 1 maps fresh pages; how many pages does round 3 fault?
THIRD_ROUND_FAULTS = """
import resource, sys
import numpy as np
from minidp.fast.allocator import keep_freed_memory

took = keep_freed_memory()
def round_faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.ones(1 << 16) for _ in range(40)]
    del arrays
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
round_faults(), round_faults()
print(took, round_faults())
"""


def third_round(keep: str) -> tuple[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", THIRD_ROUND_FAULTS],
        cwd=ROOT,
        env={"MINIDP_KEEP_MEMORY": keep, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    took, faults = result.stdout.split()
    return took, int(faults)


def test_switched_off_by_the_environment_variable():
    assert allocator.keep_freed_memory({"MINIDP_KEEP_MEMORY": "0"}) is False


@pytest.mark.skipif(not allocator.is_glibc(), reason="mallopt is glibc's")
def test_with_glibc_freed_arrays_come_back_without_page_faults():
    took, faults = third_round("0")  # glibc as it is: it trims the freed 20 MiB every round
    assert took == "False" and faults > 2000  # 20 MiB is 5120 pages
    took, faults = third_round("1")
    assert took == "True" and faults < 100  # kept: none of the pages is fresh
