"""`FullyShardedDataParallel` ("full": ZeRO-3, "grad_op": ZeRO-2) is one process on the global
batch, sharded: on a user's MLP (a weight tied across two layers, a frozen bias, a parameter
of the model's own, one no forward reads; uneven slices, clipping, a step of two
micro-batches) and on a tiny GPT, after every AdamW step the shards' union
(full_state_dict) equals the one-process parameters (float64, 1e-10), the same on every
rank; the frozen bias never moves, the unused parameter gets no gradient. Under "full" a
rank holds Ψ/N parameters between steps (counted from its arrays), and a step sends
3(N-1)Ψ·b over the ranks together, "grad_op" 2(N-1)Ψ·b.
"""

import numpy as np
import pytest

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.parallel import FullyShardedDataParallel
from minidp.parallel.across_ranks import replica_spread
from minidp.tools.chunks import chunk_range
from minidp.tools.memory import nbytes

STEPS, BATCH, MAX_NORM = 4, 10, 0.5  # 10 examples: uneven slices over 3 ranks
ADAMW = dict(lr=0.01, weight_decay=0.1)
SHARDINGS = ("full", "grad_op")


class Net(nn.Module):
    """A user's MLP: fc3 reuses fc2's weight (tied across two layers), fc2's bias is frozen,
    `scale` is the model's own and `unused` is read by no forward. Units: the model's own
    (scale, unused, the tied weight), fc1, fc3 (its bias), fc4; Ψ = 204 trainable."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.fc1, self.fc2, self.fc3, self.fc4 = (
            nn.Linear(a, b, rng=rng, dtype=np.float64) for a, b in ((6, 9), (9, 9), (9, 9), (9, 4))
        )
        self.fc3.weight = self.fc2.weight
        self.fc2.bias.requires_grad = False
        self.scale = nn.Parameter(rng.uniform(0.5, 1.5, 4))
        self.unused = nn.Parameter(rng.standard_normal(7))

    def forward(self, x):
        h = self.fc3(self.fc2(self.fc1(x, relu=True), relu=True), relu=True)
        return self.fc4(h) * self.scale


def tiny_gpt():
    config = nn.GPTConfig(vocab_size=12, block_size=6, n_layer=3, n_head=2, n_embd=8)
    return nn.GPT(config, seed=1, dtype=np.float64)


def mlp_batch(step):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((BATCH, 6)), rng.integers(0, 4, BATCH)


def gpt_batch(step):
    tokens = np.random.default_rng(200 + step).integers(0, 12, (BATCH, 7))
    return tokens[:, :-1], tokens[:, 1:]


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def perturbed(model, group):
    """Other initial weights on every rank but 0: the wrapper starts from rank 0's."""
    for p in model.parameters():
        p.data += 0.1 * group.rank
    return model


def check(fsdp, ref, start, group, where):
    """The shards' union equals the reference's parameters, on every rank alike; the frozen
    bias and the unused parameter (no gradient: no weight decay either) never moved."""
    state, want = fsdp.full_state_dict(), ref.state_dict()
    assert state.keys() == want.keys(), where
    for name, value in want.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=where)
    assert replica_spread(list(state.values()), group) == 0.0, where
    for name in ("fc2.bias", "unused"):
        if name in start:
            assert np.array_equal(state[name], start[name]), f"{where} {name} moved"


