"""`bench pp`'s memory tables: activations held, counted from the stages' arrays.

    mpiexec -n 4 python -m minidp bench pp [--memory-m 8]

A tiny GPT (float32, one block per stage) runs one step of a schedule; each PipelineStage
counts the micro-batches whose graph it holds (`peak_in_flight`) and their arrays' bytes
(`peak_bytes`, memory.activation_bytes), and run_schedule reads the rank's stages together
after every action (RunResult.peak_in_flight: not the sum of its stages' peaks).

Per stage, at p = the world size: every schedule, with and without recomputation
(`split_model(..., recompute=True)`: a block keeps only its input), against the simulator's
and the formula's (GPipe m; 1F1B min(m, p - s); ZB-H1 min(m, p); interleaved the
simulator's, as no formula is stated per stage).

Per rank, interleaved (V = 2) at each p of --pps: the rank's stages together, against the
simulator's (peak_activations_per_rank) and rank 0's formula, V p (1 + (p-1)/(pV)) in the
simulator's unit (a stage of 1/(pV) of the model, one micro-batch); `full` is rank 0's
measured count over V, in full-size stages (1/p of the model), 1F1B's rank 0 holding p.
"""

import numpy as np

from minidp import comm
from minidp.models.gpt import GPT, GPTConfig
from minidp.parallel.pipeline.executor import run_schedule, split_batch
from minidp.parallel.pipeline.schedules import build_schedule
from minidp.parallel.pipeline.simulate import summary as simulated
from minidp.parallel.pipeline.split import split_model
from minidp.parallel.pipeline.stage import PipelineStage

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
TINY = dict(vocab_size=11, block_size=8, n_head=2, n_embd=16)


def virtual_of(name: str) -> int:
    return 2 if name == "interleaved" else 1


def gpt_step(schedule, group, m: int, recompute: bool):
    """One step of `schedule` on a tiny GPT over `group`: (this rank's stages, RunResult)."""
    S = schedule.num_stages
    tokens = np.random.default_rng(1).integers(0, 11, (2 * m, 9))
    gpt = GPT(GPTConfig(n_layer=S, **TINY), seed=3, dtype=np.float32)
    parts = split_model(gpt, S, recompute=recompute)
    stages = {s: PipelineStage(parts[s], s, S, group) for s in schedule.stages_of(group.rank)}
    result = run_schedule(schedule, stages, *split_batch(tokens[:, :-1], tokens[:, 1:], m))
    return stages, result


def formula_peaks(name: str, pp: int, m: int, sim_peaks: dict) -> list[int]:
    """Micro-batches held at once per stage, by the formulas (the simulator's: interleaved)."""
    if name == "gpipe":
        return [m] * pp
    if name == "1f1b":
        return [min(m, pp - s) for s in range(pp)]
    if name == "zb-h1":
        return [min(m, pp)] * pp
    return [sim_peaks[s] for s in sorted(sim_peaks)]


def memory_rows(args, world) -> list[dict]:
    """One step of each schedule on a tiny GPT at p = world size, m = --memory-m."""
    pp, m, rows = world.size, args.memory_m, []
    for name in SCHEDULES:
        schedule = build_schedule(name, pp, m, virtual_of(name))
        S = schedule.num_stages
        for recompute in (False, True):
            stages, _ = gpt_step(schedule, world, m, recompute)
            held = {s: (st.peak_in_flight, st.peak_bytes) for s, st in stages.items()}
            peaks = {}
            for part in world.comm.allgather(held):
                peaks.update(part)
            sim = simulated(schedule)["peak_activations_per_stage"]
            rows.append({
                "schedule": name, "p": pp, "m": m, "V": virtual_of(name),
                "recompute": recompute,
                "in_flight": [peaks[s][0] for s in range(S)],
                "simulated": [sim[s] for s in range(S)],
                "formula": formula_peaks(name, pp, m, sim),
                "peak_KB": [peaks[s][1] / 1e3 for s in range(S)],
            })  # fmt: skip
    return rows


def rank_memory_rows(args, world, pps) -> list[dict]:
    """Interleaved, V = 2, at each p of `pps`, m = --memory-m: each rank's peak (its stages
    together) measured, simulated, and rank 0's formula."""
    m, rows = args.memory_m, []
    for pp in pps:
        group = world if pp == world.size else world.subgroup(list(range(pp)))
        if group is None:
            continue  # not in this pipeline: wait for it at the barrier below
        schedule = build_schedule("interleaved", pp, m, 2)
        _, result = gpt_step(schedule, group, m, recompute=False)
        measured = group.comm.allgather(result.peak_in_flight)
        sim = simulated(schedule)
        rows.append({
            "schedule": "interleaved", "p": pp, "m": m, "V": 2,
            "measured": measured, "simulated": sim["peak_activations_per_rank"],
            "formula_rank0": sim["formula_peak_first_rank"], "full_rank0": measured[0] / 2,
            "1f1b_rank0": min(m, pp),
        })  # fmt: skip
        if group is not world:
            group.free()
    comm.barrier(group=world)
    return rows
