# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 18 · Mixture of experts: routing, capacity, the auxiliary loss, the all-to-all
#
# Launch line:
#
# mpiexec -n 4 python tutorials/18_experts.py
#
# A mixture-of-experts (MoE) layer replaces a transformer's MLP by E MLPs, the *experts*, and
# a router that sends each token to k of them (GShard, Lepikhin et al. 2020; Switch
# Transformer, Fedus, Zoph & Shazeer 2021). We route a handful of tokens by hand and check
# the library's routing, capacity and auxiliary loss against it; then send tokens to experts
# on other ranks with two all-to-alls written out, equal to one process; then the library's
# `ExpertParallel` on a small GPT, its bytes and its groups; and last, what the auxiliary
# loss does to the experts' load in training. (float64 where results are compared.)

# %%
import math
import os
import tempfile

import numpy as np

from minidp import Tensor, comm, cross_entropy, nn, optim
from minidp.engine import functional as F
from minidp.models.data import char_corpus, lm_batch
from minidp.models.moe import (
    Expert,
    capacity,
    expert_load,
    load_balancing_loss,
    moe_layers,
    plot_expert_load,
    route,
)
from minidp.parallel.experts import ExpertParallel, alltoall_bytes
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # one BLAS thread a rank (4 ranks share the cores)
world = comm.world()
rank, P = world.rank, world.size
assert P == 4, "this tutorial runs on 4 ranks"
F64 = np.float64

# %% [markdown]
# ## 1. Why: more parameters, the same arithmetic per token
#
# An MoE layer of E experts holds E MLPs' parameters (and the router's C x E), but each
# token runs through only k of them: the model grows E-fold while a token's cost grows
# k-fold. Counted on the modules, and on the rows the experts computed:

# %%
C, E = 16, 4
rng = np.random.default_rng(0)
mlp = Expert(C, 4 * C, rng=rng, dtype=F64)  # one expert: the GPT block's MLP
moe = nn.MoE(C, E, top_k=2, rng=rng, dtype=F64)  # dropless: capacity_factor 0
n_mlp, n_moe = (sum(p.size for p in m.parameters()) for m in (mlp, moe))
assert n_moe == E * n_mlp + C * E  # E experts and a bias-free router
moe(Tensor(rng.normal(size=(64, C))))
assert moe.load.routed.sum() == 64 * 2 and moe.load.dropped.sum() == 0  # N k expert rows
print0(f"1. one MLP {n_mlp:,} parameters, MoE of {E}: {n_moe:,}; 64 tokens at top-2 made "
       f"{moe.load.routed.sum()} expert rows: two MLPs' arithmetic a token")  # fmt: skip

# %% [markdown]
# ## 2. Routing by hand: softmax, top-k, gates, capacity
#
# The router is one Linear to E logits; p = softmax. Top-1 (Switch) sends token n to its
# best expert with gate p[n, e1] (not renormalized, else it is 1 and the router learns
# nothing from the task); top-2 (GShard) to its two best, gates renormalized to sum to 1.
# Each expert takes at most `capacity = ceil(cf N k / E)` assignments, served every first
# choice in token order, then every second choice; the rest are dropped.

# %%
N, cf = 8, 1.0
moe = nn.MoE(C, E, top_k=1, capacity_factor=cf, rng=np.random.default_rng(1), dtype=F64)
moe.router.weight.data[...] = rng.normal(0, 0.3, (C, E))  # a router with opinions
x = rng.normal(size=(N, C))
logits = x @ moe.router.weight.data
p = np.exp(logits - logits.max(axis=1, keepdims=True))
p /= p.sum(axis=1, keepdims=True)
assert np.allclose(p, F.softmax(moe.router(Tensor(x)), axis=-1).data, rtol=1e-14, atol=0)
best = np.argsort(-p, axis=1, kind="stable")[:, :2]  # each token's two best, best first
top1_gate = p[np.arange(N), best[:, 0]]
top2_gate = np.take_along_axis(p, best, axis=1)
top2_gate /= top2_gate.sum(axis=1, keepdims=True)
print0("2. token  p[n, :]                  top-1 (e: gate)   top-2 (e1 e2: gates)")
for n in range(N):
    row = " ".join(f"{v:.2f}" for v in p[n])
    print0(f"   {n}      {row}   {best[n, 0]}: {top1_gate[n]:.2f}         "
           f"{best[n, 0]} {best[n, 1]}: {top2_gate[n, 0]:.2f} {top2_gate[n, 1]:.2f}")  # fmt: skip


