"""Embedded data and the sampler's contract: the global batch at step t is the same examples
whatever the world size, and rank r holds a contiguous slice of it (ranks in order)."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from minidp import data
from minidp.models.data import CharTokenizer, DistributedSampler


# ---- synthetic classification -----------------------------------------------------------------
def test_classification_is_deterministic_per_seed():
    a, b, c = data.classification(seed=3), data.classification(seed=3), data.classification(seed=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])


def test_classification_shapes_labels_and_split():
    x_train, y_train, x_val, y_val = data.classification(n=1000, dim=8, classes=5, val_fraction=0.2)
    assert x_train.shape == (800, 8) and x_val.shape == (200, 8)
    assert y_train.shape == (800,) and y_val.shape == (200,)
    assert x_train.dtype == np.float32
    assert set(np.unique(y_train)) == set(range(5))
    assert data.classification(n=100, dtype=np.float64)[0].dtype == np.float64


# ---- the character corpus -----------------------------------------------------------------------
def test_corpus_is_large_and_uses_only_the_alphabet():
    text = data.corpus_text()
    assert len(text) > 100_000
    assert set(text) <= set(CharTokenizer().alphabet)
    assert len(set(text)) > 60  # letters, digits, punctuation: not a degenerate corpus


def test_corpus_is_the_same_every_time():
    data.corpus_text.cache_clear()
    first = data.corpus_text()
    data.corpus_text.cache_clear()
    assert data.corpus_text() == first


def test_corpus_does_not_depend_on_what_else_was_imported():
    """A fresh process (no torch, no pytest) must build the very corpus this process builds."""
    try:
        import torch  # noqa: F401  (it replaces stdlib functions such as inspect.getfile)
    except ImportError:
        pass
    data.corpus_text.cache_clear()
    here = hashlib.sha256(data.corpus_text().encode()).hexdigest()
    code = (
        "import hashlib; from minidp import data; "
        "print(hashlib.sha256(data.corpus_text().encode()).hexdigest())"
    )
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == here


def test_tokenizer_roundtrip_and_unknown_characters_dropped():
    tokenizer = CharTokenizer()
    assert tokenizer.vocab_size == 96
    text = data.corpus_text()[:5000]
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 96
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode("a\tb\u00e9c\n")) == "abc\n"


def test_char_corpus_splits_train_then_validation():
    train, val, tokenizer = data.char_corpus(val_fraction=0.1)
    everything = tokenizer.encode(data.corpus_text())
    np.testing.assert_array_equal(np.concatenate([train, val]), everything)
    assert len(val) == len(everything) - int(len(everything) * 0.9)


def test_lm_batch_targets_are_the_inputs_shifted_by_one():
    tokens = np.arange(100) * 7 % 96
    starts = np.array([0, 17, 50, 89])
    x, y = data.lm_batch(tokens, starts, block_size=10)
    assert x.shape == y.shape == (4, 10)
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    np.testing.assert_array_equal(x[:, 0], tokens[starts])
    np.testing.assert_array_equal(y[:, -1], tokens[starts + 10])


# ---- DistributedSampler -----------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("batch", [5, 7, 12, 13])
def test_ranks_in_order_make_up_the_single_process_batch(world_size, batch):
    if batch < world_size:
        pytest.skip("fewer examples than ranks is an error, tested below")
    n = 50
    reference = DistributedSampler(n, batch, seed=9)
    samplers = [
        DistributedSampler(n, batch, rank=r, world_size=world_size, seed=9)
        for r in range(world_size)
    ]
    for step in range(2 * reference.steps_per_epoch + 1):  # across epoch boundaries
        parts = [s.local_indices(step) for s in samplers]
        np.testing.assert_array_equal(np.concatenate(parts), reference.global_indices(step))
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        assert sizes == sorted(sizes, reverse=True)  # the first batch % world ranks take one more


def test_an_epoch_is_a_permutation_with_the_partial_batch_dropped():
    sampler = DistributedSampler(23, 5, seed=1)
    assert sampler.steps_per_epoch == 4
    batches = list(sampler)
    assert len(batches) == 4 and all(len(b) == 5 for b in batches)
    seen = np.concatenate(batches)
    assert len(np.unique(seen)) == 20 and seen.min() >= 0 and seen.max() < 23


def test_set_epoch_reshuffles_deterministically():
    a = DistributedSampler(40, 8, seed=5)
    b = DistributedSampler(40, 8, seed=5, rank=0, world_size=1)
    a.set_epoch(3)
    b.set_epoch(3)
    np.testing.assert_array_equal(np.concatenate(list(a)), np.concatenate(list(b)))
    epoch3 = np.concatenate(list(a))
    a.set_epoch(4)
    assert not np.array_equal(np.concatenate(list(a)), epoch3)
    a.set_epoch(3)
    np.testing.assert_array_equal(np.concatenate(list(a)), epoch3)
    other_seed = DistributedSampler(40, 8, seed=6)
    other_seed.set_epoch(3)
    assert not np.array_equal(np.concatenate(list(other_seed)), epoch3)


def test_global_steps_walk_through_epochs_in_order():
    sampler = DistributedSampler(30, 10, seed=2)
    sampler.set_epoch(1)
    epoch1 = [b.copy() for b in sampler]
    fresh = DistributedSampler(30, 10, seed=2)
    for s in range(3):
        np.testing.assert_array_equal(fresh.global_indices(3 + s), epoch1[s])


def test_without_shuffle_batches_are_consecutive():
    sampler = DistributedSampler(10, 4, rank=1, world_size=2, shuffle=False)
    np.testing.assert_array_equal(sampler.global_indices(1), [4, 5, 6, 7])
    np.testing.assert_array_equal(sampler.local_indices(1), [6, 7])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"num_examples": 10, "global_batch": 0}, "global batch 0"),
        ({"num_examples": 10, "global_batch": 11}, "global batch 11"),
        ({"num_examples": 10, "global_batch": 3, "world_size": 4}, "smaller than the 4 ranks"),
        ({"num_examples": 10, "global_batch": 4, "rank": 2, "world_size": 2}, "rank 2"),
        ({"num_examples": 10, "global_batch": 4, "rank": -1, "world_size": 2}, "rank -1"),
    ],
)
def test_bad_sampler_arguments_are_clear_value_errors(args, message):
    with pytest.raises(ValueError, match=message):
        DistributedSampler(**args)
