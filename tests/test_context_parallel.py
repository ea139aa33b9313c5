"""Context parallelism against one process (float64): ring attention (contiguous and
zig-zag) and DeepSpeed-Ulysses, first as attention ops (the output and dq, dk, dv), then on
a GPT the test builds (the loss, every gradient, and the parameters after 3 AdamW steps),
at C = 2 and 4. Beside them: the work per rank with and without zig-zag, the bytes each
algorithm sends against the group's counters, and the bytes each rank keeps for backward.
One launch per group size and kind of check."""

from types import SimpleNamespace

import numpy as np
import pytest

from minidp import Tensor, comm, nn
from minidp.fast.fused_attention import causal_self_attention
from minidp.optim import AdamW
from minidp.parallel import (
    ContextParallel,
    RingWork,
    SequenceLayout,
    ring_attention,
    ring_bytes,
    ulysses_attention,
    ulysses_bytes,
)
from minidp.tools import memory

B, T, C, H = 2, 64, 32, 4  # batch, positions, n_embd, heads
TOL = dict(rtol=1e-10, atol=1e-12)
CFG = nn.GPTConfig(vocab_size=16, block_size=T, n_layer=2, n_head=H, n_embd=C)
VARIANTS = [("ring", False), ("ring", True), ("ulysses", False)]


def one_process(qkv: np.ndarray, seed: np.ndarray):
    """The whole sequence's attention (minidp's own fused op): y and dL/dqkv."""
    x = Tensor(qkv, requires_grad=True)
    y = causal_self_attention(x, H, np.triu(np.ones((T, T), dtype=bool), k=1))
    y.backward(seed)
    return y.data, x.grad


def attend(algo, qkv: Tensor, group, layout, work=None) -> Tensor:
    if algo == "ring":
        return ring_attention(qkv, H, group, layout, work)
    return ulysses_attention(qkv, H, group, layout)


# ---- serial: the layouts and their arithmetic ------------------------------------------------
def test_zigzag_layout_holds_chunks_i_and_2c_minus_1_minus_i():
    layout = SequenceLayout(16, 4, zigzag=True)
    assert [layout.chunks(r) for r in range(4)] == [
        [(0, 2), (14, 16)],
        [(2, 4), (12, 14)],
        [(4, 6), (10, 12)],
        [(6, 8), (8, 10)],
    ]
    every = np.sort(np.concatenate([layout.positions(r) for r in range(4)]))
    assert (every == np.arange(16)).all()
    assert (SequenceLayout(16, 4).positions(1) == np.arange(4, 8)).all()


