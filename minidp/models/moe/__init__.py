"""Mixture of experts, the model side (no MPI): routing.py (the router's top-k, the gates,
capacity, Switch's auxiliary loss), layer.py (MoE: dispatch, the experts, combine; the
plain dispatcher), load.py (the tokens-per-expert record and its picture). Spreading the
experts over ranks is minidp/parallel/experts/; the idea, the groups and a measured table
are in docs/experts.md.
"""

from minidp.models.moe.layer import (
    Expert,
    ExpertLoad,
    LocalExperts,
    MoE,
    load_balancing_loss,
    moe_layers,
)
from minidp.models.moe.load import add_loads, expert_load, plot_expert_load
from minidp.models.moe.routing import Routing, capacity, route

__all__ = [
    "Expert",
    "ExpertLoad",
    "LocalExperts",
    "MoE",
    "Routing",
    "add_loads",
    "capacity",
    "expert_load",
    "load_balancing_loss",
    "moe_layers",
    "plot_expert_load",
    "route",
]
