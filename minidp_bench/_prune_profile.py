"""Where a step's time goes, dense against structured 0.5: the Amdahl profile behind
`bench prune --structured`'s speedup (prune.py hands over here with --profile).

    mpiexec -n 4 python -m minidp bench prune --structured --profile    # the main job's
    mpiexec -n 2 python -m minidp bench prune --structured --profile    # a rank per core
    python -m minidp bench prune --structured --profile                 # no messages

Four models of the main job's configuration (the default GPT, global batch 16, float32,
--strategy dp), each already pruned, stepped side by side in rotated rounds on the same
examples; each step's phases timed by the step skeleton's timeline (forward, backward,
gradient sync wait, optimizer; "other": the global loss's allreduce and the Python around
them), each phase the mean over ranks, the step the slowest rank's, medians over rounds:

  dense            the default GPT
  structured 0.5   half of each block's heads and MLP channels (sliced)
  blocks' floor    each block left 1 head and 1 MLP channel: what a block costs that
                   pruning cannot remove (LayerNorms, residual adds, GELU's and attention's
                   per-op Python; one head's attention, a quarter of it, stays too)
  no blocks        n_layer 0: the embeddings, ln_f, the head, the loss and their optimizer

Amdahl: p = (dense - floor) / dense is the part of the step that scales with the heads and
channels; removing half of them gives at most 1 / ((1 - p) + p / 2). The floor overstates
the fixed part a little (its one head, small products less efficient), so the measured
speedup may pass this cap by a little; it cannot pass it by much.
"""

from collections import defaultdict
from dataclasses import replace

import numpy as np
from threadpoolctl import threadpool_limits

from minidp import comm
from minidp.cli.strategies import DataParallel
from minidp.cli.training.config import TrainConfig
from minidp.cli.training.loop import blas_threads_per_rank
from minidp.comm.trace import Timeline
from minidp.models.data import DistributedSampler
from minidp.models.prune import structured
from minidp.models.tasks import Task
from minidp.tools.log import print0
from minidp_bench._common import median, print_table, rotated_rounds, write_json

PHASES = ("forward", "backward", "gradient sync wait", "optimizer")
CUTS = {"dense": None, "structured 0.5": (2, 128), "blocks' floor": (3, 255), "no blocks": None}


def build(config: TrainConfig, cut, group: comm.Group):
    """The dp recipe on `config`'s model, `cut` = (heads, channels) removed from each block
    (as many of the default's 4 and 256); its timeline; this rank's examples."""
    timeline = Timeline(enabled=True)
    strategy = DataParallel(Task(config, np.float32), config, group, timeline)
    if cut is not None:  # as the recipe prunes: DDP closed, sliced, built again
        strategy.dp.close()
        units = structured.gpt_units(strategy.model)
        structured.prune(units[0::2], cut[0], optimizer=strategy.optimizer)  # the heads
        structured.prune(units[1::2], cut[1], optimizer=strategy.optimizer)  # the channels
        strategy.build(strategy.optimizer)
    sampler = DistributedSampler(
        strategy.task.num_examples, config.batch_size, *strategy.data_shard, seed=config.seed
    )
    return strategy, timeline, sampler.local_indices(0)


def profile(args, group: comm.Group) -> list[dict]:
    base = TrainConfig(batch_size=args.batch_size, sample_tokens=0)
    configs = {name: replace(base, n_layer=0) if name == "no blocks" else base for name in CUTS}
    with threadpool_limits(limits=blas_threads_per_rank(0), user_api="blas"):
        built = {name: build(configs[name], CUTS[name], group) for name in CUTS}
        phases = {name: defaultdict(list) for name in built}

        def collect(name):  # after each step, untimed: its spans, then cleared
            timeline = built[name][1]
            for phase in PHASES:
                ms = sum(e["dur"] for e in timeline.events if e["name"] == phase) / 1e3
                phases[name][phase].append(group.comm.allreduce(ms) / group.size)
            timeline.events.clear()

        steps = {name: (lambda s=s, local=local: s.step(local, 1e-4))
                 for name, (s, _, local) in built.items()}  # fmt: skip
        after = {name: (lambda name=name: collect(name)) for name in built}
        times = rotated_rounds(steps, 2, args.rounds, group.comm, after=after)
    rows, dense = [], 1e3 * median(times["dense"])
    for name, (strategy, _, _) in built.items():
        step = 1e3 * median(times[name])
        parts = {p: median(phases[name][p][2:]) for p in PHASES}  # the timed rounds'
        rows.append({"bench": "prune_profile", "model": name, "parameters":
                     strategy.model.num_parameters(), "step_ms": step, **parts,
                     "other": step - sum(parts.values()), "of_dense": step / dense,
                     "speedup": dense / step, "nprocs": group.size})  # fmt: skip
        strategy.close()
    return rows


def main(args, group: comm.Group) -> int:
    print0(f"bench prune --structured --profile: the default GPT, global batch "
           f"{args.batch_size}, float32 | {group.size} ranks | {args.rounds} timed rounds",
           rank=group.rank)  # fmt: skip
    rows = profile(args, group)
    if group.rank == 0:
        columns = [("model", "s"), ("parameters", "d"), ("step_ms", ".2f"), ("speedup", ".2f")]
        columns += [(p, ".2f") for p in (*PHASES, "other")] + [("of_dense", ".2f")]
        print_table(rows, columns)
        write_json(args.json, rows)
        by = {r["model"]: r["step_ms"] for r in rows}
        p = (by["dense"] - by["blocks' floor"]) / by["dense"]
        print0(f"scales with heads and channels: p = {p:.0%} of the dense step; Amdahl's cap "
               f"for half of them 1 / ((1 - p) + p / 2) = {1 / (1 - p / 2):.2f}x; measured "
               f"structured 0.5: {by['dense'] / by['structured 0.5']:.2f}x")  # fmt: skip
    return 0
