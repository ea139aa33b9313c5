"""The strategy protocol: what the one training loop (training/loop.py) drives.

    strategy = STRATEGIES[config.strategy](task, config, group, timeline)
    coordinate, count = strategy.data_shard       # which slice of the global batch is mine
    for step in range(steps):
        result = strategy.step(sampler.local_indices(step), lr)     # forward .. optimizer
    strategy.gather_model()          # collective: task.model holds the trained weights
                                     # (unless strategy.sharded_forward: then it stays cut)
    strategy.param_l2(), strategy.max_param_diff()                  # collective, every rank
    strategy.bytes_sent_by_axis(), strategy.memory_bytes()          # this rank's
    state = strategy.state_dict(); strategy.load_state_dict(state)  # all that resumes it
    strategy.state_layout()          # how that state is cut, where it can be resharded

- `data_shard`: (c, C), this rank reads slice c of C of the global batch, or None for a
  rank that reads no data (a parameter server). Every rank that reads data gets the same
  examples whatever the layout, so every scheme can be checked against one process.
- `step(local, lr)`: one optimizer step; returns the *global* batch's loss, the same on
  every rank, and skips the update when that loss is not finite.
- `param_l2()`: the L2 norm of the whole model, gathered over shards; `max_param_diff()`:
  the largest spread among ranks that hold the same parameters (0 when they agree).
- `bytes_sent_by_axis()`, `comm_seconds`, `exposed_seconds`: running totals since the
  strategy was built (the loop's StepMeter reads differences).
- `memory_bytes()`: this rank's bytes by category, counted from the arrays (memory.py).
- `state_dict()` / `load_state_dict()`: everything training needs to resume, this rank's
  shard (the model's and optimizer's arrays themselves, as checkpoint.get_state_dict gives
  them: save before the next step); `state_layout()`: {array path: "replicated" or a
  checkpoint.Slice of the whole tensor} for what another number of ranks may load; {}:
  each rank's own.
- `gather_model()`: collective, after training: the trained weights whole in `task.model`.
  `sharded_forward` True: the loop leaves the model sharded instead (ZeRO-3), because its
  forward gathers each layer around its use; validation and sampling then run on every
  rank together, and no rank ever holds the whole model.
- `builds_deferred(config)`: a static method, asked before the task is built: True (ZeRO-3)
  and the loop builds the model deferred (engine/deferred.py), so no rank ever holds it whole.
- `describe()`, `record()`, `summary()`: the header's, the final record's and a closing line.

Most strategies are recipes (`Recipe`): an __init__ that checks its flags, wraps the task's
model in pieces and hands them to the one step skeleton (step.py). It *declares* its groups
per mesh axis, what it reads communication time from, and its data-parallel axis (DDP's or
ZeRO's), and the reports are computed from those here, once. The parameter server (ps.py),
whose step is a push and a pull, implements the protocol directly.
"""

from typing import Any, NamedTuple

import numpy as np

from minidp import comm
from minidp.comm.trace import Timeline
from minidp.engine import optim
from minidp.parallel.across_ranks import bytes_sent, replica_spread
from minidp.parallel.step import StepResult
from minidp.tools.memory import MEMORY, count_bytes


class Strategy:
    """The base class every strategy derives from; see the module docstring."""

    name = ""  # the --strategy name
    data_shard: tuple[int, int] | None = None
    sharded_forward = False  # True: task.model's forward is collective (see above)
    comm_seconds = 0.0  # totals since the strategy was built: the loop reads differences
    exposed_seconds = 0.0

    def __init__(self, task, config, group: comm.Group, timeline: Timeline | None = None):
        self.task, self.config, self.group = task, config, group
        self.timeline = timeline or Timeline(enabled=False)

    @staticmethod
    def builds_deferred(config) -> bool:
        """Whether the loop builds the task's model under deferred_init (engine/deferred.py):
        for a strategy that keeps the model in shards from the start (ZeRO-3), whose ranks
        draw only their own chunks; every other one needs the whole model's values."""
        return False

    def replicas(self) -> list[tuple[comm.Group, list[tuple[str, Any]]]]:
        """Collective-free: [(group, [(name, array), ...])], each group's ranks holding the
        same bits of those arrays (the drift detector, training/drift.py, compares them)."""
        return []

    def state_layout(self) -> dict:
        return {}

    def gather_model(self) -> None:
        """Collective: make `task.model` hold the whole trained model on every rank."""

    def describe(self) -> str:
        return ""

    def record(self) -> dict:
        return {}

    def summary(self) -> str:
        return ""

    def close(self) -> None:
        """Stop threads and free communicators; the loop calls it whatever happens."""

    def __enter__(self) -> "Strategy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Exposed(NamedTuple):
    """A group whose collectives sit on the critical path (TP's f and g, the pipeline's
    sends): all its time is exposed."""

    group: comm.Group

    @property
    def comm_seconds(self) -> float:
        return self.group.seconds

    exposed_seconds = comm_seconds


