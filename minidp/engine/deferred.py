"""Deferred initialization: a model built without its weights' values, each weight a recipe
to draw them later, any slice at a time (PyTorch's meta device and torchdistx's
`deferred_init`, which FSDP then materializes shard by shard).

    with deferred_init():
        model = GPT(config, seed=0)               # no weight drawn from the rng holds memory
    fsdp = FullyShardedDataParallel(model)        # each rank draws only its own chunks

Why: ZeRO stage 3 keeps 1/N of the model on each rank, but a model built eagerly is whole on
every rank until it is sharded. Built deferred and sharded, a rank has held its shard plus
one chunk of CHUNK numbers being drawn, never a whole weight.

The layers (nn.py) draw every weight through `uniform` or `normal` below. Eagerly these
return the drawn array, as they always did. Under `deferred_init()` they return a stand-in,
and the Parameter made from it keeps a `Recipe` as `p.recipe`:

    p.data     np.broadcast_to(NaN, shape): read-only, one element of memory (a read of it
               before the values exist gives NaN, not a silently wrong number)
    p.recipe   the generator's state before its draw, the kind of draw (U(-s, s), or
               N(0, 1)·s), the shape, the scale s, and the casts after it (the layer's dtype,
               then to_half's 16 bits)

The live generator still advances exactly as the eager draw would have moved it (Dropout
modules keep the same generator and draw their masks from it later): the draw is made and
thrown away, CHUNK numbers at a time. Parameters made from np.ones / np.zeros (LayerNorms,
the biases of normal-initialized Linears) stay ordinary arrays: small, and not drawn.

Why a slice [lo, hi) of the flattened weight can be drawn exactly on its own: NumPy's
Generator fills an array one number after another from its bit stream, each number the same
function of the stream however the request is cut, and the scale and the casts act on each
number alone. So n numbers drawn in one call or in several chunks are the same bits
(tests/test_deferred_init.py checks standard_normal and uniform, scaled and cast). A fresh
generator set to the saved state draws and discards [0, lo), then keeps [lo, hi): exact, at
the cost of drawing up to hi. (Skipping ahead without drawing is not possible for the normal
draws: the ziggurat method takes a variable number of bits per number.)

A parameter stops being deferred (`p.recipe` None) when its values exist: `materialize`
draws them whole (one process, tests, or before a piece that keeps the whole model, as
DistributedDataParallel); a sharding scheme takes its ranks' chunks with `flat_values` and
hands the values to its shards (parallel/zero/: FSDP, ZeROStages, SimpleZeRO3).
"""

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

CHUNK = 1 << 16  # numbers drawn at a time: 512 KiB of float64


class _Deferring(threading.local):
    """Whether the layers defer their draws, one flag per thread (as grad mode)."""

    on = False


_deferring = _Deferring()


@contextlib.contextmanager
def deferred_init(enabled: bool = True) -> Iterator[None]:
    """Inside this block every weight a layer draws from a np.random.Generator is a stand-in
    with a recipe (see above); `enabled=False` changes nothing. The previous setting comes
    back on exit."""
    previous, _deferring.on = _deferring.on, enabled
    try:
        yield
    finally:
        _deferring.on = previous


@dataclass(frozen=True)
class Recipe:
    """How to draw a deferred weight: what `kind` of numbers, from a generator of class
    `bit_generator` in `state`, `scale`d, then cast to each of `dtypes` in turn."""

    bit_generator: type  # e.g. np.random.PCG64
    state: dict  # bit_generator.state before the draw
    kind: str  # "uniform": U(-scale, scale); "normal": N(0, 1) * scale
    shape: tuple
    scale: float
    dtypes: tuple  # the casts after the draw, in order

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.dtypes[-1]

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """The next n numbers as the eager layer draws them (before the casts)."""
        if self.kind == "uniform":
            return rng.uniform(-self.scale, self.scale, size=n)
        return rng.standard_normal(n) * self.scale

    def values(self, lo: int = 0, hi: int | None = None, out=None) -> np.ndarray:
        """Elements [lo, hi) of the flattened weight, exactly as the eager draw gives them,
        into `out` (a new 1-D array if None): a fresh generator set to `state` draws
        [0, lo) and throws it away, then draws [lo, hi), CHUNK numbers at a time."""
        hi = self.size if hi is None else hi
        out = np.empty(hi - lo, self.dtype) if out is None else out
        rng = np.random.Generator(self.bit_generator(0))
        rng.bit_generator.state = self.state
        skip(rng, self, lo)
        for start in range(lo, hi, CHUNK):
            stop = min(start + CHUNK, hi)
            out[start - lo : stop - lo] = self.cast(self.draw(rng, stop - start))
        return out

    def cast(self, numbers: np.ndarray) -> np.ndarray:
        for dtype in self.dtypes:
            numbers = numbers.astype(dtype)
        return numbers

    def as_json(self) -> dict:
        """The recipe as JSON-able values (what a rank sends another: no pickle)."""
        from minidp.engine.precision import dtype_name  # (precision.py imports this module)

        dtypes = [dtype_name(np.dtype(d)) for d in self.dtypes]
        shape, scale = list(self.shape), float(self.scale)
        name = self.bit_generator.__name__
        state = _jsonable(self.state)  # MT19937's, Philox's, SFC64's hold arrays
        return {"bit_generator": name, "state": state, "kind": self.kind,
                "shape": shape, "scale": scale, "dtypes": dtypes}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> "Recipe":
        from minidp.engine.precision import named_dtype

        bit_generator = getattr(np.random, d["bit_generator"])
        d = {**d, "state": _from_jsonable(d["state"])}
        dtypes = tuple(named_dtype(name) for name in d["dtypes"])
        return cls(bit_generator, d["state"], d["kind"], tuple(d["shape"]), d["scale"], dtypes)

    def stand_in(self) -> np.ndarray:
        """The values' place until they exist: read-only, one element of memory, NaN."""
        fill = np.nan if np.issubdtype(self.dtype, np.floating) else 0
        return np.broadcast_to(np.array(fill, self.dtype), self.shape)


