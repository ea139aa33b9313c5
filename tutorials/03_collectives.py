# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 03 · Collectives from point-to-point messages
#
# Launch line:
#
# mpiexec -n 4 python tutorials/03_collectives.py
#
# Data parallelism needs one operation above all: every rank holds a gradient, every rank
# needs the sum. MPI calls it *allreduce*. Here we see it built from nothing but sends and
# receives, three ways, and count what each rank sends: the naive way through one root,
# a binomial tree, and recursive doubling. (The ring, the one that wins for big gradients,
# is tutorial 04.)

# %%
import numpy as np

from minidp import comm
from minidp.comm import p2p
from minidp.tools.info import one_blas_thread
from minidp.tools.log import print0

one_blas_thread()  # one BLAS thread per rank: the ranks share the cores

group = comm.world().dup()  # a private copy of the world: its own counters
rank, p = group.rank, group.size

# %% [markdown]
# ## 1. Point-to-point: one message, then a ring of them
#
# `p2p.send` / `p2p.recv` move one NumPy array between two ranks. A step where every rank
# sends *and* receives must not be written as "send, then receive": if the messages are
# large, MPI cannot buffer them, every rank blocks in its send, and nobody ever receives.
# `sendrecv` does both at once, which is how every algorithm in `minidp.comm` takes a step.

# %%
if rank == 0:
    p2p.send(group, np.arange(3.0), 1)
elif rank == 1:
    got = np.empty(3)
    p2p.recv(group, got, 0)
    assert got.tolist() == [0.0, 1.0, 2.0]

token = np.array([rank], np.int64)
from_left = np.empty(1, np.int64)
p2p.sendrecv(group, token, group.right, from_left, group.left)  # pass it around the ring
assert from_left[0] == (rank - 1) % p
print0(f"{p} ranks; rank 0 received {from_left[0]} from its left neighbour")

# %% [markdown]
# ## 2. Three allreduces, and what each rank sends
#
# With n bytes per rank, α the cost of one message and β the cost of one byte (Thakur,
# Rabenseifner & Gropp, 2005):
#
# | algorithm | how | busiest rank sends | time |
# |---|---|---|---|
# | naive | all to rank 0, which adds and sends the sum to each | (p-1)·n | 2(p-1)(α + nβ) |
# | tree | binomial reduce to rank 0, then binomial broadcast | lg p·n | 2 lg p·(α + nβ) |
# | recursive doubling | round k: swap all with rank ⊕ 2^k, add | lg p·n | lg p·(α + nβ) |
#
# The group's counters record every message, so we can check the table.

# %%
n_elems = p << 14  # a multiple of p: the ring's chunks come out equal
x = np.arange(n_elems, dtype=np.float32) % 7 + rank  # small integers: exact in any order
n = x.nbytes
want = comm.allreduce(x, algo="mpi", group=group)  # MPI's own, for reference
lg = (p - 1).bit_length()  # ceil(lg p)

print0(f"\nallreduce of {n // 1024} KiB per rank; bytes sent by each rank, in units of n:")
ring = 2 * (p - 1) / p  # tutorial 04's ring, for comparison
for algo, busiest in (("naive", p - 1), ("tree", lg), ("recursive_doubling", lg), ("ring", ring)):
    group.reset_counters()
    got = comm.allreduce(x, algo=algo, group=group)
    assert np.array_equal(got, want)  # the same bits as MPI's own
    mine = group.counters["allreduce"]
    sent = comm.gather(np.array([mine["bytes_sent"], mine["messages_sent"]]), group=group)
    if rank == 0:
        in_n = ", ".join(f"{b / n:g}" for b in sent[:, 0])
        print0(f"  {algo:>18}: [{in_n}]   messages: {sent[:, 1].tolist()}")
        assert sent[:, 0].max() == busiest * n  # the table's "busiest rank sends"
        assert sent[0, 0] == busiest * n or algo == "ring"  # naive's and tree's root: rank 0
        if algo == "naive":  # the root sends p-1 copies, every other rank one
            assert (sent[1:, 0] == n).all() and sent[0, 1] == p - 1
        if algo == "recursive_doubling" and p & (p - 1) == 0:  # lg p swaps, every rank
            assert (sent[:, 0] == lg * n).all() and (sent[:, 1] == lg).all()
        if algo == "ring":  # every rank the same 2(p-1) messages of n/p
            assert (sent[:, 0] == ring * n).all() and (sent[:, 1] == 2 * (p - 1)).all()

# %% [markdown]
# The naive root sends p-1 copies while the others send one: its link is the bottleneck,
# and it grows with p. The tree spreads the work but still funnels everything through
# rank 0 twice. Recursive doubling has every rank do the same lg p exchanges, half the
# tree's rounds. All three send at least lg p whole vectors from some rank; for large n
# that is the cost to beat, and the ring (tutorial 04, the last row) beats it from p = 4 on:
# every rank sends 2(p-1)/p·n, under 2n for any p (at p = 2 it ties, 1·n), in 2(p-1)
# messages of n/p.
#
# ## 3. The binomial tree, drawn
#
# Relative to the root, rank v's parent is v with its lowest set bit cleared. Broadcast
# walks the tree down (parents send), reduce walks it up (children send, parents add).

# %%
for v in range(1, p):
    print0(f"  rank {v} <- parent {v & (v - 1)}")
seen = np.zeros(4) if rank else np.array([3.0, 1.0, 4.0, 1.0])
comm.broadcast(seen, root=0, algo="tree", group=group)
assert seen.tolist() == [3.0, 1.0, 4.0, 1.0]
total = comm.reduce(np.full(2, rank + 1), root=0, algo="tree", group=group)
if rank == 0:
    assert total.tolist() == [p * (p + 1) / 2] * 2

# %% [markdown]
# ## 4. When ranks disagree
#
# A collective is a promise that every rank calls it with matching arguments. With checks
# on (the default; `MINIDP_CHECKS=0` turns them off) each collective first swaps a small
# fingerprint, so a mismatch raises `CollectiveMismatch` on every rank, naming who called
# what, instead of hanging or silently mixing up data. (Setting `checks = True` below keeps
# the cell true for a reader who runs it with checks off.)

# %%
strict = group.dup()
strict.checks = True
try:
    comm.allreduce(np.ones(5 if rank == p - 1 else 4), group=strict)
except comm.CollectiveMismatch as error:
    print0("\nCollectiveMismatch, as expected:\n" + str(error).split("\n", 1)[1])
else:
    raise AssertionError("a shape mismatch went unnoticed")
print0("\n03_collectives: all checks passed")
