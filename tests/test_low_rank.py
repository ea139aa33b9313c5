"""Low-rank factorization (minidp/models/prune/low_rank.py, parallel/low_rank.py): at full
rank the factorized model computes the dense one (float64), at rank r the rank-r truncation
of each weight (Eckart-Young's error), it trains; under data parallelism every rank holds
the same factors and the run is one process factorized at the same step.
"""

import copy

import numpy as np
import pytest
from structured_runs import AT, LR, STEPS, assert_one_process, assert_trains, digest
from structured_runs import CONFIG as STRUCTURED
from test_bench import minidp, records

from minidp import Tensor, comm, nn, optim
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.models.data import DistributedSampler
from minidp.models.gpt import GPT, GPTConfig
from minidp.models.prune import low_rank
from minidp.models.tasks import Task
from minidp.parallel.low_rank import LowRankFactorization, factorize_replicas
from minidp_bench.low_rank_train import low_rank_run

CFG = GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=4, n_embd=16)
IDX = np.random.default_rng(0).integers(0, 20, (3, 8))


def truncated(W: np.ndarray, r: int) -> np.ndarray:
    """The reference: U_r Σ_r V_rᵀ."""
    U, S, Vt = np.linalg.svd(W, full_matrices=False)
    return (U[:, :r] * S[:r]) @ Vt[:r]


@pytest.mark.parametrize("fused", [True, False])
def test_full_rank_gpt_is_the_dense_gpt(fused):
    dense = GPT(CFG, seed=1, dtype=np.float64, fused=fused)
    low = copy.deepcopy(dense)
    made = low_rank.factorize_model(low, rank=1.0)
    assert len(made) == 4 * CFG.n_layer and [m.rank for m in made[:4]] == [16, 16, 16, 16]
    assert low.blocks[0].attn.qkv is made[0] and low.blocks[1].fc_proj is made[-1]
    np.testing.assert_allclose(low(IDX).data, dense(IDX).data, rtol=0, atol=1e-12)


@pytest.mark.parametrize("r", [1, 5])
def test_rank_r_is_the_truncation(r):
    dense = GPT(CFG, seed=1, dtype=np.float64)
    low = copy.deepcopy(dense)
    for owner, key in low_rank.gpt_linears(dense):  # the dense model with W_r in W's place
        W = getattr(owner, key).weight.data
        getattr(owner, key).weight.data[...] = truncated(W.copy(), r)
    made = low_rank.factorize_model(low, rank=r)
    for layer, (owner, key) in zip(made, low_rank.gpt_linears(dense)):
        W_r = getattr(owner, key).weight.data
        np.testing.assert_allclose(layer.first.weight.data @ layer.second.weight.data, W_r,
                                   atol=1e-12)  # fmt: skip
    np.testing.assert_allclose(low(IDX).data, dense(IDX).data, rtol=0, atol=1e-12)
    # Eckart-Young: the error is the singular values left out
    W = GPT(CFG, seed=1, dtype=np.float64).blocks[0].fc.weight.data
    S = np.linalg.svd(W, compute_uv=False)
    A_B = low_rank.factorize(nn.Linear(16, 64, rng=np.random.default_rng(0)), 2)  # any layer
    assert A_B.first.weight.shape == (16, 2) and A_B.second.weight.shape == (2, 64)
    error = np.linalg.norm(W - truncated(W, r)) ** 2
    np.testing.assert_allclose(error, (S[r:] ** 2).sum(), rtol=1e-10)
    # parameters: r (n_in + n_out) per factorized weight, the biases kept
    C, F = CFG.n_embd, 4 * CFG.n_embd
    shrink = sum(n_in * n_out - r * (n_in + n_out) for n_in, n_out in
                 [(C, 3 * C), (C, C), (C, F), (F, C)]) * CFG.n_layer  # fmt: skip
    assert low.num_parameters() == dense.num_parameters() - shrink


def test_user_mlp_factorized_trains_and_bad_input():
    rng = np.random.default_rng(2)
    model = nn.MLP([5, 12, 8, 3], rng=rng, dtype=np.float64)  # fused Linear + ReLU
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    full = copy.deepcopy(model)
    low_rank.factorize_model(full, rank=1.0)
    np.testing.assert_allclose(full(Tensor(x)).data, model(Tensor(x)).data, atol=1e-12)
    made = low_rank.factorize_model(model, rank=2)
    assert [m.rank for m in made] == [2, 2, 2] and model.layers[1] is made[1]
    opt = optim.AdamW(model.parameters(), lr=0.02)
    assert_trains(model, opt, x, y, 30)  # the factors train
    layer = nn.Linear(4, 6, rng=rng)
    for bad, error in [(0, ValueError), (5, ValueError), (1.5, ValueError), ("2", TypeError)]:
        with pytest.raises(error, match="rank"):
            low_rank.factorize(layer, bad)
    with pytest.raises(TypeError, match="Linear"):
        low_rank.factorize(nn.LayerNorm(4), 2)


RANK = 4
CONFIG = {**STRUCTURED, "prune_structured": 0.0, "prune_structured_at": None}  # dense


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
def test_low_rank_under_data_parallelism_is_one_process():
    group, config = comm.world(), TrainConfig(**CONFIG)
    strategy = DataParallel(Task(config, np.float64), config, group)
    strategy.structured = LowRankFactorization(strategy.task.model, RANK, AT, group)
    sampler = DistributedSampler(
        strategy.task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
    )
    losses = [strategy.step(sampler.local_indices(step), LR).loss for step in range(STEPS)]
    params = [p.data for p in strategy.task.model.parameters()]
    assert len(set(group.comm.allgather(digest(params)))) == 1
    assert strategy.record()["parameters_after"] < strategy.record()["parameters_before"]
    strategy.close()

    alone = group.split(group.rank)  # one process, the global batch, factorized at step AT

    def by_hand(model, opt):  # AdamW's entries of each W become A's and B's, fresh
        factorize_replicas(model, RANK, alone, optimizer=opt)
        assert opt.params == model.parameters()

    assert_one_process(config, by_hand, losses, params)
    alone.free()


def test_bench_low_rank_run_and_the_profile(tmp_path):
    config = TrainConfig(**{**CONFIG, "dtype": "float32", "steps": 6})
    final = low_rank_run(config, RANK, comm.world())  # the bench's low-rank contender
    assert np.isfinite(final["val_loss"]) and final["low_rank_at"] == 2
    assert final["parameters_after"] < final["parameters_before"]
    where = tmp_path / "p.jsonl"
    run = minidp(1, *("bench", "prune", "--structured", "--profile", "--rounds", "1"),
                 "--json", str(where))  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = {r["model"]: r for r in records(where)}
    assert list(rows) == ["dense", "structured 0.5", "blocks' floor", "no blocks"]
    assert rows["no blocks"]["parameters"] < rows["blocks' floor"]["parameters"] < 66880
    assert "Amdahl's cap" in run.stdout
