"""`--strategy dp|hybrid --experts E [--ep N]`: a MoE GPT under ExpertParallel over the
whole group (parallel/experts/plain.py; docs/experts.md), which is the skeleton's gradient
synchronizer itself: E/N experts a rank, all-to-alls in EP groups of N DP ranks, the
router's counts summed over the DP group (DDP would leave each rank's own). hybrid: a
dp x 1 mesh, the same recipe.    mpiexec -n 4 python -m minidp --experts 4 --ep 2
"""

from minidp import comm
from minidp.cli.strategies.protocol import Exposed, Recipe
from minidp.cli.strategies.step import check_micro_batches, step_from
from minidp.cli.strategies.tp import check_mesh
from minidp.cli.training.config import BadConfig
from minidp.engine import optim
from minidp.parallel.across_ranks import replica_spread
from minidp.parallel.checkpoint import get_state_dict, set_state_dict
from minidp.parallel.checkpoint.state_dict import declared
from minidp.parallel.experts import ExpertParallel
from minidp.tools.memory import MEMORY, count_bytes, optimizer_bytes


class Experts(Recipe):
    name = "experts"

    def __init__(self, task, config, group: comm.Group, timeline=None, optimizer=None):
        super().__init__(task, config, group, timeline)
        if config.strategy == "hybrid" and check_mesh(config, group.size, task.model)[1] > 1:
            raise BadConfig("--experts with a TP group of more than one rank is not yet "
                            "supported: give --dp the world's size")  # fmt: skip
        dp, N, B = group.size, config.ep, config.batch_size  # alike on every rank:
        if dp % N or B % dp:  # before any message
            raise BadConfig(f"--ep {N} and --batch-size {B} must divide by the {dp} DP ranks "
                            "(ExpertParallel averages equal slices)")  # fmt: skip
        check_micro_batches(config, dp)
        self.ep = ep = ExpertParallel(task.model, group, N)
        self.optimizer = opt = optimizer or optim.make_optimizer(
            config.optimizer, ep.parameters(), config.lr, config.weight_decay
        )
        self.axes = {"dp": [group, ep.expert_dp_group], "ep": [ep.ep_group]}
        self.clocks = [Exposed(g) for g in (group, ep.expert_dp_group, ep.ep_group)]
        self.clip_params, self.norm, self.replicas = ep.parameters(), ep.norm, ep.replicas
        self.gather_model, self.close = ep.gather_model, ep.close  # gather: all E, LocalExperts
        self.run = step_from(config, self.loss, ep, opt, group, self.timeline, self.clip, job=group)
        self.data_shard, self.axis = (group.rank, group.size), None  # reports: below

    def loss(self, indices):
        return self.task.loss(*self.task.batch(indices))

    def max_param_diff(self) -> float:  # after gather_model: every rank the whole model
        return replica_spread([p.data for p in self.task.model.parameters()], self.group)

    def memory_bytes(self) -> dict[str, int]:
        params, groups = self.ep.parameters(), self.axes["dp"] + self.axes["ep"]
        held = {"parameters": [p.data for p in params], "gradients": [p.grad for p in params],
                "optimizer": [optimizer_bytes(self.optimizer)], "buffers": [g.scratch.nbytes
                for g in groups], "activations_peak": [self.run.activations_peak]}  # fmt: skip
        return {c: count_bytes([x for x in held[c] if x is not None]) for c in MEMORY if c in held}

    def describe(self) -> str:
        E, N = self.config.experts, self.ep.ep
        return f"expert parallel: dp {self.group.size} x ep {N} ({E // N} of {E} experts a rank)"

    def record(self) -> dict:
        return {"ep": self.ep.ep, "expert_load": self.task.expert_load}

    def state_dict(self) -> dict:  # each expert under its name in the whole model
        return dict(zip(("model", "optimizer"), get_state_dict(self.ep, self.optimizer)))

    def state_layout(self) -> dict:  # each expert whole on the ranks that hold it: another
        return declared(self.state_dict())[1]  # --ep reads it from theirs (reshard.cut_tree)

    def load_state_dict(self, state: dict) -> None:  # my experts' keys; others' are left
        model, optimizer = state["model"], state["optimizer"]
        set_state_dict(self.ep, self.optimizer, model_state_dict=model, optim_state_dict=optimizer)


def or_experts(recipe):
    """`recipe` (a class or a picking function), or Experts when --experts is given."""

    def pick(task, config, group, timeline=None, optimizer=None):
        return (Experts if config.experts else recipe)(task, config, group, timeline, optimizer)

    pick.name, pick.builds_deferred = recipe.name, recipe.builds_deferred
    return pick
