"""The drift detector, `--check-every N`: replicas that should hold the same bits, checked.

Data parallelism keeps replicas identical only by doing the same arithmetic on the same
reduced gradients everywhere; a bug, a bit flip, or a rank that skipped what the others did
breaks that silently, and the replicas drift apart while the loss still looks fine. Every N
steps each strategy says which ranks should hold the same bits of which parameters
(`strategy.replicas()`: the same groups its `max_param_diff` compares), every rank hashes
its copies, and the hashes are compared (parallel/across_ranks.py, `first_difference`). The
first parameter that differs ends the run naming it and the ranks that hold another value,
alike on every rank. Cost: one allgather of 8 bytes per parameter, every N steps.
"""

from minidp.cli.training.nonfinite import TrainingDiverged
from minidp.parallel.across_ranks import first_difference


def check_replicas(strategy, step: int) -> None:
    """Collective: raise TrainingDiverged naming the first parameter whose replicas differ."""
    for group, named_arrays in strategy.replicas():
        found = first_difference(named_arrays, group)
        if found is not None:
            raise TrainingDiverged(f"replicas drifted apart by step {step}: {found}")
