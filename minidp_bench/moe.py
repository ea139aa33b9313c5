"""Mixture of experts, measured: the tokens dropped against the capacity factor, the
experts' load with and without the auxiliary loss, and the all-to-all bytes against the
formula.

    mpiexec -n 2 python -m minidp bench moe [--steps 40] [--json FILE] [--out DIR]

Each row trains a small GPT with E = 4 experts in every block (n_layer 2, n_embd 32,
n_head 4, block 32, float32, AdamW lr 3e-3, global batch 8) on the embedded text for
--steps steps, under ExpertParallel with ep = the world size, the same batches for every
row. Rows: top-1 and top-2, each with capacity factors 1.0, 1.25 and 2.0 and the aux loss
at 0.01, then dropless with the aux loss at 0.01 and at 0.

Columns: dropped_pct, the assignments dropped past capacity over all steps (of N k a step);
imbalance, the busiest expert's assignments over the mean (1: even; E: one expert takes
all), averaged over the layers and the second half of the steps; padding_pct, the share of
the exchanged slots that carried no token (every expert gets S slots from every rank, S the
largest need: dropless pays for the busiest); final_loss, the last step's cross entropy
(the aux term left out); alltoall_kB, what each rank sent in all-to-alls per step, measured
on the EP group; the run stops with exit code 1 if it differs from the formula
(comm/alltoall bytes: 4 a layer of (ep - 1) (E/ep) S C itemsize). --out: the load of the
last step of the two dropless top-1 runs, with and without the aux loss, as pictures.
"""

import os

import numpy as np

from minidp import comm, cross_entropy, nn, optim
from minidp.models.data import char_corpus, lm_batch
from minidp.models.moe import expert_load, load_balancing_loss, plot_expert_load
from minidp.parallel.experts import ExpertParallel, alltoall_bytes
from minidp.tools.log import die, print0
from minidp.tools.parser import Parser
from minidp_bench._common import print_table, summary, write_json

ROWS = [(k, cf, 0.01) for k in (1, 2) for cf in (1.0, 1.25, 2.0)] + [
    (k, 0.0, coef) for k in (1, 2) for coef in (0.01, 0.0)
]
E, C, BLOCK, BATCH = 4, 32, 32, 8


def run(top_k: float, capacity_factor: float, coef: float, steps: int, group) -> dict:
    """Train one row's model; its figures (the same on every rank)."""
    train_ids, _, tokenizer = char_corpus()
    cfg = nn.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=2,
                       n_head=4, n_embd=C, n_experts=E, top_k=top_k,
                       capacity_factor=capacity_factor, aux_loss_coef=coef)  # fmt: skip
    model = ExpertParallel(nn.GPT(cfg, seed=0), group, ep=group.size)
    opt = optim.AdamW(model.parameters(), lr=3e-3)
    rng, per_rank = np.random.default_rng(0), BATCH // group.size
    mine = slice(group.rank * per_rank, (group.rank + 1) * per_rank)
    dropped = assignments = padding = slots = 0
    formula, imbalance = 0, []
    model.ep_group.reset_counters()
    for step in range(steps):
        x, y = lm_batch(train_ids, rng.integers(0, len(train_ids) - BLOCK - 1, BATCH), BLOCK)
        opt.zero_grad()
        ce = cross_entropy(model(x[mine]), y[mine])
        (ce + load_balancing_loss(model.module)).backward()
        model.finish_gradient_sync()
        opt.step()
        for _, layer in model.layers:
            load = layer.load
            dropped += int(load.dropped.sum())
            assignments += load.tokens * top_k
            sent = group.size * E * load.slots  # slots exchanged by every rank together
            slots, padding = (
                slots + sent,
                padding + sent - int(load.routed.sum() - load.dropped.sum()),
            )
            formula += 4 * alltoall_bytes(group.size, E, load.slots, C, 4)
            if step >= steps // 2:
                imbalance.append(load.routed.max() / load.routed.mean())
    sent = model.ep_group.counters.get("alltoall", {}).get("bytes_sent", 0)
    if sent != formula:
        raise SystemExit(f"bench moe: all-to-all bytes {sent} != formula {formula}")
    return {
        "top_k": top_k, "capacity_factor": capacity_factor, "aux_loss_coef": coef,
        "dropped_pct": 100 * dropped / assignments, "imbalance": float(np.mean(imbalance)),
        "padding_pct": 100 * padding / slots, "final_loss": float(
            comm.allreduce(np.array([ce.item()]), op="avg", group=group)[0]),
        "alltoall_kB": sent / steps / 1e3, "ep": group.size, "steps": steps,
        "load": expert_load(model.module),
    }  # fmt: skip


def main(argv: list[str]) -> int:
    parser = Parser(prog="minidp bench moe", description=summary(__doc__))
    parser.add_argument("--steps", type=int, default=40, help="training steps per row")
    parser.add_argument("--out", default="runs/bench_experts", help="directory for the PNGs")
    parser.add_argument("--json", metavar="FILE", help="write JSON lines (rank 0)")
    args = parser.parse_args(argv)
    group = comm.world()
    if args.steps < 2 or BATCH % group.size or E % group.size:
        raise die("bench moe: needs --steps >= 2 and 1, 2, 4 or 8 ranks")
    print0(f"bench moe: GPT 2 layers, n_embd {C}, block {BLOCK}, E {E} in every block, "
           f"global batch {BATCH}, {args.steps} steps, float32 | ep {group.size}")  # fmt: skip
    rows = [run(k, cf, coef, args.steps, group) for k, cf, coef in ROWS]
    if group.rank == 0:
        columns = [("top_k", "d"), ("capacity_factor", ".2f"), ("aux_loss_coef", ".2f"),
                   ("dropped_pct", ".1f"), ("imbalance", ".2f"), ("padding_pct", ".1f"),
                   ("final_loss", ".3f"), ("alltoall_kB", ".1f")]  # fmt: skip
        print_table(rows, columns)
        for row in rows:
            if row["top_k"] == 1 and row["capacity_factor"] == 0:
                name = f"expert_load_aux_{row['aux_loss_coef']:g}.png"
                title = f"top-1 dropless, aux coef {row['aux_loss_coef']:g}: last step"
                plot_expert_load(row["load"], os.path.join(args.out, name), title)
        write_json(args.json, rows)
    return 0
