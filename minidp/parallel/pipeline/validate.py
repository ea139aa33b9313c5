"""validate: is this a schedule at all? Checked on the lists, before anything runs.

For per-rank lists (compute-only, or lowered with sends and receives), with num_stages
stages placed stage s -> rank s % pp and m micro-batches, every rule below, in this order:

    rule                                     broken, e.g.
    stages and micro-batches in range        rank 1 step 4: 5F0: stage 5 is not in 0..3
    each stage on exactly one rank, s % pp   rank 0 step 2: 1F0: stage 1 belongs on rank 1
                                             (stage s on rank s % pp)
    no action twice                          rank 1 step 6: 1F2 again (first at step 2)
    on each stage, F before B before W       rank 1 step 3: 1B0 comes before 1F0, which it
                                             needs
    a stage's input from the same rank       rank 0 step 1: 2F0 comes before 1F0, which it
    first (interleaved with pp = 1)          needs
    lowered: the receive before its          rank 1 step 0: 1F0 comes before its receive
    compute, the send after it               1RECV_F0
    W exactly when the backward is split     rank 0 step 3: 0W0: a W, but the backward is not
                                             split (split_backward=False)
    counts: one F and one B per (stage,      rank 2 step 9 (the end): stage 2 micro-batch 3
    micro-batch), one W each when split      has no B

Every error is a ValueError naming the rank and the step (the index in that rank's list).
Whether the lists can run together (each receive meeting its send) is dry_run.py's question.
"""

from minidp.parallel.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
    stage_rank,
)
from minidp.parallel.pipeline.lowering import messages, needs


def _first_needs(action: Action, pp: int, num_stages: int) -> list[Action]:
    """What must come earlier on the same rank's list than `action`."""
    s, j = action.stage, action.micro_batch
    if action.kind == SEND_F:
        return [Action(s, F, j)]
    if action.kind == SEND_B:
        return [Action(s, B, j)]
    if action.kind in (RECV_F, RECV_B):
        return []
    earlier = [Action(s, F, j)] if action.kind == B else []
    need = needs(action, num_stages)
    if need is not None and stage_rank(need.stage, pp) == stage_rank(s, pp):
        earlier.append(need)
    return earlier


def validate(
    actions: list[list[Action]],
    pp: int,
    num_stages: int,
    micro_batches: int,
    split_backward: bool = False,
) -> None:
    """Raise ValueError naming the rank and step of the first broken rule (table above).
    `split_backward`: whether the schedule splits B from W (`schedule.split_backward`)."""
    if len(actions) != pp:
        raise ValueError(f"a schedule for pp={pp} needs {pp} lists of actions, not {len(actions)}")
    lowered = any(not a.is_compute for order in actions for a in order)
    home: dict[int, tuple[int, int]] = {}  # stage -> (rank, step) first seen
    for rank, order in enumerate(actions):
        seen: dict[Action, int] = {}
        for step, action in enumerate(order):
            where = f"rank {rank} step {step}: {action}"
            if not 0 <= action.stage < num_stages:
                raise ValueError(f"{where}: stage {action.stage} is not in 0..{num_stages - 1}")
            if not 0 <= action.micro_batch < micro_batches:
                raise ValueError(
                    f"{where}: micro-batch {action.micro_batch} is not in 0..{micro_batches - 1}"
                )
            first = home.setdefault(action.stage, (rank, step))
            if first[0] != rank:
                raise ValueError(
                    f"{where}: stage {action.stage} is already on rank {first[0]} "
                    f"(step {first[1]}); each stage lives on one rank"
                )
            if stage_rank(action.stage, pp) != rank:
                raise ValueError(
                    f"{where}: stage {action.stage} belongs on rank {stage_rank(action.stage, pp)}"
                    f" (stage s on rank s % pp)"
                )
            if action in seen:
                raise ValueError(f"{where} again (first at step {seen[action]})")
            if action.kind == W and not split_backward:
                raise ValueError(
                    f"{where}: a W, but the backward is not split (split_backward=False)"
                )
            for earlier in _first_needs(action, pp, num_stages):
                if earlier not in seen:
                    raise ValueError(f"{where} comes before {earlier}, which it needs")
            if lowered and action.is_compute:
                before, _ = messages(action, pp, num_stages)
                for receive in before:
                    if receive not in seen:
                        raise ValueError(f"{where} comes before its receive {receive}")
            seen[action] = step
        if lowered:
            for action in order:
                if action.is_compute:
                    for send in messages(action, pp, num_stages)[1]:
                        if send not in seen:
                            raise ValueError(
                                f"rank {rank} step {seen[action]}: {action} has no {send} after it"
                            )
        kinds = (F, B, W) if split_backward else (F, B)
        for stage in range(rank, num_stages, pp):
            for j in range(micro_batches):
                for kind in kinds:
                    if Action(stage, kind, j) not in seen:
                        raise ValueError(
                            f"rank {rank} step {len(order)} (the end): stage {stage} "
                            f"micro-batch {j} has no {kind}"
                        )


__all__ = ["validate"]
