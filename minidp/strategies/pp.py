"""`--strategy pp`: pipeline parallelism, the GPT's blocks cut into stages over the ranks.

    mpiexec -n 2 python -m minidp --strategy pp --n-layer 4 --micro-batches 4 --schedule 1f1b
    mpiexec -n 2 python -m minidp --strategy pp --n-layer 4 --schedule interleaved --virtual 2

Every rank builds the whole nn.GPT from the seed (the task's model), cuts it into pp x V
parts (parallel/pipeline/split.py) and keeps its own: stage s on rank s % pp, the other
parts' parameters released. Every rank reads the whole global batch (data shard (0, 1)):
stage 0 needs the inputs, the last stage the targets. This MVP fills the world with one
pipeline: pp = world, dp = tp = 1.

The step is not the skeleton's (step.py runs one forward and backward per micro-batch on
one model); `PipelineStep` has its shape (`__call__(local, lr)`, `activations_peak`,
`steps_done`) with the executor inside:

    zero the stage's gradients
    split the batch into m micro-batches, shares B_j / B     executor.split_batch
    run this rank's schedule.actions()[rank]                  executor.run_schedule
    loss = broadcast(sum of the last stage's losses)          from the last stage, over pp
    if finite: clip (||g||^2 = allreduce_pp(sum of squares)); optimizer.step()
    bubble = idle / (pp x window) of the step's F/B/W spans   executor.measured_bubble

Each stage's messages go on the pipeline group, so its counters are bytes_sent_by_axis's
"pp"; dp and tp send nothing.
"""

import numpy as np

from minidp import comm, optim
from minidp.memory import optimizer_bytes
from minidp.parallel.across_ranks import global_l2, replica_spread, stand_in
from minidp.parallel.mesh import Mesh
from minidp.parallel.pipeline.executor import measured_bubble, run_schedule, split_batch
from minidp.parallel.pipeline.schedules import build_schedule
from minidp.parallel.pipeline.simulate import formula_bubble
from minidp.parallel.pipeline.split import split_model
from minidp.parallel.pipeline.stage import PipelineStage
from minidp.strategies.protocol import Recipe, StepResult, exposed_clock
from minidp.trace import Timeline
from minidp.training.config import BadConfig
from minidp.training.config_checks import check_pipeline


class PipelineStep:
    """One optimizer step through the pipeline (the module doc): the skeleton's shape."""

    def __init__(self, recipe: "Pipeline"):
        self.recipe = recipe
        self.steps_done = 0
        self.activations_peak = 0  # the most bytes this rank's stages held at once
        self.bubbles: list[float] = []  # measured, per step
        self.spans = recipe.timeline if recipe.timeline.enabled else Timeline()

    def __call__(self, local: np.ndarray, lr: float) -> StepResult:
        r = self.recipe
        schedule, stages, group = r.schedule, r.stages, r.mesh.pp_group
        r.optimizer.lr = lr
        r.optimizer.zero_grad()
        for stage in stages.values():
            stage.reset_peaks()
        inputs, targets = r.task.batch(local)
        micro_in, micro_t, shares = split_batch(inputs, targets, schedule.micro_batches)
        if self.spans is not r.timeline:
            self.spans.events.clear()  # a private timeline keeps one step's spans
        first = len(self.spans.events)
        mine = run_schedule(schedule, stages, micro_in, micro_t, shares, timeline=self.spans)
        self.activations_peak = max(self.activations_peak, mine.peak_bytes)
        last_rank = schedule.stage_rank(schedule.num_stages - 1)
        loss = comm.broadcast(np.array([sum(mine)], np.float64), root=last_rank, group=group)
        loss = float(loss[0])
        if np.isfinite(loss):  # alike on every rank: no step, no message
            with r.timeline.span("optimizer"):
                if r.config.grad_clip:
                    r.clip()
                r.optimizer.step()
        self.bubbles.append(measured_bubble(self.spans, group, first))
        self.steps_done += 1
        return StepResult(loss, loss)