def reference_step(ref, opt, x, y, clip):
    opt.zero_grad()
    cross_entropy(ref(x), y).backward()
    if clip:
        optim.clip_grad_norm(trainable(ref), MAX_NORM)
    opt.step()


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(120)
def test_mlp_with_tied_frozen_and_unused_parameters_equals_one_process():
    group = comm.world()
    for sharding in SHARDINGS:
        ref, start = Net(), Net().state_dict()
        model = perturbed(Net(), group)
        with FullyShardedDataParallel(model, group, sharding) as fsdp:
            assert fsdp.units == ["(the model's own)", "fc1", "fc3", "fc4"]
            mine = comm.allreduce(np.array([fsdp.shard_numel]), group=group)[0]
            assert mine == sum(p.size for p in trainable(ref)) == 204  # the tied weight once
            opt = optim.AdamW(fsdp.parameters(), **ADAMW)
            plain = optim.AdamW(trainable(ref), **ADAMW)
            for step in range(STEPS):
                where = f"{sharding} N={group.size} step {step}"
                x, y = mlp_batch(step)
                lo, hi = chunk_range(BATCH, group.size, group.rank)
                fsdp.set_batch_share(hi - lo, BATCH)
                if step < STEPS - 1:
                    out = fsdp(Tensor(x[lo:hi]))
                    if sharding == "grad_op":  # the previous update, gathered by the forward
                        for p, q in zip(model.parameters(), ref.parameters()):
                            np.testing.assert_allclose(p.data, q.data, rtol=1e-10, err_msg=where)
                        assert replica_spread([p.data for p in model.parameters()], group) == 0
                    cross_entropy(out, y[lo:hi]).backward()
                else:  # two micro-batches, each loss weighted by its share of the slice
                    mid = (lo + hi) // 2
                    with fsdp.no_sync():
                        loss = cross_entropy(fsdp(Tensor(x[lo:mid])), y[lo:mid])
                        (loss * ((mid - lo) / (hi - lo))).backward()
                    loss = cross_entropy(fsdp(Tensor(x[mid:hi])), y[mid:hi])
                    (loss * ((hi - mid) / (hi - lo))).backward()
                fsdp.finish_gradient_sync()
                fsdp.clip_grad_norm(MAX_NORM)
                opt.step()
                reference_step(ref, plain, Tensor(x), y, clip=True)
                check(fsdp, ref, start, group, where)
                # no rank reached `unused`: its pieces' .grad is None, on whichever ranks
                none = sum(q.size for q in fsdp.parameters() if q.grad is None)
                assert comm.allreduce(np.array([none]), group=group)[0] == model.unused.size
                assert all(p.grad is None for p in trainable(model)), "whole gradients left"


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.timeout(120)
def test_gpt_equals_one_process_and_counts_memory_and_bytes():
    group, b, n = comm.world(), 8, comm.world().size
    for sharding in SHARDINGS:
        ref, model = tiny_gpt(), perturbed(tiny_gpt(), group)
        psi = ref.num_parameters()
        with FullyShardedDataParallel(model, group, sharding, algo="ring") as fsdp:
            opt = optim.AdamW(fsdp.parameters(), **ADAMW)
            plain = optim.AdamW(ref.parameters(), **ADAMW)
            for step in range(STEPS):
                x, y = gpt_batch(step)
                lo, hi = chunk_range(BATCH, n, group.rank)
                fsdp.set_batch_share(hi - lo, BATCH)
                fsdp.comm_group.reset_counters()
                cross_entropy(fsdp(x[lo:hi]), y[lo:hi]).backward()
                fsdp.finish_gradient_sync()
                opt.step()
                counters = fsdp.comm_group.counters
                reference_step(ref, plain, x, y, clip=False)
                check(fsdp, ref, {}, group, f"GPT {sharding} N={n} step {step}")
                # bytes, the ranks together: each element of a gather reaches the N - 1
                # ranks that lack it; a reduce-scatter sends as much (ring.py)
                kinds = ("allgather", "reduce_scatter")
                sent = np.array([counters.get(k, {"bytes_sent": 0})["bytes_sent"] for k in kinds])
                comm.allreduce(sent, group=group, out=sent)
                gathers = 2 if sharding == "full" else int(step > 0)  # grad_op: the forward's
                assert sent.tolist() == [gathers * (n - 1) * psi * b, (n - 1) * psi * b]
                assert "allreduce" not in counters  # the reached flags go on `group`
            # what a rank holds between steps, counted from its arrays: under "full" its
            # chunks (and an 8-byte stand-in per parameter), under "grad_op" the whole model
            held = nbytes([*(p.data for p in model.parameters()), *(q.data for q in opt.params)])
            grads = nbytes([*(p.grad for p in model.parameters()), *(q.grad for q in opt.params)])
            assert grads == b * fsdp.shard_numel  # the gradient shard only
            if sharding == "full":
                assert held == b * (fsdp.shard_numel + len(model.parameters()))
                largest = b * max(fsdp.layout.lengths)  # a block
                assert fsdp.shards.gathered.gathered_peak <= 2 * largest < b * psi
            else:
                assert held == b * psi


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.timeout(60)
def test_a_block_whose_layer_norms_and_linears_are_units_equals_one_process():
    """FSDP of one GPT Block: its LayerNorms and Linears are units, each gathered around its
    own forward; the fused LayerNorm + Linear would read their stand-ins, so it gives way to
    the composed ops (gpt.norm_linear) and the step equals one process."""
    group = comm.world()
    cfg = nn.GPTConfig(vocab_size=12, block_size=6, n_layer=1, n_head=2, n_embd=8)
    ref, model = (nn.Block(cfg, rng=np.random.default_rng(3), dtype=np.float64) for _ in "ab")
    x = np.random.default_rng(4).standard_normal((BATCH, 6, 8))
    y = np.random.default_rng(5).integers(0, 8, BATCH * 6)
    lo, hi = chunk_range(BATCH, group.size, group.rank)
    with FullyShardedDataParallel(model, group, "full") as fsdp:
        assert {"ln1", "ln2", "fc"} <= set(fsdp.units)
        opt = optim.AdamW(fsdp.parameters(), **ADAMW)
        fsdp.set_batch_share(hi - lo, BATCH)
        out = fsdp(Tensor(x[lo:hi]))
        cross_entropy(out.reshape(-1, 8), y[lo * 6 : hi * 6]).backward()
        fsdp.finish_gradient_sync()
        opt.step()
        plain = optim.AdamW(ref.parameters(), **ADAMW)
        cross_entropy(ref(Tensor(x)).reshape(-1, 8), y).backward()
        plain.step()
        state = fsdp.full_state_dict()
        for name, value in ref.state_dict().items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


