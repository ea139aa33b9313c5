"""The units of a model: the layers a sharding scheme gathers one at a time.

ZeRO stage 3 and FSDP (parallel/zero/) hold each unit's parameters as one segment, gathered
just before the unit runs; the cost model (cost/calls.py, `model_shapes`) prices the same
gathers without running anything. One rule for both, here, on the engine's Modules alone.
"""

from minidp.engine.nn import Module


def units_of(model: Module) -> list[tuple[str, Module, list]]:
    """The layers gathered one at a time, in forward order: (name, module, its trainable
    parameters). Each direct child of the model that owns trainable parameters is a unit,
    with those no other child holds. What is left (the model's own parameters, and those
    two children share: a tied weight) is a unit of the model itself, put first: it is
    gathered for the whole forward, as PyTorch FSDP's root unit. Frozen parameters
    (requires_grad False) are in no unit: they stay whole on every rank."""
    children = list(model.children())
    holders: dict[int, set[str]] = {}
    for name, child in children:
        for p in child.parameters():
            holders.setdefault(id(p), set()).add(name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    rest = [p for p in trainable if len(holders.get(id(p), ())) != 1]
    units = [("", model, rest)] if rest else []
    for name, child in children:
        own = [p for p in child.parameters() if p.requires_grad and holders[id(p)] == {name}]
        if own:
            units.append((name, child, own))
    return units
