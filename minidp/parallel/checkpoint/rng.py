"""The random streams of a run, by where they live: what a checkpoint must hold besides
the arrays for a resumed run to draw the same numbers (dropout masks, data order).

    state["rng"] = rng_states(trainer)        # {"task.model.blocks.0.attn.drop.rng": {...}}
    set_rng_states(trainer, state["rng"])     # each stream back where it was

Every np.random.Generator reachable from `root` through minidp objects' attributes, lists,
tuples and dicts is found by its first path, each once (the GPT's dropouts share one).
Tensors are not entered: they hold none. The states are plain JSON (a checkpoint's skeleton).
"""

import numpy as np

from minidp.engine.tensor import Tensor


def generators(root) -> dict[str, np.random.Generator]:
    """Every np.random.Generator reachable from `root` through minidp objects' attributes,
    lists, tuples and dicts, by its first path ("task.model.blocks.0.attn.attn_drop.rng"),
    each once (the GPT's dropouts share one). Tensors are not entered: they hold none."""
    found, seen = {}, set()

    def walk(x, path: str) -> None:
        if id(x) in seen or isinstance(x, Tensor | np.ndarray):
            return
        seen.add(id(x))
        if isinstance(x, np.random.Generator):
            found[path] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}")
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(v, f"{path}.{i}")
        elif type(x).__module__.startswith("minidp") and hasattr(x, "__dict__"):
            for k, v in vars(x).items():
                walk(v, f"{path}.{k}" if path else k)

    walk(root, "")
    return found


def rng_states(root) -> dict[str, dict]:
    """{path: bit generator state} of every Generator reachable from `root`."""
    return {path: g.bit_generator.state for path, g in generators(root).items()}


def set_rng_states(root, states: dict[str, dict]) -> None:
    """Each Generator reachable from `root` set to its path's state in `states` (paths not
    found are left alone)."""
    found = generators(root)
    for where, state in states.items():
        if where in found:
            found[where].bit_generator.state = state
