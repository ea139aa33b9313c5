"""An Action: one thing one rank does for one (stage, micro-batch).

A pipeline schedule is, per rank, a list of actions. The compute kinds:

    F   forward of stage s on micro-batch j                      written sFj   (0F3)
    B   backward: the input gradient, sent upstream at once      written sBj
        (the full backward, input and weight gradients, when the schedule does not split)
    W   the weight gradient, deferred (zero-bubble schedules)    written sWj

Lowering (lowering.py) adds the messages between stages on different ranks:

    SEND_F  after F of stage s: its activation to stage s + 1    written sSEND_Fj
    RECV_F  before F of stage s: the activation from stage s - 1
    SEND_B  after B of stage s: the input gradient to stage s - 1
    RECV_B  before B of stage s: the output gradient from stage s + 1

A message action's `stage` is the stage on the rank doing it (the sender's stage for a
send, the receiver's for a receive), as in PyTorch's torch.distributed.pipelining.

Placement: num_stages = pp * V stages, stage s on rank s % pp (V = 1: stage s on rank s;
V > 1: the interleaved "virtual stages", rank r holds stages r, r + pp, r + 2 pp, ...).
"""

from dataclasses import dataclass

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)
MESSAGES = (SEND_F, RECV_F, SEND_B, RECV_B)


@dataclass(frozen=True)
class Action:
    """`kind` of `stage` on micro-batch `micro_batch` (kinds above); printed as 0F3."""

    stage: int
    kind: str
    micro_batch: int

    def __post_init__(self):
        if self.kind not in COMPUTE + MESSAGES:
            raise ValueError(f"Action kind must be one of {COMPUTE + MESSAGES}, not {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro_batch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


TICKS_PER_UNIT = 2  # time is counted in half units: F = 1 unit = 2 ticks


def ticks(kind: str, split_backward: bool) -> int:
    """An action's length in ticks: F = B = 1 unit; a split backward is B = W = 1/2 unit
    (W = B/2 split: the input gradient and the weight gradient cost one matmul each)."""
    if kind == F or (kind == B and not split_backward):
        return TICKS_PER_UNIT
    if kind in (B, W):
        return TICKS_PER_UNIT // 2
    return 0  # messages take no time in the simulation


def stage_rank(stage: int, pp: int) -> int:
    """The rank holding `stage`: s % pp (Megatron's interleaved placement; s when V = 1)."""
    return stage % pp


def peer_stage(action: Action) -> int:
    """The stage at the other end of a message action."""
    return action.stage + (1 if action.kind in (SEND_F, RECV_B) else -1)


def peer_rank(action: Action, pp: int) -> int:
    """The rank a send goes to, or a receive comes from."""
    return stage_rank(peer_stage(action), pp)


__all__ = [
    "Action",
    "B",
    "COMPUTE",
    "F",
    "MESSAGES",
    "RECV_B",
    "RECV_F",
    "SEND_B",
    "SEND_F",
    "TICKS_PER_UNIT",
    "W",
    "peer_rank",
    "peer_stage",
    "stage_rank",
    "ticks",
]