def serve(best: np.ndarray, k: int, cap: int):
    """Kept (token, expert, slot) in the order served, and the dropped (token, expert)."""
    taken, kept, dropped = [0] * E, [], []
    for i in range(k):  # all first choices, then all second choices
        for n in range(len(best)):
            e = best[n, i]
            if taken[e] < cap:
                kept.append((n, e, taken[e]))
                taken[e] += 1
            else:
                dropped.append((n, e))
    return kept, dropped


for k, gate in ((1, top1_gate[:, None]), (2, top2_gate)):
    cap = math.ceil(cf * N * k / E)
    assert cap == capacity(cf, N, k, E)
    kept, dropped = serve(best, k, cap)
    r = route(Tensor(p), k, cf)  # the library's
    assert [tuple(a) for a in zip(r.token, r.expert, r.position)] == kept
    want_gate = [gate[n, best[n].tolist().index(e)] for n, e, _ in kept]
    assert np.allclose(r.gate.data, want_gate, rtol=1e-14, atol=0)
    assert r.dropped.sum() == len(dropped)
    dropped = [(int(n), int(e)) for n, e in dropped]
    print0(f"   top-{k}: capacity ceil({cf} * {N} * {k} / {E}) = {cap}; dropped "
           f"(token, expert): {dropped}")  # fmt: skip

# %% [markdown]
# A token whose only choice was dropped gets nothing from the layer: its MoE output is 0,
# and the block's residual connection carries it on unchanged.

# %%
y = moe(Tensor(x)).data  # top-1, capacity factor 1.0: the library's layer
lost = [n for n, _ in serve(best, 1, capacity(cf, N, 1, E))[1]]
served = np.setdiff1d(np.arange(N), lost)
assert lost and np.all(y[lost] == 0) and np.all(np.abs(y[served]).sum(axis=1) > 0)
print0(f"   the layer's output rows for tokens {lost}: exactly 0")

# %% [markdown]
# ## 3. Switch Transformer's auxiliary loss, by hand
#
#     aux = E * sum_e f_e P_e      f_e: the share of assignments the router made to e
#                                  P_e: the mean over the tokens of p[n, e]
#
# f is a count (no gradient); P carries the gradient to the router. Both sum to 1; at an
# even load aux = 1. To set p exactly we give a layer E input features and the identity as
# router: softmax(log p) = p.

# %%
balanced = np.full((N, E), 0.1)
balanced[np.arange(N), np.arange(N) % E] = 0.7  # token n prefers expert n mod E
crowded = np.tile([0.7, 0.1, 0.1, 0.1], (N, 1))  # every token prefers expert 0
for name, probs, want in (("balanced", balanced, 1.0), ("crowded", crowded, E * 0.7)):
    f = np.bincount(probs.argmax(axis=1), minlength=E) / N
    P_e = probs.mean(axis=0)
    aux = E * (f * P_e).sum()
    layer = nn.MoE(E, E, top_k=1, rng=np.random.default_rng(0), dtype=F64)
    layer.router.weight.data[...] = np.eye(E)
    x_log = Tensor(np.log(probs), requires_grad=True)
    layer(x_log)
    assert np.isclose(aux, want, rtol=1e-12) and np.isclose(layer.aux_loss.item(), aux, rtol=1e-12)
    assert np.isclose(f.sum(), 1) and np.isclose(P_e.sum(), 1)  # both sum to 1
    layer.aux_loss.backward()
    print0(f"3. {name:8s} f = {f}, P = {P_e.round(3)}: aux = {aux:.3f} (the layer's "
           f"{layer.aux_loss.item():.3f})")  # fmt: skip
# the crowded case: a step down the gradient lowers expert 0's logit, raises the others'
assert np.all(x_log.grad[:, 0] > 0) and np.all(x_log.grad[:, 1:] < 0)

