"""Lowering: add every send on its sender and the matching receive on its receiver.

A compute-only schedule says what each rank computes; between stages on different ranks
the activation (forward) and its gradient (backward) must travel:

    rank 0:  0F0  0SEND_F0 ─────────┐               ...   0RECV_B0  0B0
    rank 1:                 1RECV_F0 └─► 1F0  1B0  1SEND_B0 ───┘

Receives block and sends do not (MPI's isend): a rank stuck in a receive waits for its
peer's matching send. If two ranks each wait in a receive whose send the other has not yet
reached, they hang (PyTorch PR #130378: sends and receives ordered differently on two ranks).
So the order is built as one simulation in rounds, as PyTorch's `_add_send_recv` does:

    round k: every rank looks at its next compute action. It is ready if what it needs
             has been placed in an earlier round (F of stage s needs F of s - 1; B of s
             needs B of s + 1, or F of s on the last stage; W needs B). A ready action is
             placed as [RECV if its input comes from another rank] action [SEND if its
             output goes to another rank]; a rank whose next action is not ready waits.

Every receive placed in round k matches a send placed in an earlier round, so by induction
on k every round completes: the lowered lists cannot deadlock. If in some round no rank is
ready, the compute order itself is circular: ValueError naming each rank's stuck step.
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


def needs(action: Action, num_stages: int) -> Action | None:
    """The compute action whose result `action` uses (None: the first stage's forward)."""
    s, j = action.stage, action.micro_batch
    if action.kind == F:
        return Action(s - 1, F, j) if s > 0 else None
    if action.kind == B:
        return Action(s + 1, B, j) if s < num_stages - 1 else Action(s, F, j)
    return Action(s, B, j)  # W


def messages(action: Action, pp: int, num_stages: int) -> tuple[list[Action], list[Action]]:
    """The receives to place before `action` and the sends to place after it."""
    s, j, rank = action.stage, action.micro_batch, stage_rank(action.stage, pp)
    before, after = [], []
    if action.kind == F:
        if s > 0 and stage_rank(s - 1, pp) != rank:
            before.append(Action(s, RECV_F, j))
        if s < num_stages - 1 and stage_rank(s + 1, pp) != rank:
            after.append(Action(s, SEND_F, j))
    elif action.kind == B:
        if s < num_stages - 1 and stage_rank(s + 1, pp) != rank:
            before.append(Action(s, RECV_B, j))
        if s > 0 and stage_rank(s - 1, pp) != rank:
            after.append(Action(s, SEND_B, j))
    return before, after


def add_send_recv(compute: list[list[Action]], pp: int, num_stages: int) -> list[list[Action]]:
    """Per rank, `compute` (F, B, W only) with its sends and receives, deadlock-free."""
    lowered: list[list[Action]] = [[] for _ in compute]
    position = [0] * len(compute)
    placed: set[Action] = set()
    while any(position[r] < len(compute[r]) for r in range(len(compute))):
        this_round = []
        for rank, order in enumerate(compute):
            if position[rank] == len(order):
                continue
            action = order[position[rank]]
            if action.kind not in (F, B, W):
                raise ValueError(f"rank {rank} step {position[rank]}: {action} is not F, B or W")
            need = needs(action, num_stages)
            if need is None or need in placed:
                before, after = messages(action, pp, num_stages)
                lowered[rank] += before + [action] + after
                this_round.append(action)
                position[rank] += 1
        if not this_round:
            stuck = ", ".join(
                f"rank {r} step {position[r]} ({compute[r][position[r]]} waits for "
                f"{needs(compute[r][position[r]], num_stages)})"
                for r in range(len(compute))
                if position[r] < len(compute[r])
            )
            raise ValueError(f"the compute order cannot run, every rank waits: {stuck}")
        placed.update(this_round)  # seen from the next round on
    return lowered


__all__ = ["add_send_recv", "messages", "needs"]
