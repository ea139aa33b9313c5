"""predict for a MoE GPT (`--experts E --ep N` under --strategy dp or hybrid): its Layout and
the slots S the prediction assumes (cost/experts.py prices the calls; docs/experts.md).

    python -m minidp predict --strategy hybrid --experts 4 --ep 2 --world 4
"""

from minidp.cli.training.config import BadConfig
from minidp.cost.experts import Experts, slots
from minidp.cost.step import Layout
from minidp.tools.chunks import chunk_bounds


def experts_layout(config, world: int) -> Layout:
    """ExpertParallel over every rank (a dp x 1 mesh), EP groups of --ep; BadConfig as the
    run refuses (strategies/ep.py): equal slices, --ep dividing the DP ranks."""
    dp, N, B = world, config.ep, config.batch_size
    if config.strategy == "hybrid" and (config.is_set("dp") and config.dp != world):
        raise BadConfig(f"--experts runs on a dp x 1 mesh: --dp {config.dp} on {world} ranks")
    if dp % N or B % dp:
        raise BadConfig(f"--ep {N} and --batch-size {B} must divide by the {dp} DP ranks")
    if B // dp < config.grad_accum:
        raise BadConfig(f"--batch-size {B} over {dp} ranks: too few examples")
    moe = Experts(config.experts, config.moe_top_k, config.capacity_factor, config.moe_every)
    return Layout(config.strategy, dp=dp, grad_accum=config.grad_accum,
                  clip=config.grad_clip > 0, ep=N, experts=moe)  # fmt: skip


def assumed_slots(config, layout: Layout) -> str:
    """The line that says which S the ep bytes assume (experts.py's rule)."""
    examples = chunk_bounds(config.batch_size // layout.dp, layout.grad_accum)[1]
    tokens = examples * config.block_size  # a micro-batch's on a rank: N_r
    S, moe = slots(layout.experts, tokens), layout.experts
    head = f"experts: {moe.n_experts}, top-{moe.top_k}, ep {layout.ep}; S = {S} slots an expert"
    if moe.capacity_factor:
        F, k, E = moe.capacity_factor, moe.top_k, moe.n_experts
        return f"{head}, the capacity ceil({F:g}·{tokens}·{k}/{E}): exact if it fills every forward"
    return (
        f"{head}, an even load of the {tokens} tokens a rank routes (dropless): the ep bytes "
        f"are a lower bound, up to {moe.n_experts // moe.top_k}x at S = {tokens}"
    )
