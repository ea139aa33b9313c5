"""deferred_init (engine/deferred.py): a model built without its values is the eager model,
bit for bit, whenever and however much of it is drawn.

- NumPy's Generator gives the same numbers drawn in chunks as in one call (standard_normal
  and uniform, scaled and cast): what a recipe's slices rely on.
- A deferred GPT or MLP leaves its generator where the eager one does (the Dropouts draw
  from it later), holds one element per weight, and any slice [lo, hi) of a weight, or the
  whole of it, or a ZeRO-3 shard of it, equals the eager model's.
- Wrapped in FullyShardedDataParallel, ZeROStages (stage 3) or SimpleZeRO3, a deferred model
  is sharded without any weight drawn whole (a rank's chunk at most), and trains as the
  eager one, bit for bit; so does the command line's ZeRO-3, which builds deferred.
"""

import json
from dataclasses import replace

import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.cli.strategies import ZeRO
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import train
from minidp.engine import deferred
from minidp.engine.deferred import Recipe, deferred_init, flat_values, materialize_module
from minidp.engine.precision import half_dtype, to_half
from minidp.engine.units import units_of
from minidp.parallel import DistributedDataParallel, FullyShardedDataParallel, SimpleZeRO3
from minidp.parallel.zero.flat import ShardLayout
from minidp.parallel.zero.stages import ZeROStages
from minidp.tools.chunks import chunk_range

