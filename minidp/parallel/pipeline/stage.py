"""PipelineStage: one stage of a pipeline, the actions a schedule calls on it.

After torch.distributed.pipelining's `PipelineStage(submodule, stage_index, num_stages,
device, group)`. A model is cut into S parts (`split_model`, split.py); stage s runs part s
on rank s % P of a pipeline group of P ranks (P = S, or S = V P with V stages per rank,
looped, as interleaved 1F1B places them). A schedule (schedules.py) calls, per action:

    F  forward(mb, inputs=None, targets=None, share=1.0)
         first stage: run the part on `inputs` (token ids / features)
         others:      receive the activations from stage s - 1, run the part
         last stage:  loss = loss_fn(output, targets) * share; others: send the output on
    B+W backward(mb)          receive dL/d(output) (or start from the loss), backprop into
                              the part's parameters, send dL/d(input) to stage s - 1
    B  backward_input(mb)     the same but the weight gradients, kept for W; sends at once
    W  backward_weight(mb)    the weight gradients of mb's B, added into .grad

`share` is the micro-batch's fraction of the step's examples (B_mb / B): the weighted
losses of a step's micro-batches sum to the mean loss over its batch, and their gradients
to its gradient, as one process on the whole batch computes them.

The stage keeps each micro-batch's graph from its forward to its backward (the root: the
weighted loss, or the send's handle) and frees it after: `in_flight` and
`peak_in_flight` count micro-batches, `held_bytes` and `peak_bytes` the activations
(`minidp.tools.memory.activation_bytes`, a lower bound: see memory.py), what 1F1B bounds and GPipe
does not; between a B and its W, what B kept for W (backward_split.kept_bytes) instead,
the micro-batch still counted in flight until its W (simulate.py's peak activations).
"""

from minidp.engine import functional
from minidp.engine.nn import Module
from minidp.engine.tensor import Tensor
from minidp.parallel.pipeline import backward_split
from minidp.parallel.pipeline import communications as msg
from minidp.tools.memory import activation_bytes

__all__ = ["PipelineStage"]


