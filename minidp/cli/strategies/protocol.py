"""The strategy protocol: what the one training loop (training/loop.py) drives.

A strategy is one way for the ranks of a group to share the work of training a model: data
parallelism, a parameter server, tensor parallelism, ZeRO, a hybrid. The loop knows nothing
of how; it asks the strategy, for every step, to do the step:

    strategy = STRATEGIES[config.strategy](task, config, group, timeline)
    coordinate, count = strategy.data_shard       # which slice of the global batch is mine
    sampler = DistributedSampler(task.num_examples, B, coordinate, count, seed)
    for step in range(steps):
        result = strategy.step(sampler.local_indices(step), lr)     # forward .. optimizer
    strategy.gather_model()          # collective: task.model holds the trained weights
    strategy.param_l2(), strategy.max_param_diff()                  # collective, every rank
    strategy.bytes_sent_by_axis(), strategy.memory_bytes()          # this rank's
    state = strategy.state_dict(); strategy.load_state_dict(state)  # all that resumes it
    strategy.state_layout()          # how that state is cut, where it can be resharded
    strategy.close()

What a strategy must say, and why the loop cannot work it out itself:
- `data_shard`: (c, C), this rank reads slice c of C of the global batch (its coordinate
  on the data-parallel axis), or None for a rank that reads no data (a parameter server).
  Every rank that reads data gets the same examples whatever the layout, so every scheme can
  be checked against one process.
- `step(local, lr)`: one optimizer step on this rank's examples: forward, backward, the
  communication the scheme needs, clipping with the global norm (each parameter shard
  counted once), the optimizer. It returns the *global* batch's loss, the same on every
  rank, and skips the update when that loss is not finite.
- `param_l2()`: the L2 norm of all the model's parameters, gathered over shards;
  `max_param_diff()`: the largest spread among ranks that hold the same parameters (0 when
  replicas agree bit for bit).
- `bytes_sent_by_axis()`: data bytes this rank sent per mesh axis ("dp", "tp", "pp"), and
  `comm_seconds` / `exposed_seconds`: time communicating, and the part nothing hid; all
  running totals since the strategy was built (the loop's StepMeter reads differences).
- `memory_bytes()`: this rank's bytes by category, counted from the arrays (memory.py).
- `state_dict()` / `load_state_dict()`: everything training needs to resume (model,
  optimizer, the scheme's own state), for this rank's shard; `state_layout()`: {array path
  of that state: "replicated" or a checkpoint.Slice of the whole tensor} for what another
  number of ranks may load (minidp.parallel.checkpoint reshards it); {} by default: each
  rank's own, loaded only in the layout it was saved in.
- `gather_model()`: collective, called once after training: leave the trained weights in
  `task.model` on every rank, whole (gathered from shards or fetched from servers), so the
  loop's validation loss and sample, which run on the group's rank 0, see them. Data
  parallelism trains `task.model` itself and has nothing to do.
- `describe()`, `record()` and `summary()`: the scheme's own fields for the header, the
  final record and a closing line.

Most strategies are recipes (`Recipe`, below): a short __init__ that checks its flags,
builds a Mesh where it needs one (tp, hybrid), wraps the task's model in pieces (DDP, ZeRO's
sharding, the TP GPT) and hands them to the one step skeleton (step.py). It *declares* its
groups per mesh axis, where its communication time is read (`Clock`s) and its data-parallel
axis (`axis`, which holds the arrays per memory category and the state); the reports above
are computed from those declarations here, once. A hybrid composes the same pieces (tp.py):
no scheme's class derives from another's. The parameter server (ps.py), whose step is a push
and a pull, implements the protocol directly.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from minidp import comm
from minidp.comm.trace import Timeline
from minidp.engine import optim
from minidp.parallel.across_ranks import bytes_sent
from minidp.tools.memory import nbytes


class StepResult(NamedTuple):
    """What one step reports: the global batch's loss, this rank's own part of it, and
    whether the optimizer stepped (False: the loss or the global gradient norm was not
    finite, found alike on every rank, and no rank stepped)."""

    loss: float
    local_loss: float
    stepped: bool = True


class Strategy:
    """The base class every strategy derives from; see the module docstring.

    A subclass sets `name` and `data_shard` and implements the methods that raise here."""

    name = ""  # the --strategy name
    data_shard: tuple[int, int] | None = None
    comm_seconds = 0.0  # totals since the strategy was built: the loop reads differences
    exposed_seconds = 0.0

    def __init__(self, task, config, group: comm.Group, timeline: Timeline | None = None):
        self.task, self.config, self.group = task, config, group
        self.timeline = timeline or Timeline(enabled=False)

    def step(self, local: np.ndarray, lr: float) -> StepResult:
        raise NotImplementedError

    def param_l2(self) -> float:
        raise NotImplementedError

    def max_param_diff(self) -> float:
        raise NotImplementedError

    def replicas(self) -> list[tuple[comm.Group, list[tuple[str, Any]]]]:
        """Collective-free: [(group, [(name, array), ...])], each group's ranks holding the
        same bits of those arrays (the drift detector, training/drift.py, compares them);
        [] where no rank holds a copy of another's (shards only)."""
        return []

    def bytes_sent_by_axis(self) -> dict[str, int]:
        raise NotImplementedError

    def memory_bytes(self) -> dict[str, int]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def state_layout(self) -> dict:
        return {}

    def gather_model(self) -> None:
        """Collective: make `task.model` hold the whole trained model on every rank."""

    def describe(self) -> str:
        """The scheme's part of the second header line."""
        return ""

    def record(self) -> dict:
        """The scheme's own fields of the final JSON record."""
        return {}

    def summary(self) -> str:
        """The scheme's closing line, printed after the run ("" for none)."""
        return ""

    def close(self) -> None:
        """Stop threads and free communicators; the loop calls it whatever happens."""

    def __enter__(self) -> "Strategy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Clock(NamedTuple):
    """Where a recipe reads communication time (running totals): all of it, and the part
    nothing hid behind computation."""

    comm: Callable[[], float]
    exposed: Callable[[], float]