def skip(rng: np.random.Generator, recipe: Recipe, n: int) -> None:
    """Move `rng` past the next n numbers of `recipe`'s kind, drawing CHUNK at a time."""
    for start in range(0, n, CHUNK):
        recipe.draw(rng, min(CHUNK, n - start))


class _StandIn(np.ndarray):
    """A stand-in that carries its recipe from the draw to the Parameter made from it
    (Parameter.__init__ takes `.recipe`; its .data is then a plain ndarray view)."""

    recipe: Recipe


def _deferred(rng, kind: str, shape, scale, dtype) -> np.ndarray:
    """Note the recipe, move `rng` as the draw would, return the stand-in carrying it."""
    shape = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    dtype = np.dtype(np.float64 if dtype is None else dtype)  # as the eager draw comes out
    state = rng.bit_generator.state
    recipe = Recipe(type(rng.bit_generator), state, kind, shape, float(scale), (dtype,))
    skip(rng, recipe, recipe.size)
    stand_in = recipe.stand_in().view(_StandIn)
    stand_in.recipe = recipe
    return stand_in


def uniform(rng: np.random.Generator, shape, bound: float, dtype) -> np.ndarray:
    """U(-bound, bound) of `shape` in `dtype`: the values (deferred: a stand-in, see above)."""
    if _deferring.on:
        return _deferred(rng, "uniform", shape, bound, dtype)
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


def normal(rng: np.random.Generator, shape, std: float, dtype) -> np.ndarray:
    """N(0, std^2) of `shape`, drawn in float64, which the Parameter casts to `dtype` (deferred:
    a stand-in of `dtype`, see above)."""
    if _deferring.on:
        return _deferred(rng, "normal", shape, std, dtype)
    return rng.standard_normal(shape) * std


def is_deferred(p) -> bool:
    """Whether `p` is a Parameter whose values are not drawn yet."""
    return getattr(p, "recipe", None) is not None


def flat_values(params, lo: int, hi: int, dtype, out=None) -> np.ndarray:
    """Elements [lo, hi) of `params` flattened and laid end to end (a sharding scheme's chunk
    of a layer), each taken from its array or, deferred, drawn from its recipe: no weight
    is made whole. Into `out` (a new array of `dtype` if None)."""
    out = np.empty(hi - lo, dtype) if out is None else out
    offset = 0
    for p in params:
        a, b = max(lo, offset), min(hi, offset + p.size)
        if a < b:
            mine = out[a - lo : b - lo]
            if is_deferred(p):
                p.recipe.values(a - offset, b - offset, out=mine)
            else:
                mine[...] = np.ravel(p.data)[a - offset : b - offset]
        offset += p.size
    return out


def astype(p, dtype) -> None:
    """`p.data` cast to `dtype` in place of the old array; deferred, the cast joins its
    recipe (to_half's, engine/precision.py: the values are cast twice, as eagerly)."""
    if is_deferred(p):
        p.recipe = replace(p.recipe, dtypes=(*p.recipe.dtypes, np.dtype(dtype)))
        p.data = p.recipe.stand_in()
    else:
        p.data = p.data.astype(dtype)


def materialize(*params) -> None:
    """Draw each deferred parameter's values whole, in an array of its own (one process, a
    frozen parameter a sharding scheme keeps whole, tests); others are left as they are."""
    for p in params:
        if is_deferred(p):
            p.data = p.recipe.values().reshape(p.recipe.shape)
            p.recipe = None


def materialize_module(module) -> None:
    """Every deferred parameter of `module` drawn whole (PyTorch's `to_empty` and
    `reset_parameters`, or torchdistx's `materialize_module`)."""
    materialize(*module.parameters())


def _jsonable(value):
    """A generator's state with its arrays as {"array": [...], "dtype": "uint64"}."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {"array": value.tolist(), "dtype": value.dtype.str}
    return value


def _from_jsonable(value):
    if isinstance(value, dict) and set(value) == {"array", "dtype"}:
        return np.array(value["array"], dtype=value["dtype"])
    if isinstance(value, dict):
        return {k: _from_jsonable(v) for k, v in value.items()}
    return value