def test_zigzag_evens_out_the_causal_work():
    """Contiguous, rank i computes i+1 of C blocks: the busiest 2C/(C+1) of the mean;
    zig-zag, every rank 2C+1 of the (2C)^2 small blocks (T/2C on a side)."""
    for ranks in (2, 4, 8):
        plain = [SequenceLayout(64, ranks).causal_work(r) for r in range(ranks)]
        zigzag = [SequenceLayout(64, ranks, zigzag=True).causal_work(r) for r in range(ranks)]
        assert max(plain) / np.mean(plain) == pytest.approx(2 * ranks / (ranks + 1))
        assert zigzag == [(2 * ranks + 1) * (64 // (2 * ranks)) ** 2] * ranks


def test_refusals_are_one_clear_line():
    with pytest.raises(ValueError, match="do not split into 2 x 4"):
        SequenceLayout(20, 4, zigzag=True)
    group = SimpleNamespace(size=4, rank=0)  # refused before any message is sent
    qkv = Tensor(np.zeros((1, 4, 3 * 6)))
    with pytest.raises(ValueError, match="6 heads do not divide by 4 ranks"):
        ulysses_attention(qkv, 6, group, SequenceLayout(16, 4))


# ---- parallel: the attention ops -------------------------------------------------------------
def kept_for_backward(fn, qkv: np.ndarray) -> int:
    """Bytes a forward leaves allocated while its graph lives, its output not counted."""
    return memory.kept_for_backward(fn, qkv)[0]


@pytest.mark.parallel(nprocs=[2, 4])
@pytest.mark.timeout(120)
def test_attention_ops_equal_one_process_and_send_what_they_say():
    group = comm.world()
    p, me = group.size, group.rank
    rng = np.random.default_rng(0)
    qkv, seed = rng.standard_normal((B, T, 3 * C)), rng.standard_normal((B, T, C))
    y_want, grad_want = one_process(qkv, seed)
    works = {}
    for algo, zigzag in [*VARIANTS, ("ulysses", True)]:
        layout = SequenceLayout(T, p, zigzag)
        x = Tensor(layout.shard(qkv, me), requires_grad=True)
        work = RingWork()
        group.reset_counters()
        y = attend(algo, x, group, layout, work)
        np.testing.assert_allclose(y.data, layout.shard(y_want, me), **TOL)
        sent_forward = group.counters["p2p" if algo == "ring" else "alltoall"]["bytes_sent"]
        y.backward(layout.shard(seed, me))
        np.testing.assert_allclose(x.grad, layout.shard(grad_want, me), **TOL)  # dq, dk, dv
        sent = group.counters["p2p" if algo == "ring" else "alltoall"]["bytes_sent"]
        counted = (ring_bytes if algo == "ring" else ulysses_bytes)(x.shape, 8, p)
        assert (sent_forward, sent - sent_forward) == counted, (algo, zigzag)
        if algo == "ring":
            assert work.forward == work.backward == B * H * layout.causal_work(me)
            works[zigzag] = comm.allgather(np.array([work.forward]), group=group).ravel()
    assert max(works[True]) <= 1.1 * np.mean(works[True])  # zig-zag: balanced
    assert max(works[False]) / np.mean(works[False]) == pytest.approx(2 * p / (p + 1))

    # the bytes kept for backward: 1/C of one process's at most (ring: no probabilities at
    # all, each query's log-sum-exp instead); Ulysses keeps 1/C of the probabilities and,
    # besides, its heads' whole-sequence q, k, v and output: (3 + 1) B T C / C numbers
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    whole = kept_for_backward(lambda x: causal_self_attention(x, H, future), qkv)
    layout = SequenceLayout(T, p, zigzag=True)
    ring = kept_for_backward(lambda x: ring_attention(x, H, group, layout), layout.shard(qkv, me))
    ulysses = kept_for_backward(
        lambda x: ulysses_attention(x, H, group, layout), layout.shard(qkv, me)
    )
    assert ring <= whole / p
    assert ulysses <= whole / p + 4 * B * T * C * 8 / p + 4096


# ---- parallel: the GPT -----------------------------------------------------------------------
def batch(step: int):
    tokens = np.random.default_rng(step).integers(0, CFG.vocab_size, size=(B, T + 1))
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parallel(nprocs=[2, 4])
@pytest.mark.timeout(120)
def test_gpt_equals_one_process_for_three_adamw_steps():
    group = comm.world()
    for algo, zigzag in VARIANTS:
        gpt = nn.GPT(CFG, seed=1, dtype=np.float64)
        cp = ContextParallel(nn.GPT(CFG, seed=1, dtype=np.float64), group, algo, zigzag)
        opt, cp_opt = AdamW(gpt.parameters(), lr=1e-2), AdamW(cp.parameters(), lr=1e-2)
        for step in range(3):
            idx, targets = batch(step)
            want = nn.cross_entropy(gpt(idx), targets)
            got = cp.loss(idx, targets)
            np.testing.assert_allclose(got.item(), want.item(), rtol=1e-10)
            want.backward()
            got.backward()
            cp.finish_gradient_sync()
            for (name, p), q in zip(gpt.named_parameters(), cp.module.parameters()):
                np.testing.assert_allclose(q.grad, p.grad, **TOL, err_msg=f"{algo} {name}")
            for o in (opt, cp_opt):
                o.step()
                o.zero_grad()
        for (name, p), q in zip(gpt.named_parameters(), cp.module.parameters()):
            np.testing.assert_allclose(q.data, p.data, **TOL, err_msg=f"{algo} {name}")
