"""dry_run: execute the lowered lists as the ranks would, without computing anything.

Each rank walks its list in order. A send is posted and the rank goes on (buffered, as
MPI's isend); a receive blocks until the matching send has been posted; F, B and W just
happen. The walk goes round the ranks until every list is done, or until a full round
moves nobody: a deadlock, reported with every rank's list and the step it is stuck on in
[brackets]. Two ranks that each receive before they send hang:

    rank 0:  [0RECV_B0]  0SEND_F0 ...        each waits for a send the other will
    rank 1:  [1RECV_F0]  1SEND_B0 ...        only post after its own receive

A send that no receive ever takes is an error too (its message would sit there forever).
"""

from minidp.parallel.pipeline.actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, peer_stage


class Deadlock(ValueError):
    """The lists cannot run together; `stuck` maps each stuck rank to its step."""

    def __init__(self, message: str, stuck: dict[int, int]):
        super().__init__(message)
        self.stuck = stuck


def _message(action: Action) -> tuple[str, int, int, int]:
    """The message a send posts or a receive takes: (direction, from stage, to stage, j)."""
    if action.kind in (SEND_F, SEND_B):
        ends = (action.stage, peer_stage(action))
    else:
        ends = (peer_stage(action), action.stage)
    return ("F" if action.kind in (SEND_F, RECV_F) else "B", *ends, action.micro_batch)


def marked_lists(actions: list[list[Action]], marks: dict[int, int]) -> str:
    """Each rank's list on one line, the step in `marks` (rank -> step) in [brackets]."""
    lines = []
    for rank, order in enumerate(actions):
        cells = [f"[{a}]" if marks.get(rank) == step else str(a) for step, a in enumerate(order)]
        lines.append(f"rank {rank}: " + " ".join(cells) + ("  (done)" if rank not in marks else ""))
    return "\n".join(lines)


def dry_run(actions: list[list[Action]], pp: int) -> int:
    """Run the lowered lists with blocking receives; return how many rounds it took.
    Raise Deadlock (a ValueError) naming each stuck rank's step, or ValueError for a send
    never received."""
    position = [0] * len(actions)
    posted: dict[tuple, tuple[int, int]] = {}  # message -> (rank, step) of its send
    rounds = 0
    while any(position[r] < len(actions[r]) for r in range(len(actions))):
        rounds += 1
        moved = False
        for rank, order in enumerate(actions):
            while position[rank] < len(order):
                action = order[position[rank]]
                if action.kind in (SEND_F, SEND_B):
                    posted[_message(action)] = (rank, position[rank])
                elif action.kind in (RECV_F, RECV_B):
                    if _message(action) not in posted:
                        break  # blocked until the matching send is posted
                    del posted[_message(action)]
                position[rank] += 1
                moved = True
        if not moved:
            stuck = {r: position[r] for r in range(len(actions)) if position[r] < len(actions[r])}
            where = ", ".join(f"rank {r} step {s} ({actions[r][s]})" for r, s in stuck.items())
            raise Deadlock(
                f"deadlock: no rank can progress; stuck at {where}\n"
                + marked_lists(actions, stuck),
                stuck,
            )
    if posted:
        rank, step = min(posted.values())
        raise ValueError(f"rank {rank} step {step}: {actions[rank][step]} is never received")
    return rounds


__all__ = ["Deadlock", "dry_run", "marked_lists"]