class Recipe(Strategy):
    """A strategy assembled from pieces. Its __init__ builds them and sets `run` (the step
    skeleton, step.Step), `axes` ({"dp": [groups], "tp": ..., "pp": ...}: whose data bytes
    count on each axis), `clocks` (objects with comm_seconds and exposed_seconds: DDP, ZeRO,
    Exposed groups), `clip_params` (what clip() scales) and `axis`, the data-parallel axis
    (ddp_axis.DDPAxis, parallel/zero/stages.ZeROStages), whose arrays by memory category,
    header, record and state are the recipe's. It implements `norm(kind)`, the L2 norm of
    the whole model's "grad" or "data", each shard counted once (collective)."""

    axes: dict[str, list[comm.Group]]
    clocks: list
    clip_params: list
    axis: Any
    net = None  # the model placed over ranks (MeshGPT), whose loss the task's adds to

    def step(self, local: np.ndarray, lr: float) -> StepResult:
        return self.run(local, lr)

    def loss(self, indices: np.ndarray):
        """The mean loss over these examples (a Tensor, to backpropagate): the task's
        model's, or `net`'s (with a MoE's load-balancing loss: models/tasks.py)."""
        batch, net = self.task.batch(indices), self.net
        if net is not None and getattr(self.task, "experts", False):  # the MoE's own loss too
            return self.task.loss(*batch, net=net)
        return self.task.loss(*batch) if net is None else net.loss(*batch)

    def max_param_diff(self) -> float:
        """After gather_model: the whole model's copies (0.0: every rank holds its bits)."""
        return replica_spread([p.data for p in self.task.model.parameters()], self.group)

    def clip(self) -> float:
        """Scale the gradients by --grad-clip / the global norm; return that norm. Under a
        loss scaler (--precision fp16) they hold scale x theirs: the norm is divided by it."""
        scale, norm = self.run.loss_scale, self.norm("grad")
        optim.clip_grad_norm(self.clip_params, self.config.grad_clip * scale, total_norm=norm)
        return norm / scale

    def param_l2(self) -> float:
        return self.norm("data")

    def bytes_sent_by_axis(self) -> dict[str, int]:
        return {axis: bytes_sent(*groups) for axis, groups in self.axes.items()}

    @property
    def comm_seconds(self) -> float:
        return sum(clock.comm_seconds for clock in self.clocks)

    @property
    def exposed_seconds(self) -> float:
        return sum(clock.exposed_seconds for clock in self.clocks)

    def memory_bytes(self) -> dict[str, int]:
        held = self.axis.held()
        held["buffers"] += [g.buffer_bytes() for g in self.scratch_groups()]
        held["activations_peak"] = [self.run.activations_peak]
        return {category: count_bytes(held[category]) for category in MEMORY if category in held}

    def scratch_groups(self) -> list[comm.Group]:
        """The groups whose scratch buffers this recipe's memory counts."""
        return [self.group]

    def describe(self) -> str:
        return f"{self.axis.describe()} | grad accumulation {self.config.grad_accum}"

    def record(self) -> dict:
        scaler = self.run.scaler  # --precision fp16's: where the scale ended, steps skipped
        if scaler is None:
            return self.axis.record()
        scaled = {"loss_scale": scaler.get_scale(), "overflow_steps": scaler.skipped}
        return {**self.axis.record(), **scaled}

    def summary(self) -> str:
        return self.axis.summary() if hasattr(self.axis, "summary") else ""

    def state_dict(self) -> dict:
        state = self.axis.state_dict()
        if self.run.scaler is not None:  # --precision fp16: the scale and its counts, alike
            state["scaler"] = self.run.scaler.state_dict()  # on every rank (numbers)
        return state

    def state_layout(self) -> dict:
        return self.axis.state_layout()

    def load_state_dict(self, state: dict) -> None:
        self.axis.load_state_dict(state)
        if self.run.scaler is not None:
            self.run.scaler.load_state_dict(state["scaler"])

    def close(self) -> None:
        self.axis.close()