DTYPES = (np.float32, np.float64, np.float16, half_dtype("bf16"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, chunk", [(10_000, 7), (100_001, 4096), (5, 1), (3, 10)])
def test_numpy_draws_the_same_numbers_in_chunks_as_in_one_call(dtype, n, chunk):
    bound, std = 1 / np.sqrt(384), 0.02 / np.sqrt(12)
    draws = {
        "normal": lambda rng, k: (rng.standard_normal(k) * std).astype(dtype),
        "uniform": lambda rng, k: rng.uniform(-bound, bound, size=k).astype(dtype),
    }
    for kind, draw in draws.items():
        whole, cut = np.random.default_rng(3), np.random.default_rng(3)
        once = draw(whole, n)
        chunks = np.concatenate([draw(cut, min(chunk, n - i)) for i in range(0, n, chunk)])
        assert once.tobytes() == chunks.tobytes(), kind
        assert whole.bit_generator.state == cut.bit_generator.state, kind


def gpt(dtype=np.float32):
    config = nn.GPTConfig(vocab_size=13, block_size=6, n_layer=2, n_head=2, n_embd=8)
    return nn.GPT(config, seed=5, dtype=dtype)


def mlp(dtype=np.float32):
    return nn.MLP([7, 9, 3], rng=np.random.default_rng(2), dtype=dtype)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(deferred, "CHUNK", 5)  # chunk edges inside every weight


@pytest.mark.parametrize("build", [gpt, mlp])
def test_a_deferred_model_is_the_eager_one_slice_by_slice(build, small_chunks):
    eager = build()
    with deferred_init():
        lazy = build()
    # the generator the Dropouts keep ends where the eager draws leave it
    if build is gpt:
        assert lazy.drop.rng.bit_generator.state == eager.drop.rng.bit_generator.state
    assert lazy.num_parameters() == eager.num_parameters()
    want, rng = dict(eager.named_parameters()), np.random.default_rng(0)
    drawn = 0
    for name, p in lazy.named_parameters():
        assert p.shape == want[name].shape and p.dtype == want[name].dtype, name
        if p.recipe is None:  # made from np.ones / np.zeros: an ordinary array
            assert np.array_equal(p.data, want[name].data), name
            continue
        drawn += 1
        assert p.data.strides == (0,) * p.ndim and not p.data.flags.writeable, name
        flat = want[name].data.ravel()
        for lo, hi in [(0, p.size), (0, 1), (p.size - 1, p.size), (3, 3), *[
            sorted(rng.integers(0, p.size + 1, 2)) for _ in range(5)
        ]]:  # fmt: skip
            assert p.recipe.values(lo, hi).tobytes() == flat[lo:hi].tobytes(), (name, lo, hi)
    assert drawn > 0
    materialize_module(lazy)
    for name, p in lazy.named_parameters():
        assert p.recipe is None and p.data.tobytes() == want[name].data.tobytes(), name
        assert p.data.flags.writeable, name


def test_to_half_casts_the_recipe_as_it_casts_the_values():
    eager = to_half(gpt(), "bf16")
    with deferred_init():
        lazy = gpt()
    to_half(lazy, "bf16")
    materialize_module(lazy)
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert p.dtype == q.dtype and p.data.tobytes() == q.data.tobytes(), name


def shards(model, n):
    """Each of n ranks' ZeRO-3 shard (units_of's segments, as stage 3 cuts them)."""
    names = {id(p): name for name, p in model.named_parameters()}
    segments = [params for _, _, params in units_of(model)]
    return [ShardLayout(segments, names, n, r).shard_of_parameters(np.float64) for r in range(n)]


def asking(monkeypatch) -> list:
    """(size, how many asked) of every recipe's values() from now on."""
    asked, values = [], Recipe.values

    def counted(recipe, lo=0, hi=None, out=None):
        asked.append((recipe.size, (recipe.size if hi is None else hi) - lo))
        return values(recipe, lo, hi, out)

    monkeypatch.setattr(Recipe, "values", counted)
    return asked


def test_zero3_shards_of_a_deferred_gpt_are_the_eager_slices(small_chunks, monkeypatch):
    """ShardLayout.shard_of_parameters for 3 ranks: bit-equal to the eager model's, and the
    recipes asked for each number once over the 3 ranks together (none drawn whole on each)."""
    want = shards(gpt(np.float64), 3)
    with deferred_init():
        lazy = gpt(np.float64)
    asked = asking(monkeypatch)
    for mine, theirs in zip(shards(lazy, 3), want):
        assert mine.tobytes() == theirs.tobytes()
    assert sum(n for _, n in asked) == sum(p.size for p in lazy.parameters() if p.recipe)


def test_flat_values_mixes_arrays_and_recipes():
    with deferred_init():
        layer = nn.Linear(4, 3, rng=np.random.default_rng(1), dtype=np.float64)
    eager = nn.Linear(4, 3, rng=np.random.default_rng(1), dtype=np.float64)
    whole = np.concatenate([eager.weight.data.ravel(), eager.bias.data])
    params = [layer.weight, layer.bias]
    assert layer.bias.recipe is not None  # a U(-1/sqrt(in), ...) bias is drawn too
    for lo, hi in [(0, 15), (2, 13), (11, 12), (12, 15), (5, 5)]:
        assert flat_values(params, lo, hi, np.float64).tobytes() == whole[lo:hi].tobytes()


def test_outside_the_block_nothing_is_deferred():
    with deferred_init():
        pass
    with deferred_init(False):
        assert mlp().parameters()[0].recipe is None
    assert all(p.recipe is None for p in gpt().parameters())


# ---- the pieces, under MPI ---------------------------------------------------------------
class Net(nn.Module):
    """A user's model: U(-1/sqrt(in), ..) and N(0, 0.1^2) weights, fc3 tied to fc2's weight
    (unless not `tied`: SimpleZeRO3 shards no tied weight), fc2's bias frozen, dropout
    drawing from the generator the weights came from."""

    def __init__(self, seed: int, tied: bool = True):
        rng = np.random.default_rng(seed)
        self.fc1 = nn.Linear(6, 9, rng=rng, dtype=np.float64, std=0.1)
        self.fc2, self.fc3, self.fc4 = (
            nn.Linear(a, b, rng=rng, dtype=np.float64) for a, b in ((9, 9), (9, 9), (9, 4))
        )
        if tied:
            self.fc3.weight = self.fc2.weight
        self.fc2.bias.requires_grad = False
        self.drop = nn.Dropout(0.2, rng=rng)

    def forward(self, x):
        h = self.fc2(self.drop(self.fc1(x).relu())).relu()  # one input each: SimpleZeRO3's
        return self.fc4(self.fc3(h).relu())


def trained(piece, group, steps: int = 2) -> dict:
    """The whole model, by name, before and after `steps` AdamW steps on this rank's slice."""
    states, opt = [piece.full_state_dict()], optim.AdamW(piece.parameters(), lr=0.01)
    for step in range(steps):
        rng = np.random.default_rng(step)
        x, y = rng.standard_normal((10, 6)), rng.integers(0, 4, 10)
        lo, hi = chunk_range(10, group.size, group.rank)
        if hasattr(piece, "set_batch_share"):
            piece.set_batch_share(hi - lo, 10)
        opt.zero_grad()
        cross_entropy(piece(Tensor(x[lo:hi])), y[lo:hi]).backward()
        if hasattr(piece, "finish_gradient_sync"):
            piece.finish_gradient_sync()
        opt.step()
    return [*states, piece.full_state_dict()]


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(120)
def test_pieces_shard_a_deferred_model_as_the_eager_one_without_drawing_it_whole(monkeypatch):
    """Every rank builds from its own seed (the pieces start all from rank 0's weights: its
    recipes); FSDP ("full", "grad_op") and SimpleZeRO3 give the eager model's bits before and
    after training. Under "full" the ranks together draw each trainable number once, and
    the frozen bias whole on each rank; ZeROStages' shards at stages 1-3 are the eager ones."""
    group = comm.world()
    pieces = [
        (lambda m: FullyShardedDataParallel(m, group, "full"), True),
        (lambda m: FullyShardedDataParallel(m, group, "grad_op"), True),
        (lambda m: SimpleZeRO3(m, group), False),
    ]
    asked = asking(monkeypatch)
    for i, (wrap, tied) in enumerate(pieces):
        want = trained(wrap(Net(group.rank, tied)), group)
        asked.clear()
        with deferred_init():
            model = Net(group.rank, tied)
        frozen = model.fc2.bias.size
        deferred = sum(p.size for p in model.parameters() if p.recipe is not None) - frozen
        got = trained(wrap(model), group)
        assert all(p.recipe is None for p in model.parameters())
        for mine, theirs in zip(got, want):
            for name, value in theirs.items():
                assert mine[name].tobytes() == value.tobytes(), (i, name)
        if i == 0:
            total = comm.allreduce(np.array([sum(n for _, n in asked)]), group=group)[0]
            assert total == deferred + group.size * frozen
    for stage in (1, 2, 3):
        eager = ZeROStages(Net(group.rank), group, stage, optim.AdamW)
        with deferred_init():
            lazy = ZeROStages(Net(group.rank), group, stage, optim.AdamW)
        assert lazy.shard().tobytes() == eager.shard().tobytes(), stage
        eager.close(), lazy.close()


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_the_cli_zero3_run_builds_deferred_and_ends_with_the_eager_bits(monkeypatch, capsys):
    """train() with --strategy zero --zero-stage 3 builds the task's model deferred; forced
    eager instead, the final record (loss, validation loss, L2) and the sample are the same."""
    config = TrainConfig(
        strategy="zero", zero_stage=3, steps=3, n_layer=2, n_embd=16, n_head=2, block_size=8,
        batch_size=6, dropout=0.1, eval_batches=2, sample_tokens=16, log_every=1,
    )  # fmt: skip
    assert ZeRO.builds_deferred(config) and not ZeRO.builds_deferred(replace(config, zero_stage=2))
    runs, asked = [], asking(monkeypatch)
    for defer in (True, False):
        monkeypatch.setattr(ZeRO, "builds_deferred", staticmethod(lambda _, d=defer: d))
        asked.clear()
        final = train(config)
        assert bool(asked) == defer  # the shards drawn from recipes, or not
        sample = capsys.readouterr().out.split("sample:")[-1]
        runs.append([final[k] for k in ("final_loss", "val_loss", "param_l2")] + [sample])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("bit_generator", [np.random.PCG64, np.random.MT19937, np.random.SFC64])
def test_a_recipe_travels_as_json_whatever_its_generator(bit_generator):
    rng = np.random.Generator(bit_generator(5))
    with deferred_init():
        layer = nn.Linear(7, 3, rng=rng)
    recipe = layer.weight.recipe
    back = Recipe.from_json(json.loads(json.dumps(recipe.as_json())))  # what a rank sends
    assert np.array_equal(back.values(), recipe.values())


def test_a_piece_that_needs_the_values_refuses_a_deferred_model_in_one_line():
    with deferred_init():
        model = nn.MLP([4, 8, 2], rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="materialize_module"):
        DistributedDataParallel(model, comm.world())