def exposed_clock(group: comm.Group) -> Clock:
    """A group whose collectives sit on the critical path (TP's f and g): all exposed."""
    return Clock(lambda: group.seconds, lambda: group.seconds)


MEMORY = ("parameters", "gradients", "optimizer", "activations_peak", "buffers", "gathered_peak")


def count_bytes(parts) -> int:
    """Bytes of `parts`: byte counts as they are, arrays counted once each (memory.nbytes)."""
    counts = [p for p in parts if isinstance(p, int | np.integer)]
    return nbytes(p for p in parts if not isinstance(p, int | np.integer)) + int(sum(counts))


class Recipe(Strategy):
    """A strategy assembled from pieces. Its __init__ builds them and sets:

    - `run`: the step skeleton over them (step.Step); `step` calls it;
    - `axes`: {"dp": [groups], "tp": [...], "pp": [...]}: the groups whose data bytes this
      rank sent count on each axis (an axis it does not name, it does not report);
    - `clocks`: [Clock], summed into comm_seconds and exposed_seconds;
    - `clip_params`: the parameters (or shard pieces) `clip()` scales;

    - `axis`: the data-parallel axis (ddp_axis.DDPAxis, zero_axis.ZeROAxis), whose arrays
      (`held()`: {category: [arrays and byte counts]}, every category of MEMORY but
      activations_peak, which the skeleton measures), header, record, closing line and
      state are the recipe's, with what a recipe adds (its groups' scratch, its mesh);

    and implements `norm(kind)`, the L2 norm of the whole model's "grad" or "data", each
    shard counted once (collective): clipping and param_l2 read it."""

    axes: dict[str, list[comm.Group]]
    clocks: list[Clock]
    clip_params: list  # what clip() scales
    axis: Any  # the data-parallel axis (DDPAxis, ZeROAxis) the reports below come from

    def step(self, local: np.ndarray, lr: float) -> StepResult:
        return self.run(local, lr)

    def norm(self, kind: str) -> float:
        raise NotImplementedError

    def clip(self) -> float:
        """Scale the gradients by --grad-clip / the global norm (the skeleton's `clip`);
        return that norm (the same on every rank)."""
        norm = self.norm("grad")
        return optim.clip_grad_norm(self.clip_params, self.config.grad_clip, total_norm=norm)

    def param_l2(self) -> float:
        return self.norm("data")

    def bytes_sent_by_axis(self) -> dict[str, int]:
        return {axis: bytes_sent(*groups) for axis, groups in self.axes.items()}

    @property
    def comm_seconds(self) -> float:
        return sum(clock.comm() for clock in self.clocks)

    @property
    def exposed_seconds(self) -> float:
        return sum(clock.exposed() for clock in self.clocks)

    def memory_bytes(self) -> dict[str, int]:
        held = {**self.held(), "activations_peak": [self.run.activations_peak]}
        return {category: count_bytes(held[category]) for category in MEMORY if category in held}

    # ---- what the data-parallel axis holds, says and saves (a recipe adds its own) -------
    def scratch_groups(self) -> list[comm.Group]:
        """The groups whose scratch buffers this recipe's memory counts (the axis adds its
        own communication group's)."""
        return [self.group]

    def held(self) -> dict[str, list]:
        held = self.axis.held()
        held["buffers"] += [g.scratch.nbytes for g in self.scratch_groups()]
        return held

    def describe(self) -> str:
        return self.axis.describe()

    def record(self) -> dict:
        return self.axis.record(self.run.steps_done)

    def summary(self) -> str:
        return self.axis.summary(self.run.steps_done)

    def state_dict(self) -> dict:
        return self.axis.state_dict()

    def state_layout(self) -> dict:
        return self.axis.state_layout()

    def load_state_dict(self, state: dict) -> None:
        self.axis.load_state_dict(state)

    def close(self) -> None:
        self.axis.close()
