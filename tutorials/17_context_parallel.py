# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 17 · Context parallelism: the sequence split over the ranks
#
# Launch line:
#
# mpiexec -n 4 python tutorials/17_context_parallel.py
#
# Tensor parallelism splits the weights; context parallelism (CP) splits the sequence: each
# of the C ranks holds the whole model and T/C positions of every sequence. Every layer of
# a transformer works position by position except attention, where each query needs every
# earlier key. We do attention over a split sequence by hand: the online softmax on one
# rank, then ring attention on 4 ranks with point-to-point messages, then its causal load
# imbalance and the zig-zag layout that removes it. Then the library's `ContextParallel`
# (ring and DeepSpeed-Ulysses) trains a small GPT equal to one process.
# docs/context_parallel.md has the whole story; every number below is computed by this
# run, every claim asserted.

# %%
import os
import tempfile

import numpy as np

from minidp import comm, nn, optim
from minidp.comm import p2p
from minidp.fast.fused_attention import causal_self_attention
from minidp.parallel import (
    ContextParallel,
    SequenceLayout,
    ring_attention,
    ring_bytes,
    ulysses_attention,
    ulysses_bytes,
)
from minidp.tools import memory
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0
from minidp.tools.plots import pyplot, save

one_blas_thread()  # one BLAS thread per rank: 4 ranks share the cores
world = comm.world()
rank, C = world.rank, world.size  # C: the ranks of the context-parallel group (4)
assert C == 4, "launch with mpiexec -n 4"

# %% [markdown]
# ## 1. Why: attention's T x T scores
#
# One head's scores are a T x T matrix, and backward wants its softmax P kept: per layer,
# H T² numbers. Split the sequence over C ranks and each rank's queries need T/C x T of
# them; computed one key block at a time (section 2), only T/C x T/C exist at once, and
# backward needs only one number per query and head. Float32, 32 heads, C = 4, one layer:

# %%
H, w = 32, 4
print0("     T   one process: H T^2   per rank: H (T/C) T   one block: H (T/C)^2")
for T_big in (4096, 32768, 131072):
    whole, split, block = H * T_big**2 * w, H * T_big**2 * w // C, H * (T_big // C) ** 2 * w
    assert whole == C * split == C * C * block
    gib = [f"{b / 2**30:10.2f} GiB" for b in (whole, split, block)]
    print0(f"{T_big:6d}   {gib[0]}   {gib[1]}        {gib[2]}")

# %% [markdown]
# What each rank needs from the others, under the causal mask, with contiguous chunks
# (rank r holds positions [r T/C, (r+1) T/C)): the keys and values of every rank whose
# chunk has a key at or before one of its queries. Read off the mask itself:

# %%
T = 16  # the sequence of sections 3-4 and 6: 4 positions a rank
future = np.triu(np.ones((T, T), dtype=bool), k=1)  # future[i, j]: key j after query i
n = T // C
for r in range(C):
    needs = [j for j in range(C) if not future[r * n : (r + 1) * n, j * n : (j + 1) * n].all()]
    assert needs == list(range(r + 1))
    print0(f"rank {r} (positions {r * n}-{(r + 1) * n - 1}) needs the K/V of ranks {needs}")

# %% [markdown]
# ## 2. The online softmax by hand
#
# y = Σ_j exp(s_j) v_j / Σ_j exp(s_j) over keys that arrive in blocks. Three running
# numbers per query carry all a block leaves behind (Milakov & Gimelshein 2018;
# FlashAttention): the max m of the scores so far, the sum l of exp(s - m), and the
# unnormalized output a = Σ exp(s - m) v. A block with scores S and values V folds in as
# m' = max(m, max S), c = exp(m - m'), l' = c l + Σ exp(S - m'), a' = c a + exp(S - m') V;
# at the end y = a / l. Every exponent is <= 0: nothing overflows, where exp(s) would.

# %%
HS = 8  # head size
scale = 1.0 / np.sqrt(HS)


def softmax_attention(q, k, v, mask=None):
    """The reference: every score at once, softmax over each row, the weighted sum."""
    S = q @ k.T * scale
    if mask is not None:
        S = np.where(mask, -np.inf, S)
    P = np.exp(S - S.max(axis=1, keepdims=True))
    return P / P.sum(axis=1, keepdims=True) @ v


