"""Context parallelism inside a pipeline: a GPT's stages with their sequence split over a
context-parallel group (the mesh's cp axis, beside pp: MeshStages builds this when
mesh.cp > 1).

    parts = split_model(gpt, S)                # the stages' parts (pipeline/split.py)
    cp = StagesOverCP(parts, mesh.cp_group, algo="ring", zigzag=True)
    stage = PipelineStage(part, s, S, pp_group, loss_fn=cp.loss(cross_entropy))
    batch = cp.batch(task.batch)               # this rank's T/C positions of each example
    ... the schedule ...; cp.finish_gradient_sync(params)    # before the DP sync
    cp.restore_attention()                     # whole sequences again (after training)

ContextParallel (gpt.py) makes five changes to a whole GPT; a pipeline holds the GPT in
parts, so each change goes where the part that needs it is:

    attention    every part's attention core -> ContextParallelAttention over the group
                 (ring or Ulysses: the only layer that mixes positions; each stage's CP
                 ranks run the same actions in the same order, so their rings meet)
    wpe          the first part's embed gets this rank's positions, not 0..T/C-1
    batch        inputs (stage 0) and targets (the last stage): this rank's positions of
                 the examples its DP coordinate reads, the same examples on every CP rank;
                 the activations between stages are (B_mb, T/C, C) then
    loss         the last stage's: its tokens' mean x 1/C, summed over the group (forward
                 allreduce, backward the identity), so each micro-batch's loss is its
                 whole mean on every CP rank
    gradients    each rank's are partial sums over its T/C positions: allreduced (sum)
                 over the group once per step, before the data-parallel sync
"""

from minidp import comm
from minidp.parallel.context_parallel.gpt import (
    ContextParallelAttention,
    attention_layers,
    sum_over_group,
)


class StagesOverCP:
    """The five changes of the module docstring on `parts` (every stage's, in order: the
    first's embed is changed on every rank, harmlessly where it is released)."""

    def __init__(self, parts, group: comm.Group, algo: str = "ring", zigzag: bool = False):
        self.group = group
        self.attention = ContextParallelAttention(group, algo, zigzag)
        self.layers = [layer for part in parts for layer in attention_layers(part)]
        for layer in self.layers:
            if algo == "ulysses" and layer.n_head % group.size:
                raise ValueError(
                    f"Ulysses: {layer.n_head} heads do not divide by {group.size} ranks"
                )
            layer.attend = self.attention  # this instance's core, not the class's
        first = parts[0]
        embed = first.embed  # GPT.embed or TensorParallelGPT.embed: they take `positions`
        first.embed = lambda idx: embed(idx, positions=self.positions(idx.shape[1]))

    def positions(self, local_T: int):
        """The global positions of this rank's local_T rows (of a C x local_T sequence)."""
        return self.attention.layout(local_T * self.group.size).positions(self.group.rank)

    def shard(self, x):
        """This rank's positions of a whole (B, T) array."""
        return self.attention.layout(x.shape[1]).shard(x, self.group.rank)

    def batch(self, whole_batch):
        """`whole_batch(indices) -> (inputs, targets)` cut to this rank's positions."""
        return lambda indices: tuple(self.shard(a) for a in whole_batch(indices))

    def loss(self, loss_fn):
        """The last stage's loss: `loss_fn` (a mean over this rank's tokens) x 1/C, summed
        over the group: the micro-batch's mean over all its tokens."""
        share = 1.0 / self.group.size
        return lambda y, targets: sum_over_group(loss_fn(y, targets) * share, self.group)

    def finish_gradient_sync(self, params) -> None:
        """Sum each of `params`' gradients over the group (each rank's is a partial sum)."""
        grads = [p.grad for p in params if p.grad is not None]
        comm.allreduce_coalesced(grads, group=self.group)

    def restore_attention(self) -> None:
        """Give every attention layer back its class's own core (whole sequences again)."""
        for layer in self.layers:
            vars(layer).pop("attend", None)
