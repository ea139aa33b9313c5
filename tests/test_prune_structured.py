"""Structured pruning (minidp/models/prune/structured.py, parallel/structured_pruning.py): the
sliced model computes what the masked dense model computes (float64), is a smaller GPT or
MLP that a config rebuilds and that trains; under data parallelism every rank removes the
same units, and `--prune-structured` is single-process training pruned at the same step.
"""

import copy

import numpy as np
import pytest
from structured_runs import CONFIG, LR, STEPS, assert_one_process, assert_trains, digest

from minidp import Tensor, comm, nn, optim
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.models.data import DistributedSampler
from minidp.models.gpt import GPT, GPTConfig
from minidp.models.prune import structured
from minidp.models.tasks import Task
from minidp.parallel.structured_pruning import prune_structured

CFG = GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=4, n_embd=16)
IDX = np.random.default_rng(0).integers(0, 20, (3, 8))


def with_grads(model, idx=IDX):
    loss = nn.cross_entropy(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("score", ["l2", "l1", "taylor"])
def test_sliced_gpt_forward_is_the_masked_forward(score, fused):
    masked = GPT(CFG, seed=1, dtype=np.float64, fused=fused)
    with_grads(masked)
    sliced = copy.deepcopy(masked)
    kept = structured.prune(structured.gpt_units(masked), 0.5, score, masks_only=True)
    kept_too = structured.prune(structured.gpt_units(sliced), 0.5, score)
    assert all((a == b).all() for a, b in zip(kept, kept_too))
    np.testing.assert_allclose(sliced(IDX).data, masked(IDX).data, rtol=0, atol=1e-12)
    # half the heads and channels: qkv (C, 3A/2), proj (A/2, C), fc (C, 2C), fc_proj (2C, C)
    C, L = CFG.n_embd, CFG.n_layer
    per_block = (C * 3 * C // 2 + 3 * C // 2) + (C // 2 * C + C) + (C * 2 * C + 2 * C) + 2 * C * C
    per_block += C + 4 * C  # fc_proj's bias, two LayerNorms
    outside = 20 * C + 8 * C + 2 * C + 20 * C  # wte, wpe, ln_f, head
    assert sliced.num_parameters() == L * per_block + outside
    assert sliced.config.heads == (2, 2) and sliced.config.mlp_channels == (32, 32)
    rebuilt = GPT(sliced.config, seed=9, dtype=np.float64, fused=fused)  # the config says all
    rebuilt.load_state_dict(sliced.state_dict())
    assert (rebuilt(IDX).data == sliced(IDX).data).all()


def test_sliced_mlp_forward_and_optimizer_state():
    rng = np.random.default_rng(2)
    model = nn.MLP([5, 12, 8, 3], rng=rng, dtype=np.float64)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    opt = optim.AdamW(model.parameters(), lr=0.01)
    nn.cross_entropy(model(Tensor(x)), y).backward()
    opt.step()
    masked, sliced = model, copy.deepcopy(model)
    old_m = copy.deepcopy(dict(zip(map(id, opt.params), opt.state)))
    old_first = masked.layers[0].weight
    sliced_opt = optim.AdamW(sliced.parameters(), lr=0.01)
    sliced_opt.load_state_dict(opt.state_dict())
    kept = structured.prune(structured.mlp_units(masked), 0.25, masks_only=True)
    structured.prune(structured.mlp_units(sliced), 0.25, optimizer=sliced_opt)
    assert [len(k) for k in kept] == [9, 6]
    assert [layer.weight.shape for layer in sliced.layers] == [(5, 9), (9, 6), (6, 3)]
    np.testing.assert_allclose(sliced(Tensor(x)).data, masked(Tensor(x)).data, atol=1e-12)
    # the optimizer trains the new parameters, its m and v the kept columns of the old ones
    assert sliced_opt.params[0] is sliced.layers[0].weight
    np.testing.assert_array_equal(sliced_opt.state[0]["m"], old_m[id(old_first)]["m"][:, kept[0]])
    assert_trains(sliced, sliced_opt, x, y, 20)


def test_kept_units_and_bad_input():
    scores = np.array([3.0, 1.0, 1.0, 2.0])
    assert structured.kept_units(scores, 0.5).tolist() == [0, 3]  # ties: the lower index goes
    assert structured.kept_units(scores, 1).tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="at least one must stay"):
        structured.kept_units(scores, 0.9)
    with pytest.raises(TypeError):
        structured.kept_units(scores, "half")
    model = GPT(CFG, seed=1, dtype=np.float64)
    with pytest.raises(ValueError, match="needs gradients"):
        structured.prune(structured.gpt_units(model), 0.5, "taylor")
    with pytest.raises(ValueError, match="score must be"):
        structured.prune(structured.gpt_units(model), 0.5, "l3")
    with pytest.raises(TypeError, match="MLP"):
        structured.mlp_units(model)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_prune_structured_under_data_parallelism_is_one_process():
    group, config = comm.world(), TrainConfig(**CONFIG)
    # Taylor scores from each rank's own gradient: the agreed mean keeps the same units
    model = GPT(CFG, seed=1, dtype=np.float64)
    with_grads(model, IDX[group.rank :: group.size])
    kept = prune_structured(model, 0.5, group, score="taylor")
    assert len(set(group.comm.allgather(digest(kept)))) == 1

    strategy = DataParallel(Task(config, np.float64), config, group)
    sampler = DistributedSampler(
        strategy.task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
    )
    losses = [strategy.step(sampler.local_indices(step), LR).loss for step in range(STEPS)]
    params = [p.data for p in strategy.task.model.parameters()]
    assert len(set(group.comm.allgather(digest(params)))) == 1
    record = strategy.record()
    assert record["parameters_after"] < 0.8 * record["parameters_before"]
    assert strategy.task.model.config.heads == (2,)
    strategy.close()

    # one process, the global batch, pruned by hand at step AT (the optimizer sliced along)
    def by_hand(model, opt):
        structured.prune(structured.gpt_units(model), 0.5, optimizer=opt)

    assert_one_process(config, by_hand, losses, params)