class PipelineStage:
    """Stage `stage_index` of `num_stages`, running `module_part` on this rank of `group`
    (the pipeline's ranks: stage s on group rank s % group.size). `loss_fn(output,
    targets)` is the last stage's loss, a mean over the micro-batch's examples (0-d Tensor).
    See the module doc."""

    def __init__(
        self,
        module_part: Module,
        stage_index: int,
        num_stages: int,
        group,
        *,
        loss_fn=functional.cross_entropy,
    ):
        if not isinstance(module_part, Module):
            raise TypeError(f"module_part must be a minidp.nn.Module, got {type(module_part)}")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index!r}")
        if num_stages % group.size:
            raise ValueError(
                f"num_stages ({num_stages}) must be the group's size ({group.size}) "
                "or a multiple of it (stages per rank)"
            )
        if stage_index % group.size != group.rank:
            raise ValueError(
                f"stage_index {stage_index} belongs on group rank "
                f"{stage_index % group.size}, not on rank {group.rank}"
            )
        if stage_index == 0 < num_stages - 1 and not any(
            p.requires_grad for p in module_part.parameters()
        ):  # its backward would have nothing to run while stage 1 sends it a gradient
            raise ValueError(
                "module_part of stage 0 has no parameter that requires grad: a pipeline "
                "with a frozen first stage is not supported (put its layers in stage 1)"
            )
        self.module, self.loss_fn, self.group = module_part, loss_fn, group
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.prev_rank = (stage_index - 1) % group.size  # the rank of stage s - 1
        self.next_rank = (stage_index + 1) % group.size  # the rank of stage s + 1
        self.outbox = msg.Outbox(group)
        self._anchor = Tensor(0.0, requires_grad=True)  # receive_activations' parent
        self._roots: dict[int, tuple[Tensor, int]] = {}  # mb -> (root of its graph, bytes)
        self._weight_grads: dict[int, tuple[list, int]] = {}  # mb -> (B kept for W, bytes)
        self._inputs: dict = {}  # first stage: mb -> the user's batch (never counted as held)
        self.losses: dict[int, float] = {}  # the last stage's weighted loss per micro-batch
        # in_flight: micro-batches between their F and their last backward action (B, or W
        # when split: as simulate.py counts them); held_bytes: their graphs, then what B kept
        self.in_flight = self.peak_in_flight = self.held_bytes = self.peak_bytes = 0

    def parameters(self) -> list:
        """The part's parameters (the user's own, frozen ones included)."""
        return self.module.parameters()

    def _tags(self, micro_batch: int, boundary: int) -> tuple[int, int]:
        """(forward tag, backward tag) across stage boundary -> boundary + 1."""
        tag = msg.message_tag
        S, group = self.num_stages, self.group
        return (
            tag(group, micro_batch, boundary, S, msg.FORWARD),
            tag(group, micro_batch, boundary, S, msg.BACKWARD),
        )

    # ---- F ---------------------------------------------------------------------------------
    def forward(self, micro_batch: int, inputs=None, targets=None, share: float = 1.0):
        """F for `micro_batch`: returns the weighted loss (a 0-d Tensor) on the last stage,
        the output activations (sent on already) on the others. `inputs` on the first stage
        only, `targets` on the last only."""
        if micro_batch in self._roots or micro_batch in self._weight_grads:
            raise ValueError(f"micro_batch {micro_batch} is already in flight on this stage")
        if self.is_first != (inputs is not None):
            raise ValueError(f"stage {self.stage_index}: inputs go to stage 0 only")
        if self.is_last != (targets is not None):
            raise ValueError(f"stage {self.stage_index}: targets go to the last stage only")
        if self.is_first:
            x = self._inputs[micro_batch] = inputs
        else:
            tags = self._tags(micro_batch, self.stage_index - 1)
            x = msg.receive_activations(self._anchor, self.outbox, self.prev_rank, *tags)
        y = self.module(x)
        if self.is_last:
            root = self.loss_fn(y, targets) * share
            self.losses[micro_batch] = root.item()
        else:
            tags = self._tags(micro_batch, self.stage_index)
            root = msg.send_activations(y, self.outbox, self.next_rank, *tags)
        if root.requires_grad:  # not under no_grad, and something needs a gradient
            self._hold(micro_batch, root)
        return root if self.is_last else y

    def _hold(self, micro_batch: int, root: Tensor) -> None:
        nbytes = activation_bytes(root)
        self._roots[micro_batch] = (root, nbytes)
        self.in_flight += 1
        self._count(nbytes)

    def _count(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _release(self, micro_batch: int) -> Tensor:
        if micro_batch not in self._roots:
            raise ValueError(f"micro_batch {micro_batch}: no forward of it is in flight here")
        root, nbytes = self._roots.pop(micro_batch)
        self.in_flight -= 1
        self.held_bytes -= nbytes
        return root

    # ---- B and W ---------------------------------------------------------------------------
    def backward(self, micro_batch: int) -> None:
        """B and W at once for `micro_batch`: the engine's backward from its root (receive
        dL/d(output) first, send dL/d(input) last); the graph is freed after."""
        self._inputs.pop(micro_batch, None)
        self._release(micro_batch).backward()

    def backward_input(self, micro_batch: int) -> None:
        """B for `micro_batch`: dL/d(input), sent upstream at once; the parameters'
        gradients kept (a Linear's uncomputed: x and dL/dy) for `backward_weight`."""
        kept = backward_split.backward_input(self._release(micro_batch))
        inputs = self._inputs.pop(micro_batch, None)  # the user's batch: not counted
        self._weight_grads[micro_batch] = kept, backward_split.kept_bytes(kept, inputs)
        self.in_flight += 1  # still in flight until its W
        self._count(self._weight_grads[micro_batch][1])  # held until W

    def backward_weight(self, micro_batch: int) -> None:
        """W for `micro_batch`: add the gradients its B kept into the parameters' .grad."""
        if micro_batch not in self._weight_grads:
            raise ValueError(f"micro_batch {micro_batch}: W before its B on this stage")
        kept, nbytes = self._weight_grads.pop(micro_batch)
        backward_split.backward_weight(kept)
        self.in_flight -= 1
        self.held_bytes -= nbytes

    # ---- around a step ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The part's parameters, under the whole model's names (split.py)."""
        return self.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)

    def wait_sends(self) -> None:
        """Wait until every message this stage sent has been received (end of a step)."""
        self.outbox.wait()

    def reset_peaks(self) -> None:
        """Start counting peaks afresh (a new step); losses are forgotten too."""
        self.peak_in_flight, self.peak_bytes = self.in_flight, self.held_bytes
        self.losses.clear()
