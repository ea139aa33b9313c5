"""The `--strategy` recipes: each wraps the task's model in the pieces of minidp.parallel
over its group (tp and hybrid: over a Mesh's axes) and hands them to the one step skeleton
(step.py). Read in this order:

    protocol.py      what the training loop drives, and Recipe: reports from declarations
                     and from its data-parallel axis
    step.py          the step skeleton (parallel/step.py) from the flags
    ddp_axis.py      the data-parallel axis as DDP, with its --compress / --prune wiring
    dp.py            --strategy dp: DDP over the whole group
    zero.py          --strategy zero: parallel/zero/stages.py over the whole group
    tp.py            --strategy tp and hybrid: the TP GPT, DDP or ZeRO over the DP axis
                     (parallel/zero/over_tp.py: ZeRO's chunks of TP shards)
    ps.py            --strategy ps: the parameter server's roles
    ep.py            --strategy dp or hybrid with --experts: ExpertParallel over DP (x TP)
    pp.py            --strategy pp and hybrid --pp: the GPT cut into pipeline stages over
                     the mesh's PP axis, TP inside, DDP or ZeRO-1 over DP
                     (parallel/pipeline/step.py: the skeleton with the schedule inside)

`STRATEGIES` maps each --strategy name to its class (hybrid: a function that picks one); a
new scheme is a module here and one line in the table.
"""

from collections.abc import Callable

from minidp.cli.strategies.dp import DataParallel
from minidp.cli.strategies.ep import or_experts
from minidp.cli.strategies.pp import Pipeline, hybrid
from minidp.cli.strategies.protocol import Recipe, StepResult, Strategy
from minidp.cli.strategies.ps import ParameterServer
from minidp.cli.strategies.tp import Hybrid, TensorParallel
from minidp.cli.strategies.zero import ZeRO

STRATEGIES: dict[str, Callable[..., Strategy]] = {
    DataParallel.name: or_experts(DataParallel),  # --experts: ep.Experts
    ParameterServer.name: ParameterServer,
    ZeRO.name: ZeRO,
    TensorParallel.name: TensorParallel,
    hybrid.name: or_experts(hybrid),  # Hybrid (dp x tp), Pipeline (--pp > 1), Experts
    Pipeline.name: Pipeline,
}

__all__ = [
    "STRATEGIES",
    "DataParallel",
    "Hybrid",
    "ParameterServer",
    "Pipeline",
    "Recipe",
    "StepResult",
    "Strategy",
    "TensorParallel",
    "ZeRO",
]
