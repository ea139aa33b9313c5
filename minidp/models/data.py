"""Data that ships with minidp or with Python itself, and the sampler every strategy shares.

- `classification(...)`: a deterministic synthetic classification set (Gaussian clusters).
- `char_corpus()`: a character-level corpus built at run time from the docstrings of a fixed
  list of standard-library modules; `CharTokenizer` maps its 96 printable characters to ids.
- `DistributedSampler`: the contract every parallel scheme relies on: **the global batch at
  step t holds the same examples whatever the world size**, and a data-parallel rank takes a
  contiguous slice of it. So one process with batch B and four ranks with B/4 each see the
  same examples at every step, and their losses can be compared.
"""

import importlib
import inspect
import string
import warnings
from functools import lru_cache

import numpy as np

from minidp.tools.chunks import chunk_range


def classification(
    n: int = 4096,
    dim: int = 32,
    classes: int = 10,
    seed: int = 0,
    val_fraction: float = 0.2,
    dtype=np.float32,
):
    """Gaussian clusters, one per class, with overlap: (x_train, y_train, x_val, y_val)."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, dim)) * 1.2
    y = rng.integers(0, classes, size=n)
    x = (centers[y] + rng.standard_normal((n, dim))).astype(dtype)
    cut = int(n * (1 - val_fraction))
    return x[:cut], y[:cut], x[cut:], y[cut:]


CORPUS_MODULES = (
    "abc",
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fractions",
    "functools",
    "heapq",
    # not "inspect": `import torch` replaces inspect.getfile, so the corpus would depend on it
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "math",
    "operator",
    "os",
    "pathlib",
    "pprint",
    "random",
    "re",
    "shlex",
    "statistics",
    "string",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "zipfile",
)


class CharTokenizer:
    """Characters <-> ids over a fixed alphabet: newline and the 95 printable ASCII chars."""

    def __init__(self, alphabet: str = "\n" + "".join(chr(c) for c in range(32, 127))):
        self.alphabet = alphabet
        self.vocab_size = len(alphabet)
        self._ids = {ch: i for i, ch in enumerate(alphabet)}

    def encode(self, text: str) -> np.ndarray:
        """Characters outside the alphabet are dropped."""
        return np.array([self._ids[c] for c in text if c in self._ids], dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join(self.alphabet[int(i)] for i in ids)


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """Module and member docstrings of CORPUS_MODULES, in a fixed order (~225 KB)."""
    parts = []
    with warnings.catch_warnings():  # typing.io and friends warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in CORPUS_MODULES:
            module = importlib.import_module(name)
            members = [getattr(module, m) for m in sorted(vars(module)) if not m.startswith("_")]
            for obj in [module, *members]:
                if obj is module or getattr(obj, "__module__", None) == module.__name__:
                    doc = inspect.getdoc(obj)
                    if doc:
                        parts.append(doc)
    text = "\n\n".join(parts)
    allowed = set(string.printable) - set("\r\x0b\x0c\t")
    return "".join(c for c in text.replace("\t", "    ") if c in allowed)


def char_corpus(val_fraction: float = 0.1):
    """(train_ids, val_ids, tokenizer): the corpus tokenized, split by position (val last)."""
    tokenizer = CharTokenizer()
    ids = tokenizer.encode(corpus_text())
    cut = int(len(ids) * (1 - val_fraction))
    return ids[:cut], ids[cut:], tokenizer


def lm_batch(tokens: np.ndarray, starts: np.ndarray, block_size: int):
    """Inputs and next-character targets for windows starting at `starts`: (B, T) each."""
    offsets = starts[:, None] + np.arange(block_size)
    return tokens[offsets], tokens[offsets + 1]


class DistributedSampler:
    """Which examples each rank reads at each step.

    Each epoch is a fresh permutation of all examples drawn from (seed, epoch), identical on
    every rank. Step s of the epoch uses positions [s*B, (s+1)*B) of it: that is the global
    batch, the same for any world size. A rank takes its contiguous slice, `chunk_range(B,
    world_size, rank)`: when B does not divide by the ranks, the first B % world ranks take
    one example more (data parallelism then weights each rank's mean by its share).
    A partial last batch of an epoch is dropped, as with `drop_last=True` in PyTorch.
    """

    def __init__(
        self,
        num_examples: int,
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if global_batch <= 0 or global_batch > num_examples:
            raise ValueError(f"global batch {global_batch} must be in 1..{num_examples} examples")
        if global_batch < world_size:
            raise ValueError(
                f"global batch {global_batch} is smaller than the {world_size} ranks: "
                "some ranks would get no examples"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.num_examples, self.global_batch = num_examples, global_batch
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = num_examples // global_batch
        self.epoch, self._order = None, None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch`: the same order on every rank (it depends on seed and epoch)."""
        if epoch != self.epoch:
            self.epoch = epoch
            if self.shuffle:
                self._order = np.random.default_rng((self.seed, epoch)).permutation(
                    self.num_examples
                )
            else:
                self._order = np.arange(self.num_examples)

    def global_indices(self, step: int) -> np.ndarray:
        """The global batch at global step `step` (epochs follow one another)."""
        epoch, s = divmod(step, self.steps_per_epoch)
        self.set_epoch(epoch)
        return self._order[s * self.global_batch : (s + 1) * self.global_batch]

    def local_indices(self, step: int) -> np.ndarray:
        """This rank's contiguous slice of the global batch."""
        lo, hi = chunk_range(self.global_batch, self.world_size, self.rank)
        return self.global_indices(step)[lo:hi]

    def __iter__(self):
        """This rank's indices for each step of the current epoch."""
        base = self.epoch * self.steps_per_epoch
        return (self.local_indices(base + s) for s in range(self.steps_per_epoch))