def fold(m, l, a, S, V):
    """One block of scores S (queries x keys) and values V into the running (m, l, a)."""
    m_new = np.maximum(m, S.max(axis=1))
    c = np.exp(m - m_new)  # the old terms rescaled to the new max (0 before any block)
    P = np.exp(S - m_new[:, None])
    return m_new, c * l + P.sum(axis=1), c[:, None] * a + P @ V


rng = np.random.default_rng(0)
q = 3 * rng.standard_normal((4, HS))  # 4 queries, scores of a few units
k, v = rng.standard_normal((2, 8, HS))  # 8 keys and values: two blocks of 4
L = np.log(np.exp(q @ k.T * scale).sum(axis=1))  # each query's log-sum-exp
for order in ((slice(0, 4), slice(4, 8)), (slice(4, 8), slice(0, 4))):  # either order
    m, l, a = np.full(4, -np.inf), np.zeros(4), np.zeros((4, HS))
    for keys in order:  # two key blocks, one after the other
        m, l, a = fold(m, l, a, q @ k[keys].T * scale, v[keys])
    assert np.allclose(a / l[:, None], softmax_attention(q, k, v), rtol=1e-13, atol=1e-14)
    assert np.allclose(m + np.log(l), L, rtol=1e-14)  # L = m + log l: kept for backward
gap = np.abs(a / l[:, None] - softmax_attention(q, k, v)).max()
with np.errstate(over="ignore"):  # scores in the thousands: exp(s) alone is inf
    assert np.isinf(np.exp(300 * q @ k.T * scale)).any()
m, l, a = fold(np.full(4, -np.inf), np.zeros(4), np.zeros((4, HS)), 300 * q @ k.T * scale, v)
assert np.allclose(a / l[:, None], softmax_attention(300 * q, k, v), rtol=1e-13, atol=1e-14)
print0(f"2. online softmax over 2 key blocks: {gap:.1e} from the full softmax (float64)")

# %% [markdown]
# ## 3. The ring by hand, 4 ranks
#
# Each rank holds T/C positions of q, k and v (one head). The queries stay; the K/V blocks
# go round: at step s rank r holds the block that started on rank r - s. Before computing
# with it, the rank posts the receive of the next block from its left and the send of this
# one to its right (`p2p.irecv`, `p2p.isend`), so the message travels while it computes;
# then it waits (`p2p.waitall`) and swaps. A pair (query chunk, key chunk) is skipped when
# every key comes after every query, and masked by global position where they overlap.
# `chunks[r]` lists rank r's [lo, hi) ranges of positions: one each here, two in section 4.

# %%
rng = np.random.default_rng(1)
q_all, k_all, v_all = rng.standard_normal((3, T, HS))  # the same on every rank (one seed)
want = softmax_attention(q_all, k_all, v_all, future)  # one process's causal attention


def rows_of(chunks):
    """Each chunk (lo, hi) with the slice of a rank's rows that holds it."""
    start = 0
    for lo, hi in chunks:
        yield lo, hi, slice(start, start + hi - lo)
        start += hi - lo


def ring_by_hand(chunks):
    """This rank's causal attention rows; the (T, T) map of the scores it computed; per
    step, whose K/V block it held and how many scores it computed with it."""
    mine = np.concatenate([np.arange(lo, hi) for lo, hi in chunks[rank]])
    q = q_all[mine] * scale
    kv = np.stack([k_all[mine], v_all[mine]])  # my K/V block: what travels
    arriving = np.empty_like(kv)
    m, l, a = np.full(len(mine), -np.inf), np.zeros(len(mine)), np.zeros((len(mine), HS))
    computed, held, work = np.zeros((T, T), int), np.zeros(C, int), np.zeros(C, int)
    for step in range(C):
        source = held[step] = (rank - step) % C
        requests = []
        if step < C - 1:  # the next block on its way while this one is computed
            requests = [
                p2p.irecv(world, arriving, world.left),
                p2p.isend(world, kv, world.right),
            ]
        for q_lo, q_hi, rows in rows_of(chunks[rank]):
            for k_lo, k_hi, cols in rows_of(chunks[source]):
                if k_lo >= q_hi:
                    continue  # every key after every query: skipped
                S = np.where(future[q_lo:q_hi, k_lo:k_hi], -np.inf, q[rows] @ kv[0, cols].T)
                m[rows], l[rows], a[rows] = fold(m[rows], l[rows], a[rows], S, kv[1, cols])
                computed[q_lo:q_hi, k_lo:k_hi] = 1
                work[step] += S.size
        if requests:
            p2p.waitall(world, requests, [world.left, world.right])
        kv, arriving = arriving, kv  # (the send is done: its buffer is free)
    return mine, a / l[:, None], computed, held, work