# %% [markdown]
# ## 4. Expert parallelism by hand: two all-to-alls on 4 ranks
#
# Four ranks, four experts, expert j on rank j. Each rank routes its own 6 tokens (top-2,
# dropless) and packs them by destination rank into a (P, S, C) buffer: row j holds its
# tokens for expert j, zero-padded to S slots (the all-to-all moves equal rows, so S is the
# largest count any rank sends anyone: one allreduce(max)). The all-to-all sends row j to
# rank j; rank j runs its expert over the P S rows it got; the same all-to-all sends every
# output row back; each rank adds its tokens' outputs weighted by their gates. The
# reference: the same MoE over all 24 tokens in one process.

# %%
T, C = 6, 8
moe = nn.MoE(C, E, top_k=2, rng=np.random.default_rng(3), dtype=F64, hidden=16)
x_all = np.random.default_rng(4).normal(size=(P * T, C))
y_ref = moe(Tensor(x_all)).data  # every rank can afford the reference here
x = x_all[rank * T : (rank + 1) * T]

p = F.softmax(moe.router(Tensor(x)), axis=-1).data
best = np.argsort(-p, axis=1, kind="stable")[:, :2]
gate = np.take_along_axis(p, best, axis=1)
gate /= gate.sum(axis=1, keepdims=True)
to_rank = [np.nonzero(best == j) for j in range(P)]  # (tokens, which choice) for expert j
counts = np.array([len(tokens) for tokens, _ in to_rank])
S = int(comm.allreduce(counts.max(keepdims=True), op="max")[0])
buf = np.zeros((P, S, C))
for j, (tokens, _) in enumerate(to_rank):
    buf[j, : len(tokens)] = x[tokens]  # pack: my tokens for rank j's expert

world.reset_counters()
got = comm.alltoall(buf, algo="pairwise")  # got[i]: rank i's tokens for my expert
out = moe.experts[rank](Tensor(got.reshape(P * S, C))).data.reshape(P, S, C)
back = comm.alltoall(out, algo="pairwise")  # back[j]: my tokens, through expert j
y = np.zeros((T, C))
for j, (tokens, choice) in enumerate(to_rank):
    y[tokens] += gate[tokens, choice][:, None] * back[j, : len(tokens)]  # combine

np.testing.assert_allclose(y, y_ref[rank * T : (rank + 1) * T], rtol=1e-12, atol=1e-15)
table = comm.allgather(counts)  # table[i, j]: tokens rank i sends to rank j
assert (table.sum(axis=1) == 2 * T).all()  # every token twice (top-2)
assert S == table.max()  # the largest count any rank sends anyone
sent = world.counters["alltoall"]["bytes_sent"]
assert sent == 2 * (P - 1) * S * C * 8  # two all-to-alls, P - 1 rows sent, own row copied
print0("4. tokens rank i sends to rank j (its own row is a local copy):")
for i in range(P):
    print0(f"   rank {i}: {table[i].tolist()}")
print0(f"   S = {S} slots a row; {sent} bytes sent by rank 0 in the two all-to-alls; "
       f"{100 * (1 - table.sum() / (P * P * S)):.0f}% of the slots are padding; the "
       f"outputs equal one process's")  # fmt: skip

# %% [markdown]
# ## 5. The library: `ExpertParallel` on a MoE GPT, dp 4 x ep 2
#
# Every block's MLP a MoE of 4 experts (top-2, capacity factor 1.0). The 4 ranks are the
# data-parallel ranks, each reading 2 of the 8 sequences of a batch; EP groups of 2
# consecutive ranks split the experts, so each expert has two replicas, one per EP group,
# and those replicas reduce its gradients (its *expert-data-parallel* group). The
# reference is one process over the whole batch, told the batch is 4 slices
# (`capacity_groups = 4`): capacity is counted per rank's slice, so it must drop exactly
# the assignments the 4 ranks drop. Three AdamW steps:

# %%
train_ids, _, tokenizer = char_corpus()
BLOCK, PER_RANK = 16, 2
cfg = nn.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=2, n_head=4,
                   n_embd=32, n_experts=4, top_k=2, capacity_factor=1.0)  # fmt: skip
