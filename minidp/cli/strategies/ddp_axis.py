"""DDPAxis: the data-parallel axis as DistributedDataParallel, what the dp, tp, hybrid and
pipeline recipes hand the step skeleton (step.py): DDP over the axis's group, its
optimizer, and what the flags plug into it.

`--compress` and `--prune` replace the bucket allreduce through DDP's communication hook
(parallel/compression/table.py, parallel/pruning.py); `--compress-on update` runs the
optimizer before the reduction (parallel/compression/update.py: a synchronizer that leaves
gradients local and an optimizer wrapper that reduces the step), `--compress-on velocity`
momentum SGD's velocity, DGC's momentum correction (parallel/compression/velocity.py); both
clip each rank's own gradient, locally.
"""

from minidp import comm
from minidp.cli.strategies.step import OVERLAP, Step, step_from
from minidp.cli.training.config import BadConfig
from minidp.engine import optim
from minidp.models.prune.magnitude import MagnitudePruner
from minidp.parallel.across_ranks import bytes_sent
from minidp.parallel.checkpoint import StateDict, get_state_dict, set_state_dict
from minidp.parallel.checkpoint.state_dict import declared
from minidp.parallel.compression.table import compression_line, compression_record, make_compressor
from minidp.parallel.compression.update import CompressedUpdate, LocalGradients
from minidp.parallel.compression.velocity import MomentumCorrectedSGD, MomentumCorrection
from minidp.parallel.data_parallel.ddp import DistributedDataParallel
from minidp.parallel.pruning import MaskedAllreduce
from minidp.tools.memory import nbytes, optimizer_bytes


def attach_pruner(ddp: DistributedDataParallel, optimizer, config) -> MaskedAllreduce | None:
    """The pruner `--prune` asks for, its hook registered on `ddp`; None without --prune.
    The hook holds the pruner (`hook.pruner`)."""
    if not config.prune:
        return None
    config = config.resolved()  # the schedule's unset steps follow --steps
    pruner = MagnitudePruner(
        ddp.model,
        optimizer,
        target=config.prune,
        start=config.prune_start,
        end=config.prune_end,
        every=config.prune_every,
        scope=config.prune_scope,
    )
    hook = MaskedAllreduce(pruner, ddp.buckets, config.allreduce)
    ddp.register_comm_hook(hook)
    return hook


