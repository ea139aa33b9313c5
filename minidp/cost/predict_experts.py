"""predict for a MoE GPT (`--experts E --ep N` under --strategy dp or hybrid, with --tp
too): its Layout and the slots S the prediction assumes (cost/experts.py prices the calls;
docs/experts.md).

    python -m minidp predict --strategy hybrid --dp 4 --experts 4 --ep 2 --world 4
    python -m minidp predict --strategy hybrid --dp 4 --tp 2 --experts 4 --ep 2 --world 8
"""

from minidp.cli.training.config import BadConfig
from minidp.cost.experts import Experts, slots
from minidp.cost.step import Layout
from minidp.tools.chunks import chunk_bounds


def experts_layout(config, world: int) -> Layout:
    """ExpertParallel over the DP ranks of a dp x tp mesh (--strategy dp: dp x 1), EP groups
    of --ep; BadConfig as the run refuses (strategies/ep.py): equal slices, --ep dividing
    the DP ranks."""
    from minidp.cli.strategies.tp import hybrid_sizes

    dp, tp, cp = hybrid_sizes(config, world) if config.strategy == "hybrid" else (world, 1, 1)
    N, B = config.ep, config.batch_size
    if dp * tp * cp != world:
        raise BadConfig(f"--world {world}: the mesh dp x tp x cp = {dp} x {tp} x {cp}")
    if cp > 1:
        raise BadConfig("--experts with --cp is not yet supported")
    if dp % N or B % dp:
        raise BadConfig(f"--ep {N} and --batch-size {B} must divide by the {dp} DP ranks")
    if B // dp < config.grad_accum:
        raise BadConfig(f"--batch-size {B} over {dp} ranks: too few examples")
    moe = Experts(config.experts, config.moe_top_k, config.capacity_factor, config.moe_every)
    return Layout(config.strategy, dp=dp, tp=tp, grad_accum=config.grad_accum,
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