starts = np.random.default_rng(5).integers(0, len(train_ids) - BLOCK - 1, (3, P * PER_RANK))
batches = [lm_batch(train_ids, s, BLOCK) for s in starts]


def train(model, net, rows, sync=lambda: None):
    """Three AdamW steps of `model` on `rows` of each batch: losses, loads, each step's S."""
    opt = optim.AdamW(model.parameters(), lr=3e-3)
    losses, loads, slots = [], [], []
    for inputs, targets in batches:
        opt.zero_grad()
        loss = cross_entropy(model(inputs[rows]), targets[rows]) + load_balancing_loss(net)
        loss.backward()
        sync()
        opt.step()
        losses.append(comm.allreduce(np.array([loss.item()]), op="avg")[0])
        loads.append(expert_load(net))
        slots.append([layer.load.slots for _, layer in moe_layers(net)])
    return losses, loads, slots


alone = nn.GPT(cfg, seed=1, dtype=F64)
for _, layer in moe_layers(alone):
    layer.capacity_groups = P  # each rank's slice its own capacity
want_losses, want_loads, _ = train(alone, alone, slice(None))
pooled = nn.GPT(cfg, seed=1, dtype=F64)  # without: one capacity over the whole batch
pooled(batches[0][0])
assert expert_load(pooled)["dropped"] != want_loads[0]["dropped"]

net = nn.GPT(cfg, seed=1, dtype=F64)
model = ExpertParallel(net, world, ep=2, algo="pairwise")
model.ep_group.reset_counters()
mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
losses, loads, slots = train(model, net, mine, sync=model.finish_gradient_sync)
np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
assert loads == want_loads and sum(load["dropped"] for load in loads) > 0
assignments = 2 * 2 * P * PER_RANK * BLOCK  # layers x top-2 x tokens
assert all(sum(map(sum, load["tokens_per_expert"])) == assignments for load in loads)
state = model.full_state_dict()
for name, p in alone.named_parameters():
    np.testing.assert_allclose(state[name], p.data, rtol=1e-10, atol=1e-13, err_msg=name)
print0(f"5. losses {np.round(losses, 4).tolist()} equal one process's; dropped "
       f"{[load['dropped'] for load in loads]} of {assignments} assignments "
       f"a step, as one process of 4 capacity groups drops (1 group: "
       f"{expert_load(pooled)['dropped']} at step 0)")  # fmt: skip

# %% [markdown]
# Four all-to-alls a MoE layer a step (dispatch and combine, and their reverses in
# backward), each sending (ep - 1) rows of E/ep experts x S slots x C features; S is each
# step's slot count (`layer.load.slots`, at most the capacity ceil(1.0 x 32 x 2 / 4) = 16):

# %%
sent = model.ep_group.counters["alltoall"]["bytes_sent"]
formula = sum(4 * alltoall_bytes(2, 4, width, 32, 8) for step in slots for width in step)
assert sent == formula and max(max(step) for step in slots) <= capacity(1.0, 32, 2, 4)
print0(f"   all-to-all bytes sent by this rank in 3 steps: {sent:,} = the formula's, with "
       f"S = {slots} (step, layer)")  # fmt: skip

# %% [markdown]
# The groups: EP groups of consecutive ranks exchange tokens; an expert's replicas, one in
# each EP group, reduce its gradients (`finish_gradient_sync`: allreduce(sum) over them,
# divided by dp); the router, attention and embeddings are averaged over all 4 ranks.

# %%
_, first_layer = model.layers[0]
lo = model.ep_group.rank * len(first_layer.experts)  # my experts: lo, lo + 1
held = comm.allgather(np.arange(lo, lo + len(first_layer.experts)))  # held[r]: rank r's
for e in range(lo, lo + len(first_layer.experts)):
    holders = tuple(int(r) for r in np.flatnonzero((held == e).any(axis=1)))
    assert holders == model.expert_dp_group.world_ranks  # its replicas are its group
    assert len(holders) == P // 2  # dp / ep replicas
groups = comm.allgather(np.array(model.ep_group.world_ranks + model.expert_dp_group.world_ranks))
for r in range(P):
    print0(f"   rank {r}: EP group {tuple(groups[r, :2].tolist())}, experts "
           f"{held[r].tolist()}, their gradients reduced over ranks "
           f"{tuple(groups[r, 2:].tolist())}")  # fmt: skip

