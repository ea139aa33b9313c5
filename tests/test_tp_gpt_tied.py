"""TensorParallelGPT on a GPT the test builds, its head tied to the token embedding (GPT-2's
weight tying) or not: the loss and every gradient equal one process's (float64, 1e-10), with
and without sequence parallelism, and a few AdamW steps later the whole model still does.
An uneven vocabulary (11 over 2 ranks) puts shards of 6 and 5 rows on the two ranks."""

import numpy as np
import pytest

from minidp import comm, nn
from minidp.optim import AdamW
from minidp.parallel.tensor_parallel.gpt import TensorParallelGPT

CFG = nn.GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8)


class TiedHead(nn.Module):
    """logits = x E^T with E the token embedding's own Parameter (one weight, two uses)."""

    def __init__(self, wte: nn.Embedding):
        self.weight = wte.weight

    def forward(self, x):
        return x @ self.weight.T


def build_gpt(tied: bool) -> nn.GPT:
    gpt = nn.GPT(CFG, seed=3, dtype=np.float64)
    if tied:
        gpt.head = TiedHead(gpt.wte)
    return gpt


def batch(step: int):
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, CFG.vocab_size, size=(3, CFG.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


def whole_grads(tp: TensorParallelGPT, group) -> dict[str, np.ndarray]:
    """The whole model's gradients by name; under sequence parallelism the replicated ones
    are partial sums over positions, added here (as the strategy does)."""
    grads = tp.gather_whole("grad")
    if tp.replicated_grads_partial:
        for p in tp.sharded_and_replicated()[1]:
            grads[p.placement.name] = comm.allreduce(p.grad, group=group)
    return grads


def check_like_one_process(group, tied: bool, sequence_parallel: bool) -> None:
    gpt = build_gpt(tied)
    tp = TensorParallelGPT(build_gpt(tied), group, sequence_parallel=sequence_parallel)
    assert tp.tied == tied
    names = [name for name, _ in gpt.named_parameters()]
    assert ("head.weight" in names) != tied  # a tied weight is listed once, as wte.weight
    assert len(tp.parameters()) == len(names)
    opt, tp_opt = AdamW(gpt.parameters(), lr=1e-2), AdamW(tp.parameters(), lr=1e-2)
    for step in range(3):
        idx, targets = batch(step)
        want = nn.cross_entropy(gpt(idx), targets)
        got = tp.loss(idx, targets)
        np.testing.assert_allclose(got.item(), want.item(), rtol=1e-10)
        want.backward()
        got.backward()
        grads = whole_grads(tp, group)
        for name, p in gpt.named_parameters():
            np.testing.assert_allclose(grads[name], p.grad, rtol=1e-10, atol=1e-13, err_msg=name)
        if tp.replicated_grads_partial:  # the summed gradients, as the strategy steps them
            for p in tp.sharded_and_replicated()[1]:
                p.grad = grads[p.placement.name]
        opt.step()
        tp_opt.step()
        opt.zero_grad()
        tp_opt.zero_grad()
    weights = tp.gather_whole("data")
    for name, p in gpt.named_parameters():
        np.testing.assert_allclose(weights[name], p.data, rtol=1e-10, atol=1e-13, err_msg=name)


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tp_gpt_equals_one_process_tied_or_not(tied):
    group = comm.world()
    for sequence_parallel in (False, True):
        check_like_one_process(group, tied, sequence_parallel)


def test_a_head_tensor_parallelism_cannot_split_is_refused():
    one = comm.world().split(comm.world().rank)  # a group of one: no messages
    gpt = nn.GPT(nn.GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=2, n_embd=8))
    gpt.head.weight = gpt.wte.weight  # an nn.Linear computes X E, not the tied X E^T
    with pytest.raises(ValueError, match=r"full.head is an nn.Linear whose weight is full.wte"):
        TensorParallelGPT(gpt, one)
    gpt.head = nn.LayerNorm(8)
    with pytest.raises(ValueError, match=r"full.head must be an nn.Linear or tied .* LayerNorm"):
        TensorParallelGPT(gpt, one)
    one.free()