def show_steps(held, work) -> None:
    """held[r, s], work[r, s] of every rank: a row per step, a column per rank."""
    print0("   step " + "".join(f"  rank {r}   " for r in range(C)).rstrip())
    for s in range(C):
        cells = "".join(f"  KV{held[r, s]} {work[r, s]:3d}  " for r in range(C))
        print0(f"   {s:4d} {cells.rstrip()}")


contiguous = [[(r * n, (r + 1) * n)] for r in range(C)]
mine, y, computed, held, work = ring_by_hand(contiguous)
assert np.allclose(y, want[mine], rtol=1e-12, atol=1e-13)
every = comm.allgather(np.stack([held, work]))  # (rank, held/work, step)
print0("3. the ring, contiguous: KVj n = the block of rank j held, n scores computed with it")
show_steps(every[:, 0], every[:, 1])
gaps = comm.allgather(np.array([np.abs(y - want[mine]).max()]))
print0(f"   every rank's rows within {gaps.max():.1e} of one process's causal attention")

# %% [markdown]
# ## 4. The load imbalance, then zig-zag
#
# Under the causal mask rank r computes r + 1 of the C blocks (the zeros above): the last
# rank works, the first one waits. Count the scores each rank computed, then cut the
# sequence into 2C chunks and give rank i chunks i and 2C-1-i, an early one and a late one,
# and run the same ring again.

# %%
half = T // (2 * C)
zigzag = [
    [(i * half, (i + 1) * half), ((2 * C - 1 - i) * half, (2 * C - i) * half)] for i in range(C)
]
assert zigzag == [SequenceLayout(T, C, zigzag=True).chunks(i) for i in range(C)]  # the library's
mine_z, y_z, computed_z, held_z, work_z = ring_by_hand(zigzag)
assert np.allclose(y_z, want[mine_z], rtol=1e-12, atol=1e-13)
every_z = comm.allgather(np.stack([held_z, work_z]))
print0("4. the ring, zig-zag (rank i: chunks i and 2C-1-i):")
show_steps(every_z[:, 0], every_z[:, 1])

maps = {"contiguous": comm.allgather(computed), "zig-zag": comm.allgather(computed_z)}
for name, layout_maps in maps.items():
    per_rank = layout_maps.sum(axis=(1, 2))
    assert (layout_maps.sum(axis=0)[~future] == 1).all()  # every needed score, exactly once
    assert layout_maps.sum(axis=0).max() == 1  # and none twice
    layout = SequenceLayout(T, C, zigzag=name == "zig-zag")
    assert per_rank.tolist() == [layout.causal_work(r) for r in range(C)]  # the library counts so
    ratio = per_rank.max() / per_rank.mean()
    print0(f"   {name:10s} scores per rank {per_rank.tolist()}: busiest / mean = {ratio:.2f}")
    if name == "contiguous":
        assert np.isclose(ratio, 2 * C / (C + 1))  # 1.60 at C = 4
    else:
        assert per_rank.tolist() == [(2 * C + 1) * half**2] * C  # 2C+1 blocks of (T/2C)^2

