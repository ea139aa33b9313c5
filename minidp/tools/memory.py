"""Counting memory from the arrays themselves: what a rank holds, by category.

Every strategy reports `memory_bytes()` in the same categories, so schemes can be compared
rank by rank (ZeRO's point is that some of these shrink with the number of ranks):

    parameters        the model's weights this rank holds
    gradients         their gradients (data parallelism: the flat buckets)
    optimizer         the optimizer's state (Adam: two moments per parameter)
    activations_peak  what the graph of one micro-batch's forward keeps for backward
    buffers           communication scratch space (the groups' reusable buffers and the fast
                      path's plans: Group.buffer_bytes)

Counted from `ndarray.nbytes` (a torch tensor's `.nbytes` alike), never estimated from shapes
and dtypes by hand; the one estimate, `estimated_bytes` (with `activation_estimate`), is made
before any array exists, so that a run too large for the machine is refused before it
allocates. One caveat, said once:
`activation_bytes` counts the output array of every op in the graph; arrays that an op's
backward closure keeps besides its output (a dropout mask, a softmax) are not seen, so it is
a lower bound on what backward holds. Nor are the rows a weight keeps during gradient
accumulation (weight_grads.defer_weight_grads): at most its gradient's size per weight, from the
first micro-batch to the last.

Beside the arrays, the OS's own figures: `peak_rss_bytes` (the high-water mark) and
`current_rss_bytes`; a run's cap on them, `--max-memory-mb` (`rank_floor_bytes`: the least a
rank will hold, refused at start; `check_cap`: the peak after each step, `OutOfMemory`).
"""

import os
import resource
import sys

import numpy as np

from minidp.engine.backend import base_of
from minidp.tools.log import JobError

CATEGORIES = ("parameters", "gradients", "optimizer", "activations_peak", "buffers")
MEMORY = (*CATEGORIES, "gathered_peak", "offloaded")
"""Every category a strategy may report: ZeRO-3's gathered layers at their peak, and the
optimizer state --offload keeps in a file (parallel/zero/offload.py), too."""


def nbytes(arrays) -> int:
    """Bytes of the distinct arrays among `arrays` (None skipped; a view counts its base once)."""
    seen: dict[int, int] = {}
    for a in arrays:
        if a is None:
            continue
        base = base_of(a)  # NumPy's .base, torch's ._base
        seen[id(base)] = base.nbytes
    return sum(seen.values())


def count_bytes(parts) -> int:
    """Bytes of `parts`: byte counts as they are, arrays counted once each (nbytes)."""
    counts = [p for p in parts if isinstance(p, int | np.integer)]
    return nbytes(p for p in parts if not isinstance(p, int | np.integer)) + int(sum(counts))


def optimizer_bytes(optimizer) -> int:
    """Bytes of an optimizer's per-parameter state (minidp.optim keeps it in `.state`)."""
    return nbytes(v for state in optimizer.state for v in state.values())


def activation_bytes(loss) -> int:
    """Bytes of the op outputs in the graph behind `loss` (leaves, such as parameters and
    inputs, are not activations): what one forward keeps alive until its backward. An output
    that is a view (a reshape, a transpose, an identity op) shares its base's bytes, counted
    once."""
    outputs, leaves, seen, stack = [], set(), set(), [loss]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node._parents:  # an op's output, not a leaf
            outputs.append(node.data)
            stack.extend(node._parents)
        else:
            leaves.add(id(base_of(node.data)))
    return nbytes(a for a in outputs if id(base_of(a)) not in leaves)


# ---- before any array exists: an estimate, to refuse a run that cannot fit --------------------
def estimated_bytes(config) -> int:
    """A rough size of one training step of a TrainConfig: the parameters with their gradients
    and AdamW's two moments, and the activations the global batch keeps for backward
    (`activation_estimate`): within 2x of what training/loop.py's report counts
    (tests/test_cli_input.py checks it)."""
    itemsize = 8 if config.dtype == "float64" else 4
    B = config.batch_size
    if config.model == "gpt":
        T, C, L, V = (config.block_size, config.n_embd, config.n_layer, 128)
        params = L * 12 * C * C + (V + T) * C
        activations = activation_estimate(config, B)
    else:
        params = (32 + config.hidden + 10) * config.hidden  # data.classification: 32 features
        activations = B * 6 * config.hidden * itemsize
    return 4 * params * itemsize + activations


