"""Each tensor-parallel layer against the whole layer it was cut from: forward and every
gradient (input and each parameter), float64, at tp 2 and 3 (uneven vocabulary and feature
splits), with and without sequence parallelism; then the whole TP GPT against nn.GPT with an
uneven vocabulary. One launch per group size checks them all."""

from dataclasses import replace

import numpy as np
import pytest

from minidp import Tensor, comm, nn
from minidp import functional as F
from minidp.parallel.mesh import Mesh
from minidp.parallel.tensor_parallel.communications import sequence_range
from minidp.parallel.tensor_parallel.gpt import TensorParallelGPT
from minidp.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
)
from minidp.parallel.tensor_parallel.vocab import (
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from minidp.tools.chunks import chunk_range

F64 = np.float64


def mine(n, group):
    return slice(*chunk_range(n, group.size, group.rank))


def check(full, layer, x, group, split_in, split_out, differentiable_input=True):
    """Forward and backward of `full` on x and of `layer` on split_in(x), the same seed
    gradient (split_out of it): outputs, input gradients and every parameter's gradient."""
    rng = np.random.default_rng(5)
    wholes = dict(full.named_parameters())
    for w in wholes.values():
        w.grad = None
    xf = Tensor(x, requires_grad=differentiable_input) if differentiable_input else x
    yf = full(xf)
    seed = rng.standard_normal(yf.shape)
    yf.backward(seed)
    xp = Tensor(split_in(x), requires_grad=True) if differentiable_input else split_in(x)
    yp = layer(xp)
    np.testing.assert_allclose(yp.data, split_out(yf.data), rtol=1e-12, atol=1e-14)
    yp.backward(np.ascontiguousarray(split_out(seed)))
    if differentiable_input:
        np.testing.assert_allclose(xp.grad, split_in(xf.grad), rtol=1e-12, atol=1e-14)
    for p in layer.parameters():
        place, want = p.placement, wholes[p.placement.name].grad
        if place.axis is None:
            got = comm.allreduce(p.grad, group=group) if layer_is_sp(layer) else p.grad
        else:
            got, want = p.grad, np.take(want, place.index, axis=place.axis)
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-14, err_msg=place.name)


def layer_is_sp(layer):
    return any(getattr(m, "sequence_parallel", False) for m in [layer, *modules(layer)])


def modules(m):
    for _, child in m.children():
        yield child
        yield from modules(child)


