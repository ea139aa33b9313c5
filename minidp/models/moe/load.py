"""The experts' load, for a run's record and a picture: how many tokens each expert got in
the last forward of each MoE layer, over the whole batch, and how many were dropped.

    record = expert_load(model)      # after a forward; JSON-ready
    plot_expert_load(record, "expert_load.png")

The counts are summed over the data-parallel ranks by the layer itself (its dispatcher's
sum_over_batch, the message that also gives Switch's f_e), so every rank returns the same
record and no message is sent here.
"""

from minidp.engine.nn import Module
from minidp.models.moe.layer import moe_layers
from minidp.tools.plots import pyplot, save

__all__ = ["add_loads", "expert_load", "plot_expert_load"]


def expert_load(model: Module) -> dict:
    """{"layers": [name, ...], "tokens_per_expert": [[routed to e for each e], ...],
    "dropped_per_expert": [[...], ...], "tokens": [N, ...], "dropped": total dropped}:
    one entry per MoE layer that has run a forward, in the model's order. `tokens_per_expert`
    counts the router's assignments (k per token) before capacity; those past capacity are
    `dropped_per_expert` (so an expert computed routed - dropped)."""
    layers = [(name.rstrip("."), m.load) for name, m in moe_layers(model) if m.load is not None]
    return {
        "layers": [name for name, _ in layers],
        "tokens_per_expert": [[int(c) for c in load.routed] for _, load in layers],
        "dropped_per_expert": [[int(c) for c in load.dropped] for _, load in layers],
        "tokens": [load.tokens for _, load in layers],
        "dropped": sum(int(load.dropped.sum()) for _, load in layers),
    }


def add_loads(total: dict | None, record: dict) -> dict:
    """Two expert_load records summed count by count (the layers' names kept): a run's
    load over its forwards. `total` None: `record` itself."""
    if total is None:
        return record

    def add(a, b):
        return [add(x, y) for x, y in zip(a, b)] if isinstance(a, list) else a + b

    return {key: record[key] if key == "layers" else add(total[key], record[key]) for key in record}


def plot_expert_load(record: dict, path: str, title: str = "tokens per expert") -> str | None:
    """Bars of tokens per expert, one group of bars per layer, the dropped part hatched;
    saved as a PNG at `path` (None when matplotlib is missing)."""
    plt = pyplot()
    if plt is None:
        return None
    layers = record["layers"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(len(layers), 1)
    for i, name in enumerate(layers):
        routed, dropped = record["tokens_per_expert"][i], record["dropped_per_expert"][i]
        at = [e + i * width for e in range(len(routed))]
        kept = [r - d for r, d in zip(routed, dropped)]
        ax.bar(at, kept, width, label=name or "moe")
        ax.bar(at, dropped, width, bottom=kept, color="none", edgecolor="gray", hatch="//")
    n_experts = max((len(r) for r in record["tokens_per_expert"]), default=0)
    ax.set_xticks([e + 0.4 - width / 2 for e in range(n_experts)], range(n_experts))
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments (hatched: dropped)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return save(fig, path)