class Pipeline(Recipe):
    """`--strategy pp --pp P --micro-batches M --schedule S [--virtual V] [--recompute]`."""

    name = "pp"

    def __init__(self, task, config, group: comm.Group, timeline=None, optimizer=None):
        super().__init__(task, config, group, timeline)
        pp = config.pp or group.size
        check_pipeline(config, pp)  # alike on every rank, before any message
        if pp != group.size:
            raise BadConfig(f"--pp {pp} must be the world's {group.size} ranks (dp = tp = 1)")
        try:
            self.schedule = build_schedule(
                config.schedule, pp, config.micro_batches, config.virtual
            )
        except ValueError as error:  # the piece names its argument; say the flag
            raise BadConfig(f"--schedule {config.schedule}: {error}") from None
        self.mesh = mesh = Mesh(pp=pp, group=group)
        try:
            self._build(task, config, optimizer)
        except BaseException:
            mesh.close()
            raise
        self.axes = {"dp": [], "tp": [], "pp": [mesh.pp_group]}
        self.clocks, self.clip_params = [exposed_clock(mesh.pp_group)], self.params
        self.data_shard = (0, 1)
        self.run = PipelineStep(self)

    def _build(self, task, config, optimizer) -> None:
        """This rank's stages of the task's GPT, the others' parameters released; the
        optimizer over this rank's parameters."""
        mesh = self.mesh
        S, rank = self.schedule.num_stages, mesh.pp_group.rank
        self.parts = split_model(task.model, S, recompute=config.recompute)
        self.stages = {
            s: PipelineStage(self.parts[s], s, S, mesh.pp_group)
            for s in self.schedule.stages_of(rank)
        }
        self.params = [p for stage in self.stages.values() for p in stage.parameters()]
        mine = {id(p) for p in self.params}
        for p in task.model.parameters():  # the other stages' parameters: released
            if id(p) not in mine:
                p.data = stand_in(p)
        self.optimizer = optimizer or optim.make_optimizer(
            config.optimizer, self.params, config.lr, config.weight_decay
        )

    def norm(self, kind: str) -> float:
        """Each stage's parameters on one rank: the sum of squares summed over pp."""
        return global_l2([getattr(p, kind) for p in self.params], self.mesh.pp_group)

    def gather_model(self) -> None:
        """Collective: each stage's parameters broadcast from its rank into task.model."""
        for s, part in enumerate(self.parts):
            params = part.parameters()
            if not params:
                continue
            dtype = params[0].dtype
            if s in self.stages:
                flat = np.concatenate([np.asarray(p.data, dtype).ravel() for p in params])
            else:
                flat = np.empty(sum(int(np.prod(p.shape)) for p in params), dtype)
            root = self.schedule.stage_rank(s)
            comm.broadcast(flat, root=root, group=self.mesh.pp_group)
            offset = 0
            for p in params:
                size = int(np.prod(p.shape))
                p.data = flat[offset : offset + size].reshape(p.shape).copy()
                offset += size

    def max_param_diff(self) -> float:
        """No two ranks train the same parameters; after gather_model, the whole model's
        copies (0.0: every rank received the same bits)."""
        return replica_spread([p.data for p in self.task.model.parameters()], self.group)

    def held(self) -> dict[str, list]:
        return {
            "parameters": [p.data for p in self.params],
            "gradients": [p.grad for p in self.params if p.grad is not None],
            "optimizer": [optimizer_bytes(self.optimizer)],
            "buffers": [g.scratch.nbytes for g in (self.group, *self.mesh.groups().values())],
        }

    def describe(self) -> str:
        s, c = self.schedule, self.config
        return (
            f"{self.mesh.describe()} | schedule {s.name} | micro-batches {s.micro_batches} | "
            f"stages {s.num_stages} (V {s.virtual}) | recompute {'on' if c.recompute else 'off'}"
        )

    def record(self) -> dict:
        s, bubbles = self.schedule, self.run.bubbles
        return {
            "mesh": {"dp": 1, "tp": 1, "pp": s.pp},
            "schedule": s.name,
            "micro_batches": s.micro_batches,
            "virtual": s.virtual,
            "recompute": self.config.recompute,
            "bubble_fraction": float(np.mean(bubbles)) if bubbles else None,
            "bubble_fraction_formula": formula_bubble(s.name, s.pp, s.micro_batches, s.virtual),
        }

    def summary(self) -> str:
        record = self.record()
        if record["bubble_fraction"] is None:
            return ""
        return (
            f"pipeline bubble: measured {record['bubble_fraction']:.3f}, "
            f"formula {record['bubble_fraction_formula']:.3f}"
        )

    def state_dict(self) -> dict:
        model = {k: v for st in self.stages.values() for k, v in st.state_dict().items()}
        return {"model": model, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for stage in self.stages.values():
            mine = stage.state_dict()
            stage.load_state_dict({k: v for k, v in state["model"].items() if k in mine})
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        self.mesh.close()