def activation_estimate(config, examples: int, tp: int = 1) -> int:
    """Bytes the GPT of a TrainConfig keeps for backward over `examples` examples, on one
    rank of a TP group of `tp`: per layer 3 H T^2 (scores, masked, softmax) + 20 T C, and
    the T x T causal mask; the vocabulary taken as 128 characters (the corpus has fewer).
    TP splits the heads' scores and 15 T C (QKV, the heads' outputs, the MLP's 4C); the
    other 5 T C (the LayerNorms' inputs and outputs, the residual's dropout masks: outside
    the parallel regions, Korthikanti et al. 2022's 10 of 34 bytes per position and channel)
    stay whole on every TP rank, and split over it too with --sequence-parallel.
    --recompute: each block keeps its input (T C) only, and one block's graph is built again
    in backward (engine/recompute.py)."""
    itemsize = 8 if config.dtype == "float64" else 4
    T, C, H, L = config.block_size, config.n_embd, config.n_head, config.n_layer
    split = tp if tp > 1 and config.sequence_parallel else 1
    block = (3 * H * T * T + 15 * T * C) // tp + 5 * T * C // split
    blocks = L * T * C // split + block if getattr(config, "recompute", False) else L * block
    per_example = blocks + 3 * T * 128
    return examples * per_example * itemsize + T * T


def kept_for_backward(forward, array) -> tuple[int, object]:
    """(bytes, y): what `y = forward(Tensor(array, requires_grad=True))` leaves allocated
    while its graph lives, y's own data not counted, by tracemalloc (NumPy reports its
    arrays to it; a whole process's figure, so call it where nothing else allocates)."""
    import gc
    import tracemalloc

    from minidp.engine.tensor import Tensor

    x = Tensor(array, requires_grad=True)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    y = forward(x)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - before - y.data.nbytes
    tracemalloc.stop()
    return kept, y


def peak_rss_bytes() -> int:
    """The most physical memory this process has held so far (its peak resident set size),
    as the OS counts it: every array, but also Python, the libraries and the allocator's
    kept heap, which the categories above do not see. A reader compares the two."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else 1024 * peak  # macOS: bytes; Linux: KiB


class OutOfMemory(JobError):
    """A rank ran out of memory (an allocation failed) or passed the run's cap
    (--max-memory-mb): the job ends in one line, said once though every rank finds it."""

    turn = "error"


def check_cap(cap_mb: float, rank: int, when: str) -> None:
    """OutOfMemory if this process's peak RSS (the OS's high-water mark, so no spike inside
    a step is missed) has passed `cap_mb` megabytes (0: no cap)."""
    if cap_mb and (peak := peak_rss_bytes()) > cap_mb * 1e6:
        raise OutOfMemory(
            f"out of memory: rank {rank}'s peak RSS reached {peak / 1e6:,.0f} MB {when}, past "
            f"--max-memory-mb {cap_mb:g} (less a rank holds: --strategy zero --zero-stage 3, "
            "--precision bf16, --recompute, a smaller --batch-size or more ranks)"
        )


def rank_floor_bytes(config, world: int) -> dict[str, int] | None:
    """The least a rank of this run holds, by part, before it builds anything: the process
    as it is now (Python, NumPy, MPI), the model states of `model_state_bytes` and half
    `activation_estimate` for its share of a micro-batch (the estimate is within 2x of the
    count). For --strategy dp and zero on NumPy, whose formulas these are; else None."""
    if config.strategy not in ("dp", "zero") or config.model != "gpt" or config.backend != "numpy":
        return None  # (on torch the states may live on a GPU, not in this process)
    T, C, L = config.block_size, config.n_embd, config.n_layer
    psi, half = L * 12 * C * C + T * C, config.precision != "fp32"  # fewer than the GPT's
    size = 2 if half else (8 if config.dtype == "float64" else 4)
    moments = {"adamw": 2, "momentum": 1, "sgd": 0}[config.optimizer]
    k = moments * (4 if half else size) + (4 if half else 0)  # 16 bits: fp32 ones, masters
    stage = config.zero_stage if config.strategy == "zero" else 0
    examples = -(-config.batch_size // (world * config.grad_accum))
    activations = activation_estimate(config, examples) // (4 if half else 2)
    states = sum(model_state_bytes(stage, psi, world, size, k).values())
    return {"process": current_rss_bytes(), "model states": int(states), "activations": activations}


def current_rss_bytes() -> int:
    """The physical memory this process holds now (Linux's /proc; elsewhere its peak)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def model_state_bytes(stage: int, psi: int, n: int, itemsize: int = 4, k: int = 8) -> dict:
    """ZeRO's formulas (Rajbhandari et al. 2020; parallel/zero/stages.py has the table) per
    category, for Ψ parameters on N_d = n ranks; stage 0 is plain DP. Exact when n divides
    psi; otherwise a rank's Ψ/N_d is its count."""
    shard = psi / n
    return {
        "parameters": itemsize * (shard if stage == 3 else psi),
        "gradients": itemsize * (shard if stage >= 2 else psi),
        "optimizer": k * (shard if stage >= 1 else psi),
    }


def physical_memory_bytes() -> int | None:
    """This machine's memory (None if unknown): the same number on every rank of a machine,
    so a check against it passes or fails on all of them alike (what is free right now would
    differ from rank to rank)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