class DDPAxis:
    """The data-parallel axis as DDP: `model` wrapped in DistributedDataParallel over
    `dp_group`, its comm hook (--compress, --prune), the optimizer (the config's unless
    `optimizer` is given) and the --compress-on placement. `make_step(...)` builds the skeleton
    over them; the rest is what a recipe reports, saves and closes."""

    def __init__(self, model, dp_group: comm.Group, config, timeline, optimizer=None):
        self.config, self.dp_group, self.model = config, dp_group, model
        try:  # --compress: a bad value is found alike on every rank (dp: before any message)
            self.compressor = make_compressor(
                config.compress, config.allreduce, config.seed, config.compress_warmup
            )
        except ValueError as error:  # the piece names the spec; the flag goes in front
            raise BadConfig(f"--compress {error}") from None
        self.ddp = ddp = DistributedDataParallel(
            model,
            dp_group,
            bucket_cap_mb=config.bucket_mb,
            algo=config.allreduce,
            overlap=OVERLAP[config.overlap],
            timeline=timeline,
        )
        try:  # what plugs into it; the DDP closed again if that fails
            self._plug_in(model, config, timeline, optimizer)
        except BaseException:
            ddp.close()
            raise
        self.clock = ddp  # its comm_seconds and exposed_seconds

    def _plug_in(self, model, config, timeline, optimizer) -> None:
        """The optimizer, the comm hook (--compress, --prune) and the --compress-on
        placement: what the skeleton drives."""
        ddp = self.ddp
        self.optimizer_from_config = optimizer is None  # else the caller's, named by no flag
        self.optimizer = optimizer or optim.make_optimizer(
            config.optimizer, model.parameters(), config.lr, config.weight_decay
        )
        self.momentum_correction = None  # --compress-on velocity: DGC's u_w, then C
        if config.compress_on == "velocity":
            momentum = self.optimizer.hyper["momentum"]
            self.momentum_correction = MomentumCorrection(self.compressor, momentum)
            ddp.register_comm_hook(self.momentum_correction)
        elif self.compressor is not None:
            ddp.register_comm_hook(self.compressor)
        self.pruning = attach_pruner(ddp, self.optimizer, config)  # None: no --prune
        # what the skeleton drives: the reduction in backward, or inside the optimizer
        self.sync, self.stepper = ddp, self.optimizer
        if config.compress_on == "update":
            self.sync, self.stepper = (
                LocalGradients(ddp),
                CompressedUpdate(self.optimizer, ddp, timeline),
            )
        elif config.compress_on == "velocity":
            wd = config.weight_decay
            self.sync = LocalGradients(ddp)
            self.stepper = MomentumCorrectedSGD(ddp, config.lr, wd, timeline)

    def make_step(self, loss, clip, timeline, job, after_sync=()) -> Step:
        """The skeleton over these pieces; `clip` is the recipe's global-norm clip, replaced
        by a local one where the optimizer runs before the reduction; `job` the recipe's
        whole group."""
        if self.config.compress_on != "gradient":  # this rank's own gradient, before its step
            clip = self.clip_locally
        before = [self.pruning.begin_step] if self.pruning else []
        self.run = step_from(
            *(self.config, loss, self.sync, self.stepper, self.dp_group, timeline, clip),
            job=job,
            before=before,
            after_sync=after_sync,
        )
        return self.run

    def clip_locally(self) -> None:
        optim.clip_grad_norm(self.ddp.parameters(), self.config.grad_clip)

    def held(self) -> dict[str, list]:
        """This axis's arrays by memory category (the recipe adds its groups' scratch)."""
        ddp = self.ddp
        return {
            "parameters": [p.data for p in ddp.parameters()],
            "gradients": [b.data for b in ddp.buckets],
            "optimizer": [optimizer_bytes(self.optimizer)],
            "buffers": [
                ddp.comm_group.buffer_bytes(),
                self.compressor.nbytes() if self.compressor else 0,  # residuals, warm start
                self.momentum_correction.nbytes() if self.momentum_correction else 0,  # u_w
                nbytes(self.pruning.pruner.masks) if self.pruning else 0,  # 1 byte per weight
                ddp.stage.nbytes(),  # host copies of torch buckets (host_stage.py)
            ],
        }

    def describe(self) -> str:
        ddp, config = self.ddp, self.config
        return (
            f"allreduce {config.allreduce} | buckets {len(ddp.buckets)} of <= "
            f"{config.bucket_mb} MiB | overlap {'on' if ddp.overlap else 'off'} "
            f"({ddp.overlap_reason}) | compress {config.compress}"
            + (f" on the {config.compress_on}" if config.compress_on != "gradient" else "")
            + (f" after {config.compress_warmup} steps" if config.compress_warmup else "")
        ) + (f" | {self.pruning.pruner.describe()}" if self.pruning else "")

    def record(self) -> dict:
        return {
            "allreduce": self.config.allreduce,
            "optimizer": self.config.optimizer if self.optimizer_from_config else None,
            "overlap": self.ddp.overlap,
            "buckets": len(self.ddp.buckets),
            "compress_on": self.config.compress_on,
            **self.compression(),
            **(self.pruning.record() if self.pruning else {}),
            **self.ddp.stage.record(),  # --backend torch: the host staging copies
        }

    def summary(self) -> str:
        return compression_line(self.compression()) if self.compressor else ""

    def compression(self) -> dict:
        sent = bytes_sent(self.ddp.comm_group)  # the comm group carries the buckets only
        return compression_record(
            self.config.compress,
            self.compressor,
            self.ddp.buckets,
            sent,
            self.run.steps_done,
            self.dp_group.size,
        )

    def state_dict(self) -> dict:
        """The model and optimizer as checkpoint.get_state_dict gives them (by parameter
        name, a TP slice where the model is cut: they reshard), the pruning masks (whole
        on every rank), and each rank's own: the compressors' residuals and DGC's velocity."""
        stepped = self.optimizer if self.momentum_correction is None else None  # (DGC: unused)
        model, optimizer = get_state_dict(self.model, stepped)
        state = {"model": model, "optimizer": optimizer}
        if self.compressor is not None:  # error-feedback residuals are training state
            state["compressor"] = self.compressor.state_dict()
        if self.momentum_correction is not None:  # DGC's u_w
            state["velocity"] = self.momentum_correction.state_dict()
        if self.pruning is not None:  # the masks and the schedule's step
            masks = [f"masks/{n}" for n, _ in self.pruning.pruner.named]
            state["prune"] = StateDict(
                self.pruning.pruner.state_dict(), layout=dict.fromkeys(masks, "replicated")
            )
        return state

    def state_layout(self) -> dict:
        """How state_dict()'s arrays are cut, for resharding (minidp.parallel.checkpoint)."""
        return declared(self.state_dict())[1]

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer if self.momentum_correction is None else None,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
        if self.momentum_correction is not None:
            self.momentum_correction.load_state_dict(state["velocity"])
        if self.pruning is not None:
            self.pruning.pruner.load_state_dict(state["prune"])

    def close(self) -> None:
        self.ddp.close()