def every_layer(group):
    """Run check() over the table of layers on this TP group."""
    p, rng = group.size, np.random.default_rng(1)
    B, T, C = 2, 6, 12  # T and the 6 heads divide by 2 and 3
    x = rng.standard_normal((B, T, C))
    whole, last = (lambda a: a), (lambda a: a[..., mine(a.shape[-1], group)])

    def seq(a):
        return a[:, slice(*sequence_range(a.shape[1], group))]

    def linear(n_in, n_out, bias=True):
        return nn.Linear(n_in, n_out, bias, rng=rng, dtype=F64)

    full = linear(C, 2 * C + 1)  # 25 output features: an uneven split at tp 2 and 3
    check(full, ColumnParallelLinear(full, group), x, group, whole, last)
    check(full, ColumnParallelLinear(full, group, sequence_parallel=True), x, group, seq, last)
    full = linear(C, 2 * C)
    check(full, ColumnParallelLinear(full, group, gather_output=True), x, group, whole, whole)
    full = linear(C + 1, C)  # 13 input features: uneven rows
    x13 = rng.standard_normal((B, T, C + 1))
    check(full, RowParallelLinear(full, group), x13, group, last, whole)
    check(full, RowParallelLinear(full, group, sequence_parallel=True), x13, group, last, seq)
    full = linear(C, C)
    check(full, RowParallelLinear(full, group, input_is_parallel=False), x, group, whole, whole)

    cfg = nn.GPTConfig(vocab_size=10, block_size=T, n_layer=1, n_head=6, n_embd=C)
    block = nn.Block(cfg, rng=rng, dtype=F64)
    for sp, cut in ((False, whole), (True, seq)):
        mlp = ParallelMLP(block.fc, block.fc_proj, group, sequence_parallel=sp)

        def block_mlp(t):
            return block.fc_proj(F.gelu(block.fc(t)))

        block_mlp.named_parameters = block.named_parameters  # the whole layer's names
        check(block_mlp, mlp, x, group, cut, cut)
        attn = ParallelAttention(block.attn, group, sequence_parallel=sp)
        check(block.attn, attn, x, group, cut, cut)

    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    table = nn.Embedding(cfg.vocab_size, C, rng=rng, dtype=F64)  # 10 rows: uneven at 3 (and 4)
    for sp, cut in ((False, whole), (True, seq)):
        emb = VocabParallelEmbedding(table, group, sequence_parallel=sp)
        check(table, emb, tokens, group, whole, cut, differentiable_input=False)

    logits = rng.standard_normal((B, T, cfg.vocab_size)) * 3
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    targets[0, 0] = cfg.vocab_size - 1  # the last rank's range is used
    zf = Tensor(logits, requires_grad=True)
    want = nn.cross_entropy(zf, targets)
    want.backward()
    cols = mine(cfg.vocab_size, group)
    zp = Tensor(logits[..., cols], requires_grad=True)
    got = vocab_parallel_cross_entropy(zp, targets, cols.start, group)
    np.testing.assert_allclose(got.item(), want.item(), rtol=1e-13)
    got.backward()
    np.testing.assert_allclose(zp.grad, zf.grad[..., cols], rtol=1e-12, atol=1e-15)
    assert p > 1 and comm.allreduce(np.array([1.0]), group=group)[0] == p

    # the whole GPT, its vocabulary of 10 split unevenly at tp 3: loss and every gradient
    gpt = nn.GPT(replace(cfg, n_layer=2), seed=2, dtype=F64)
    want = nn.cross_entropy(gpt(tokens), targets)
    want.backward()
    for sp in (False, True):
        tp_gpt = TensorParallelGPT(gpt, group, sequence_parallel=sp)
        got = tp_gpt.loss(tokens, targets)
        np.testing.assert_allclose(got.item(), want.item(), rtol=1e-13)
        got.backward()
        grads = tp_gpt.gather_whole("grad")
        if sp:  # replicated gradients are partial sums over positions (the strategy adds them)
            for q in tp_gpt.sharded_and_replicated()[1]:
                grads[q.placement.name] = comm.allreduce(q.grad, group=group)
        for name, q in gpt.named_parameters():
            np.testing.assert_allclose(grads[name], q.grad, rtol=1e-10, atol=1e-14, err_msg=name)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(120)
def test_every_layer_equals_the_whole_layer():
    mesh = Mesh(tp=comm.world().size)
    every_layer(mesh.tp_group)
    mesh.close()


def dropout_masks_agree(group, sequence_parallel: bool) -> bool:
    """Do the ranks' embedding-dropout masks agree (each on its own positions under SP)?"""
    cfg = nn.GPTConfig(vocab_size=16, block_size=6, n_layer=1, n_head=6, n_embd=12, dropout=0.5)
    model = TensorParallelGPT(nn.GPT(cfg, seed=0, dtype=F64), group, sequence_parallel=True)
    if not sequence_parallel:
        model = TensorParallelGPT(nn.GPT(cfg, seed=0, dtype=F64), group)
    T = 6 // group.size if sequence_parallel else 6
    kept = (model.drop(Tensor(np.ones((1, T, 12)))).data != 0).astype(F64).ravel()
    every = comm.allgather(kept, group=group).reshape(group.size, -1)
    return bool((every == every[0]).all())


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_dropout_masks_follow_what_each_rank_holds():
    """Replicated positions: the same masks on every TP rank (else the replicas drift);
    sequence parallel: each rank's T/p positions draw their own (as one process would)."""
    group = comm.world()
    assert dropout_masks_agree(group, sequence_parallel=False)
    assert not dropout_masks_agree(group, sequence_parallel=True)