# ---- serial ------------------------------------------------------------------------------
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_a_group_of_one_is_exactly_the_plain_optimizer(sharding):
    ref, model = Net(), Net()
    fsdp = FullyShardedDataParallel(model, sharding=sharding)
    opt, plain = optim.AdamW(fsdp.parameters(), **ADAMW), optim.AdamW(trainable(ref), **ADAMW)
    for step in range(STEPS):
        x, y = mlp_batch(step)
        cross_entropy(fsdp(Tensor(x)), y).backward()
        fsdp.finish_gradient_sync()
        opt.step()
        reference_step(ref, plain, Tensor(x), y, clip=False)
        state = fsdp.full_state_dict()
        for name, value in ref.state_dict().items():
            assert np.array_equal(state[name], value), (sharding, step, name)
    # a second backward before the sync would be lost: refused, naming a parameter
    cross_entropy(fsdp(Tensor(x)), y).backward()
    with pytest.raises(RuntimeError, match=r"a second backward reached \w"):
        cross_entropy(fsdp(Tensor(x)), y).backward()
    fsdp.close()


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="sharding must be 'full'.*got 'zero3'"):
        FullyShardedDataParallel(Net(), sharding="zero3")
    with pytest.raises(ValueError, match="algo must be one of"):
        FullyShardedDataParallel(Net(), algo="tree")
    with pytest.raises(TypeError, match="model must be a minidp.nn.Module"):
        FullyShardedDataParallel([nn.Parameter(np.zeros(3))])
    frozen = Net()
    for p in frozen.parameters():
        p.requires_grad = False
    with pytest.raises(ValueError, match="model has no parameter that requires grad"):
        FullyShardedDataParallel(frozen)