# %% [markdown]
# ## 6. Load balance: training with and without the auxiliary loss
#
# Nothing in the task's loss asks the router to spread the tokens; left alone it tends to
# favour a few experts, which then do most of the work (and under EP set S, the padding
# every rank sends). Each rank trains its own tiny MoE GPT in one process (top-1, dropless,
# 4 experts in each of 2 blocks) on the embedded text, 30 steps with Switch's coefficient
# 0.01 on the auxiliary loss and 30 without, each rank from its own seed; we count the
# assignments per expert over the last 15 steps.

# %%
STEPS = 30


def load_run(coef: float, seed: int) -> np.ndarray:
    """Assignments per (layer, expert) over the second half of a training run."""
    cfg = nn.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=2, n_head=4,
                       n_embd=32, n_experts=4, top_k=1, aux_loss_coef=coef)  # fmt: skip
    model = nn.GPT(cfg, seed=seed)
    opt = optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)
    counts = np.zeros((cfg.n_layer, cfg.n_experts), dtype=np.int64)
    for step in range(STEPS):
        inputs, targets = lm_batch(train_ids, rng.integers(0, len(train_ids) - 17, 8), 16)
        opt.zero_grad()
        (cross_entropy(model(inputs), targets) + load_balancing_loss(model)).backward()
        opt.step()
        if step >= STEPS // 2:
            counts += np.array(expert_load(model)["tokens_per_expert"])
    return counts


runs = {coef: load_run(coef, seed=rank) for coef in (0.0, 0.01)}
share = {coef: comm.allgather(c.max(axis=1) / c.sum(axis=1)) for coef, c in runs.items()}
for coef, c in runs.items():
    print0(
        f"6. aux coef {coef}: rank 0's tokens per expert {c.tolist()} (layer, expert); "
        f"the busiest expert's share on ranks 0-3: {share[coef].mean(axis=1).round(2)}"
    )
busiest_without, busiest_with = (share[coef].mean(axis=1) for coef in (0.0, 0.01))
assert (busiest_with < busiest_without - 0.05).all()  # every seed, by a margin
assert busiest_with.mean() < busiest_without.mean() - 0.1
print0(f"   even is {1 / E:.2f}; the busiest expert's mean share {busiest_without.mean():.2f}"
       f" without the aux loss, {busiest_with.mean():.2f} with it")  # fmt: skip

if rank == 0:
    layers = ["block 0", "block 1"]
    record = {  # both runs in one picture: plot_expert_load draws a group of bars a layer
        "layers": [f"{name}, aux {coef}" for coef in runs for name in layers],
        "tokens_per_expert": [row.tolist() for c in runs.values() for row in c],
        "dropped_per_expert": [[0] * E for _ in runs for _ in layers],
    }
    title = f"tokens per expert, last {STEPS // 2} steps, rank 0's seed"
    plot_expert_load(record, os.path.join(tempfile.gettempdir(), "minidp_18_experts.png"), title)

# %% [markdown]
# ## 7. Where this sits, and what it costs
#
# Expert parallelism lives inside data parallelism (DeepSpeed-MoE's and Megatron-LM's
# arrangement): the dp ranks that would each hold the whole model split the experts in EP
# groups of ep ranks, so a rank holds E/ep experts a layer and every expert has dp/ep
# replicas that average its gradients; everything else is plain data parallelism. The
# price is the all-to-all: four a MoE layer a step, (ep - 1)(E/ep) S C numbers each, with
# S set by the busiest expert. Equal rows mean padding (section 4); a capacity factor
# bounds S and the bytes, but drops the assignments past it, which then ride the residual
# untouched (section 2); the auxiliary loss evens the load (section 6), and docs/experts.md
# measures what that saves in dropped tokens and padding. On the command line:
# `mpiexec -n 4 python -m minidp --experts 4 --ep 2` (or `--strategy hybrid --dp 4 ...`),
# with `--moe-top-k`, `--capacity-factor`, `--moe-every` and `--aux-loss-coef`;
# docs/experts.md has what they compose with and a measured table.
