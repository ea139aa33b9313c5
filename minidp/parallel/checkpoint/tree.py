"""A rank's state as data: a nested dict cut into named arrays and a JSON skeleton.

A strategy's state_dict() is a tree of dicts, lists and tuples whose leaves are NumPy arrays,
NumPy scalars and plain Python values (int, float, bool, str, None). A checkpoint must be
data, never code, so it is stored as two things that need no pickle to read back:

    state = {"model": {"wte.weight": W}, "optimizer": {"state": [{"m": m0}], "step_count": 3}}

    arrays   {"model/wte.weight": W, "optimizer/state/0/m": m0}       one array per leaf
    skeleton {"dict": [["model", {"dict": [["wte.weight", {"array": "model/wte.weight"}]]}],
                       ["optimizer", {"dict": [["state", {"list": [...]}],
                                               ["step_count", {"value": 3}]]}]]}

Each array's name is its path, the keys joined by "/" (its name in the shard's header). A
NumPy scalar is kept as a 0-d array, so a float32 comes back a float32, bit for bit; a
Python float goes through JSON, whose repr round-trips a float64 exactly. Dict keys may be
strings, ints or tuples of them (the compressors key their buckets by int): the skeleton
keeps each key as it was, so `unflatten(*flatten(state))` equals `state`.
"""

import numpy as np

SCALARS = (bool, int, float, str, type(None))


def flatten(state) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays by path, skeleton) of a state tree; see the module docstring."""
    arrays: dict[str, np.ndarray] = {}
    return arrays, _encode(state, "", arrays)


def _encode(x, path: str, arrays: dict):
    if isinstance(x, np.ndarray | np.generic):
        if x.dtype.hasobject:
            raise TypeError(f"{path or 'the state'}: an array of Python objects is not data")
        name = path or "value"
        if name in arrays:
            raise ValueError(f"two leaves of the state are both named {name!r}")
        arrays[name] = x
        return {"array": name, **({"scalar": True} if isinstance(x, np.generic) else {})}
    if isinstance(x, dict):
        return {"dict": [[_key(k), _encode(v, join_path(path, k), arrays)] for k, v in x.items()]}
    if isinstance(x, list | tuple):
        kind = "list" if isinstance(x, list) else "tuple"
        return {kind: [_encode(v, join_path(path, i), arrays) for i, v in enumerate(x)]}
    if isinstance(x, SCALARS):
        return {"value": x}
    raise TypeError(f"{path or 'the state'}: a {type(x).__name__} is not data a checkpoint holds")


def _key(k):
    """A dict key as JSON: a string or int as it is, a tuple as {"tuple": [...]}."""
    if isinstance(k, tuple):
        return {"tuple": [_key(part) for part in k]}
    if isinstance(k, np.integer):
        return int(k)
    if isinstance(k, str | int) and not isinstance(k, bool):
        return k
    raise TypeError(f"a dict key {k!r} ({type(k).__name__}): use a string, an int or a tuple")


def _unkey(k):
    return tuple(_unkey(part) for part in k["tuple"]) if isinstance(k, dict) else k


def join_path(path: str, key) -> str:
    part = "_".join(map(str, key)) if isinstance(key, tuple) else str(key)
    return f"{path}/{part}" if path else part


def put(state: dict, path: str, value) -> None:
    """Set the leaf at `path` ("a/b/c": state["a"]["b"]["c"]) of a tree of dicts to `value`,
    making the dicts on the way that are not there yet (each key matched by its path name)."""
    *parents, last = path.split("/")
    for part in parents:
        if not isinstance(state, dict):
            raise TypeError(f"{path}: {part!r} is under a {type(state).__name__}, not a dict")
        key = next((k for k in state if join_path("", k) == part), part)
        state = state.setdefault(key, {})
    state[last] = value


def unflatten(arrays, skeleton: dict):
    """The state tree back from `flatten`'s two halves (`arrays` any mapping by path)."""
    if "array" in skeleton:
        array = arrays[skeleton["array"]]
        return array[()] if skeleton.get("scalar") else array
    if "dict" in skeleton:
        return {_unkey(k): unflatten(arrays, v) for k, v in skeleton["dict"]}
    if "list" in skeleton:
        return [unflatten(arrays, v) for v in skeleton["list"]]
    if "tuple" in skeleton:
        return tuple(unflatten(arrays, v) for v in skeleton["tuple"])
    return skeleton["value"]


def leaves(skeleton: dict) -> list[str]:
    """The array names of a skeleton, in the tree's order."""
    if "array" in skeleton:
        return [skeleton["array"]]
    children = skeleton.get("dict", []) and [v for _, v in skeleton["dict"]]
    children = children or skeleton.get("list") or skeleton.get("tuple") or []
    return [name for child in children for name in leaves(child)]


def scalars(skeleton: dict, path: str = "") -> dict:
    """{path: value} of the plain values (numbers, strings, None) of a skeleton, by the
    path an array there would be named by."""
    if "value" in skeleton:
        return {path: skeleton["value"]}
    if "dict" in skeleton:
        items = [(_unkey(k), v) for k, v in skeleton["dict"]]
    else:
        items = list(enumerate(skeleton.get("list") or skeleton.get("tuple") or []))
    return {p: v for key, child in items for p, v in scalars(child, join_path(path, key)).items()}
