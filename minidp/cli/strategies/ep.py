"""`--strategy dp|hybrid --experts E [--ep N]`: a MoE GPT under ExpertParallel over the DP
group (parallel/experts/plain.py; docs/experts.md), which is the skeleton's gradient
synchronizer itself: E/N experts a rank, all-to-alls in EP groups of N DP ranks, the
router's counts summed over the DP group (DDP would leave each rank's own). hybrid: a
dp x tp mesh; with --tp > 1 the TP GPT with each MoE layer whole on the TP ranks (MeshGPT,
parallel/tensor_parallel/mesh_gpt.py), its replicated gradients made alike over TP after
the sync.    mpiexec -n 8 python -m minidp --strategy hybrid --dp 4 --tp 2 --experts 4 --ep 2
"""

from minidp import comm
from minidp.cli.strategies.protocol import Exposed, Recipe
from minidp.cli.strategies.step import check_micro_batches, step_from
from minidp.cli.strategies.tp import check_mesh
from minidp.cli.training.config import BadConfig
from minidp.engine import optim
from minidp.parallel.checkpoint import get_state_dict, set_state_dict
from minidp.parallel.checkpoint.state_dict import declared
from minidp.parallel.experts import ExpertParallel
from minidp.parallel.mesh import Mesh
from minidp.parallel.tensor_parallel.mesh_gpt import MeshGPT
from minidp.tools.memory import MEMORY, count_bytes, optimizer_bytes


class Experts(Recipe):
    name = "experts"

    def __init__(self, task, config, group: comm.Group, timeline=None, optimizer=None):
        super().__init__(task, config, group, timeline)
        hybrid = config.strategy == "hybrid"
        dp, tp = check_mesh(config, group.size, task.model)[:2] if hybrid else (group.size, 1)
        N, B = config.ep, config.batch_size  # alike on every rank:
        if dp % N or B % dp:  # before any message
            raise BadConfig(f"--ep {N} and --batch-size {B} must divide by the {dp} DP ranks "
                            "(ExpertParallel averages equal slices)")  # fmt: skip
        check_micro_batches(config, dp)
        self.mesh = mesh = Mesh(dp=dp, tp=tp, group=group)  # tp > 1: MoE whole on TP ranks
        self.net = MeshGPT(task.model, mesh, ep=N) if tp > 1 else None
        self.ep = ep = self.net.experts if tp > 1 else ExpertParallel(task.model, mesh.dp_group, N)
        self.optimizer = opt = optimizer or optim.make_optimizer(
            config.optimizer, ep.parameters(), config.lr, config.weight_decay
        )
        self.axes = {"dp": [mesh.dp_group, ep.expert_dp_group], "ep": [ep.ep_group],
                     "tp": [mesh.tp_group]}  # fmt: skip
        self.clocks = [Exposed(g) for g in (*self.axes["dp"], ep.ep_group, mesh.tp_group)]
        reports = self.net or ep  # the norm and the replicas: each expert counted once
        self.clip_params, self.norm, self.replicas = ep.parameters(), reports.norm, reports.replicas
        self.run = step_from(config, self.loss, ep, opt, mesh.dp_group, self.timeline,
                             self.clip, job=group, after_sync=[self.after_sync])  # fmt: skip
        self.data_shard, self.axis = (mesh.dp_group.rank, dp), None  # reports: below

    def after_sync(self) -> None:  # tp > 1: the replicated gradients alike over TP
        if self.net is not None:
            self.net.after_dp_sync(take_rank0=self.mesh.dp > 2)

    def gather_model(self) -> None:  # all E in task.model, LocalExperts
        self.net.gather_into(self.task.model) if self.net else self.ep.gather_model()

    def close(self) -> None:
        self.ep.close()
        self.mesh.close()

    def memory_bytes(self) -> dict[str, int]:
        params, groups = self.ep.parameters(), [*self.axes["dp"], *self.axes["ep"]]
        groups += self.axes["tp"] if self.mesh.tp > 1 else []  # TP's scratch, where it sends
        held = {"parameters": [p.data for p in params], "gradients": [p.grad for p in params],
                "optimizer": [optimizer_bytes(self.optimizer)], "buffers": [g.buffer_bytes()
                for g in groups], "activations_peak": [self.run.activations_peak]}  # fmt: skip
        return {c: count_bytes([x for x in held[c] if x is not None]) for c in MEMORY if c in held}

    def describe(self) -> str:
        E, N, tp = self.config.experts, self.ep.ep, self.mesh.tp
        tp = f" x tp {tp} (each MoE layer whole on its TP ranks)" if tp > 1 else ""
        return f"expert parallel: dp {self.mesh.dp} x ep {N} ({E // N} of {E} experts a rank){tp}"

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
