"""Pictures for tutorials and benchmarks: one PNG per figure, saved with matplotlib.

    from minidp.tools.plots import pyplot, save
    plt = pyplot()                      # None when matplotlib is missing (the `plot` extra)
    if plt is not None:
        fig, ax = plt.subplots()
        ax.plot(steps, losses, label="dp")
        save(fig, "loss_curves.png")    # prints where it went

matplotlib is optional (`pip install -e ".[plot]"`; the dev extra includes it). Without it a
tutorial or benchmark still prints its numbers and says which picture it skipped. The Agg
backend draws to files only, so this works on machines with no display and under mpiexec.
"""

import os


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("(matplotlib is not installed: no picture; pip install -e '.[plot]')", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str) -> str:
    """Save `fig` as a PNG at `path` (directories made as needed), close it, say where."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"picture: {path}", flush=True)
    return path
