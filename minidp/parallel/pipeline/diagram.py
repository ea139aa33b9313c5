"""Pictures of a simulated schedule: the text grid and the time-diagram PNG.

The grid has one row per rank and one column per tick of simulate.py's timeline ('.' idle);
an action spans its ticks. 1F1B, pp = 2, m = 3 (F = B = 1, so one tick per unit):

    rank 0: 0F0 0F1 .   0B0 0F2 0B1 .   0B2
    rank 1: .   1F0 1B0 1F1 1B1 1F2 1B2 .

A split schedule counts in half units (B = W = 1/2), so an F spans two columns.
"""

from minidp.parallel.pipeline.actions import TICKS_PER_UNIT
from minidp.parallel.pipeline.simulate import Timeline


def grid(timeline: Timeline) -> str:
    """One row per rank: `rank 0: 0F0 0F1 . 0B0 ...`."""
    labels = [str(a) for row in timeline.rows for _, _, a in row]
    width = max((len(label) for label in labels), default=1)
    tick_per_cell = 1 if timeline.split_backward else TICKS_PER_UNIT  # F = one column
    lines = []
    for rank, row in enumerate(timeline.rows):
        cells, t = [], 0
        for start, stop, action in row:
            cells += [".".ljust(width)] * ((start - t) // tick_per_cell)
            span = (stop - start) // tick_per_cell
            cells.append(str(action).ljust(span * width + span - 1))
            t = stop
        cells += [".".ljust(width)] * ((timeline.length_ticks - t) // tick_per_cell)
        lines.append(f"rank {rank}: " + " ".join(cells).rstrip())
    return "\n".join(lines)


COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def time_diagram(timeline: Timeline, path: str, title: str = "") -> str | None:
    """Save the timeline as a PNG (one bar per action, rank 0 on top); None without
    matplotlib. Returns the path."""
    from minidp.tools.plots import pyplot, save

    plt = pyplot()
    if plt is None:
        return None
    unit = 1 / TICKS_PER_UNIT
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * timeline.length + 2), 0.5 * timeline.pp + 1.2))
    for rank, row in enumerate(timeline.rows):
        for start, stop, action in row:
            x, w = start * unit, (stop - start) * unit
            ax.broken_barh(
                [(x, w)], (rank - 0.4, 0.8), facecolors=COLOURS[action.kind], edgecolors="white"
            )
            ax.text(
                x + w / 2,
                rank,
                f"{action.stage}{action.kind}{action.micro_batch}",
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(timeline.pp), [f"rank {r}" for r in range(timeline.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.length)
    ax.set_xlabel("time (F = 1)")
    ax.set_title(title or f"bubble {timeline.bubble_fraction:.3f}")
    return save(fig, path)


__all__ = ["grid", "time_diagram"]