# %% [markdown]
# ## 5. The library: `ContextParallel` on a GPT
#
# `ContextParallel(model, group, algo, zigzag)` feeds each rank its positions of the batch
# (the position embedding looks up their global places), swaps each attention's core for
# ring attention (the above, with every head and batch row, and its backward: the K/V
# round again with their gradients) or Ulysses (an all-to-all to a head split, plain
# attention on whole sequences of H/C heads, an all-to-all back), sums the loss over the
# group, and `finish_gradient_sync()` sums each gradient, a partial sum of T/C positions.
# A small GPT, float64, block 64, 3 AdamW steps, against one process; the bytes each rank
# sent for attention per step, read from the group's counters.

# %%
CFG = nn.GPTConfig(vocab_size=16, block_size=64, n_layer=2, n_head=4, n_embd=32)
B, STEPS = 2, 3
ATTENTION = {"ring": ("p2p", ring_bytes), "ulysses": ("alltoall", ulysses_bytes)}


def batch(step: int):
    tokens = np.random.default_rng(step).integers(0, CFG.vocab_size, size=(B, CFG.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


def train(algo: str | None = None, zigzag: bool = False):
    """STEPS AdamW steps of the GPT, on one process (algo None) or context parallel: the
    model, the losses, and the bytes this rank sent for attention at each step."""
    model = nn.GPT(CFG, seed=1, dtype=np.float64)
    cp = ContextParallel(model, world, algo, zigzag) if algo else None
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    losses, sent = [], []
    for step in range(STEPS):
        idx, targets = batch(step)
        world.reset_counters()
        loss = cp.loss(idx, targets) if cp else nn.cross_entropy(model(idx), targets)
        loss.backward()
        if cp:
            cp.finish_gradient_sync()  # each gradient summed over the group
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if algo:
            sent.append(world.counters.get(ATTENTION[algo][0], {}).get("bytes_sent", 0))
    return model, losses, sent


alone, alone_losses, _ = train()  # every rank runs the reference itself
sent_per_step = {}
for algo, zigzag in (("ring", True), ("ulysses", False)):
    model, losses, sent = train(algo, zigzag)
    assert np.allclose(losses, alone_losses, rtol=1e-10)
    gap = max(np.abs(p.data - q.data).max() for p, q in zip(model.parameters(), alone.parameters()))
    assert gap < 1e-10
    qkv_shape = (B, CFG.block_size // C, 3 * CFG.n_embd)  # one rank's q, k, v of one layer
    predicted = CFG.n_layer * sum(ATTENTION[algo][1](qkv_shape, 8, C))  # forward + backward
    assert sent == [predicted] * STEPS
    sent_per_step[algo] = predicted
    print0(
        f"5. {algo:7s}{' zig-zag' if zigzag else '        '}: losses {np.round(losses, 4)}, "
        f"weights {gap:.1e} from one process; {predicted / 1024:.0f} KB sent per rank per step "
        f"for attention, as {ATTENTION[algo][1].__name__} says"
    )

# %% [markdown]
# The memory attention keeps for backward, one call of the GPT's shape (B, T, 3 n_embd):
# one process keeps P, B H T² numbers; the ring keeps none of it, only each query's
# log-sum-exp L = m + log l (B H T/C numbers): backward recomputes each block's
# P = exp(S - L). Ulysses keeps its H/C heads' P over the whole sequence, 1/C of it, and
# their whole-sequence q, k, v and y. Measured with tracemalloc (NumPy reports its arrays
# to it), the output not counted; for CP, the most any rank keeps.


# %%
def kept_for_backward(attend, qkv: np.ndarray) -> int:
    """Bytes a forward leaves allocated while its graph lives, its output not counted."""
    return memory.kept_for_backward(attend, qkv)[0]


Tg, Hg = CFG.block_size, CFG.n_head
qkv = np.random.default_rng(2).standard_normal((B, Tg, 3 * CFG.n_embd))
layout = SequenceLayout(Tg, C, zigzag=True)
future_g, mine_g = np.triu(np.ones((Tg, Tg), bool), k=1), layout.shard(qkv, rank)
kept = {
    "one process": kept_for_backward(lambda x: causal_self_attention(x, Hg, future_g), qkv),
    "ring": kept_for_backward(lambda x: ring_attention(x, Hg, world, layout), mine_g),
    "ulysses": kept_for_backward(lambda x: ulysses_attention(x, Hg, world, layout), mine_g),
}
P_bytes = B * Hg * Tg * Tg * 8  # one process's probabilities, float64
assert P_bytes <= kept["one process"]
assert kept["ring"] <= kept["one process"] / C  # no P at all: L and a little bookkeeping
assert P_bytes / C <= kept["ulysses"] < kept["one process"]  # its heads' P: 1/C of it
kept = {name: comm.allreduce(np.array([b]), op="max")[0] for name, b in kept.items()}  # busiest
print0(
    "5. kept for backward, one attention call: "
    + ", ".join(f"{name} {b / 1024:.1f} KB" for name, b in kept.items())
    + f" (P alone: {P_bytes / 1024:.0f} KB; L: {B * Hg * (Tg // C) * 8 / 1024:.0f} KB)"
)

# %% [markdown]
# ## 6. A picture: who computes which scores
#
# The causal score matrix of section 4 (T = 16, C = 4), each score colored by the rank
# that computed it (pale where masked inside a computed block), white where skipped:
# contiguous on the left, zig-zag on the right.

# %%
plt = pyplot()
if plt is not None and rank == 0:
    colors = plt.get_cmap("tab10")(np.arange(C))[:, :3]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.6))
    for ax, (name, layout_maps) in zip(axes, maps.items()):
        picture = np.ones((T, T, 3))
        for r in range(C):
            done = layout_maps[r] == 1
            picture[done & ~future] = colors[r]
            picture[done & future] = 0.35 * colors[r] + 0.65  # computed, then masked
        ax.imshow(picture)
        ax.set_xticks(np.arange(-0.5, T, T // (2 * C)), minor=True)
        ax.set_yticks(np.arange(-0.5, T, T // (2 * C)), minor=True)
        ax.grid(which="minor", color="0.8", linewidth=0.5)
        per_rank = layout_maps.sum(axis=(1, 2))
        ax.set_title(f"{name}: scores per rank {per_rank.tolist()}")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[r]) for r in range(C)]
    axes[1].legend(handles, [f"rank {r}" for r in range(C)], loc="upper right")  # skipped: free
    save(fig, os.path.join(tempfile.gettempdir(), "minidp_17_context_parallel.png"))

# %% [markdown]
# ## 7. Ring or Ulysses
#
# The ring passes every K/V block past every rank: each rank sends C-1 blocks forward,
# (C-1)/C of the layer's whole K and V, and backward the blocks again with their gradient
# accumulators. Ulysses sends (C-1)/C of its own rows of q, k, v and y, 1/C of the whole,
# each way, in four all-to-alls. With a block of 2 (T/C) n_embd numbers a call sends
# (C-1) + (2C-1) blocks by the ring and 2 (C-1)/C of 2 blocks by Ulysses. Per step and
# rank, from section 5:

# %%
ratio = sent_per_step["ring"] / sent_per_step["ulysses"]
assert np.isclose(ratio, (3 * C - 2) * C / (4 * (C - 1)))  # 3.33 at C = 4
kb = {algo: f"{b / 1024:.0f} KB" for algo, b in sent_per_step.items()}
print0(f"7. ring {kb['ring']}, Ulysses {kb['ulysses']} per step and rank: {ratio:.2f}x")
few_heads = nn.GPTConfig(vocab_size=16, block_size=64, n_layer=1, n_head=2, n_embd=32)
try:
    ContextParallel(nn.GPT(few_heads, seed=1), world, "ulysses")
    raise AssertionError("Ulysses accepted 2 heads over 4 ranks")
except ValueError as refused:  # a head is never split: C must divide H
    print0(f"   {refused}")

# %% [markdown]
# Ulysses sends fewer bytes, but nothing overlaps its all-to-alls, it keeps 1/C of the
# probabilities (the ring keeps none) and its C must divide the heads: C <= H. The ring
# works for any C that divides T (2C with zig-zag), hides each hop behind a block's
# compute, and needs zig-zag under the causal mask or its last rank sets the pace. On the
# command line, context parallelism is an axis of the hybrid strategy:
# `--strategy hybrid --cp C --cp-algo ring|ulysses`. docs/context_parallel.md has the
# backward, the cost table and measured times.
