"""The simulator's tables and pictures, from the rows of cost/scale.py.

    print(crossover_table(rows))   # markdown, one function a table
    save_all(record, "runs/sim")   # record: the rows `python -m minidp simulate --json` saves

One PNG per figure (minidp.tools.plots: matplotlib's Agg backend, skipped when it is missing):
crossover.png (every allreduce algorithm against size at the largest p), scaling.png (DP's
efficiency against ranks), breakeven.png (compression's breakeven bandwidth against ranks).
"""

import os

from minidp.tools.plots import pyplot, save

SHORT = {
    "ring": "ring",
    "recursive_doubling": "rd",
    "rabenseifner": "rab",
    "tree": "tree",
    "naive": "naive",
}


def size(nbytes: float) -> str:
    """1 KiB, 256 MiB, ..."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    return ""


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def crossover_table(rows: list[dict]) -> str:
    """p down, bytes across: the winner and its margin over the runner-up; * where auto
    picks another; then how often, and the worst case."""
    groups, sizes = sorted({r["p"] for r in rows}), sorted({r["bytes"] for r in rows})
    cells = {(r["p"], r["bytes"]): r for r in rows}

    def cell(r: dict) -> str:
        return f"{SHORT[r['winner']]} {r['margin']:.2f}x" + (
            "*" if r["auto"] != r["winner"] else ""
        )

    text = table(
        ["p \\ bytes"] + [size(n) for n in sizes],
        [[p] + [cell(cells[p, n]) for n in sizes] for p in groups],
    )
    text += "\n\nthe table auto should use (the winner from each size on):\n" + "\n".join(
        f"p {p}: " + ", ".join(f"{SHORT[w]} from {size(n)}" for n, w in switches(rows, p))
        for p in groups
    )
    off = [r for r in rows if r["auto_slowdown"] > 1 + 1e-9]
    worst = max(off, key=lambda r: r["auto_slowdown"], default=None)
    if worst:
        text += (
            f"\nauto differs from the winner in {len(off)} of {len(rows)} cells; worst: "
            f"p {worst['p']}, {size(worst['bytes'])}: {worst['auto']} takes "
            f"{worst['auto_slowdown']:.2f}x {worst['winner']}'s time"
        )
    return text


def switches(rows: list[dict], p: int) -> list[tuple[int, str]]:
    """(bytes, winner) where the winner on p ranks changes, smallest size first."""
    out: list[tuple[int, str]] = []
    for r in sorted((r for r in rows if r["p"] == p), key=lambda r: r["bytes"]):
        if not out or out[-1][1] != r["winner"]:
            out.append((r["bytes"], r["winner"]))
    return out


def scaling_table(rows: list[dict]) -> str:
    header = [
        "ranks",
        "compute s",
        "step s",
        "efficiency",
        "overlap: step s",
        "efficiency",
        "overlap, best algorithm: step s",
        "efficiency",
    ]
    body = [
        [
            r["p"],
            f"{r['compute']:.3f}",
            f"{r['serial']:.3f}",
            f"{r['serial_efficiency']:.1%}",
            f"{r['overlap']:.3f}",
            f"{r['overlap_efficiency']:.1%}",
            f"{r['best']:.3f} ({r['best_algo']})",
            f"{r['best_efficiency']:.1%}",
        ]
        for r in rows
    ]
    return table(header, body)


def breakeven_table(rows: list[dict], now: float) -> str:
    """Ranks down, compressors across: the breakeven in Gb/s, the compression ratio (bytes
    on the plain allreduce's critical path / on the compressor's); + where it pays at `now`."""

    def cell(r: dict) -> str:
        b = 8 * r["bandwidth"] / 1e9
        text = "never" if b == 0 else "always" if b == float("inf") else f"{b:.3g}"
        return f"{text} ({r['ratio']:.3g}x)" + (" +" if b > now else "")

    names = list(dict.fromkeys(r["compress"] for r in rows))
    ranks = sorted({r["p"] for r in rows})
    return table(["ranks"] + names, [[p] + [cell(r) for r in rows if r["p"] == p] for p in ranks])


def zero_table(rows: list[dict]) -> str:
    return table(
        ["scheme", "messages", "bytes", "vs dp"],
        [[r["scheme"], r["messages"], f"{r['bytes']:,}", f"{r['vs_dp']:.3f}"] for r in rows],
    )


def pipeline_table(rows: list[dict]) -> str:
    """Rows of parallel/pipeline/simulate.py's summary()."""
    return table(
        ["schedule", "V", "length", "bubble", "formula", "peak activations, rank 0"],
        [
            [
                r["schedule"],
                r["virtual"],
                f"{r['length']:g}",
                f"{r['bubble_fraction']:.4f}",
                f"{r['formula']} = {r['formula_bubble']:.4f}",
                r["peak_activations_per_rank"][0],
            ]
            for r in rows
        ],
    )


def memory_table(rows: list[dict]) -> str:
    parts = ("parameters", "gradients", "optimizer", "activations_peak", "total")
    return table(
        ["scheme", "layout", *(f"{p}, GB" for p in parts)],
        [[r["scheme"], r["layout"], *(f"{r[k] / 1e9:.3g}" for k in parts)] for r in rows],
    )


def save_all(record: dict, directory: str) -> list[str]:
    """crossover.png, scaling.png, breakeven.png in directory; the paths saved."""
    plt = pyplot()
    if plt is None:
        return []
    saved = []
    rows = record["crossover"]
    p = max(r["p"] for r in rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mine = [r for r in rows if r["p"] == p]
    for algo in mine[0]["times"]:
        ax.loglog([r["bytes"] for r in mine], [r["times"][algo] for r in mine], "o-", label=algo)
    ax.set(xlabel="bytes", ylabel="seconds (α-β-γ model)", title=f"allreduce on {p} ranks")
    ax.legend()
    saved.append(save(fig, os.path.join(directory, "crossover.png")))

    rows = record["scaling"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ranks = [r["p"] for r in rows]
    ax.semilogx(ranks, [r["serial_efficiency"] for r in rows], "o-", label="no overlap", base=2)
    ax.semilogx(ranks, [r["overlap_efficiency"] for r in rows], "o-", label="overlap", base=2)
    best = [r["best_efficiency"] for r in rows]
    ax.semilogx(ranks, best, "o-", label="overlap, the crossover's algorithm", base=2)
    ax.set(
        xlabel="ranks",
        ylabel="compute / step",
        ylim=(0, 1.05),
        title=f"data parallelism, Ψ = {record['params']:.3g}",
    )
    ax.legend()
    saved.append(save(fig, os.path.join(directory, "scaling.png")))

    rows = record["compression"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["compress"] for r in rows):
        points = [(r["p"], 8 * r["bandwidth"] / 1e9) for r in rows if r["compress"] == name]
        points = [(q, b) for q, b in points if 0 < b < float("inf")]
        if points:
            ax.plot(*zip(*points), "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.axhline(8 / record["network"]["beta"] / 1e9, color="gray", ls="--", label="this network")
    ax.set(
        xlabel="ranks",
        ylabel="breakeven bandwidth, Gb/s",
        title="compression pays below the line (missing: never)",
    )
    ax.legend()
    saved.append(save(fig, os.path.join(directory, "breakeven.png")))
    return saved
