"""StepMeter: a training loop's logging window, as a small object of its own (the command
line's loop keeps one over its strategy; anything with running totals `comm_seconds`,
`exposed_seconds` and `bytes_sent_by_axis()` can be metered).

Between two log lines the loop runs a few steps. The meter remembers where every running
total stood at the last line (the clock, communication seconds, exposed seconds, bytes
sent), so that each line reports its own window only:

    meter = StepMeter(strategy)       # the totals as they stand before the first step
    for step in ...:
        ...; meter.count()            # one more step in the open window
        if it is time to log:
            w = meter.window()        # w.steps, w.seconds, w.comm_s, w.exposed_s, w.bytes_sent
    meter.total()                     # the same sums over the whole run
    meter.steady()                    # ... and over every step after the first (warm-up)
    meter.bytes_by_axis()             # what the run sent, per mesh axis (AXES)

Everything is counted from the meter's making, so what a strategy sends while it is built,
or for the reports after training (the spread between replicas), is not in it.
"""

import contextlib
import time
from typing import NamedTuple

AXES = ("dp", "tp", "pp", "cp", "ep")  # the mesh axes every final record names


class Totals(NamedTuple):
    seconds: float  # the wall clock (perf_counter)
    comm_s: float  # time communicating
    exposed_s: float  # the part of it that nothing hid
    bytes_sent: int  # data bytes this rank sent, over every axis


class Window(NamedTuple):
    steps: int
    seconds: float
    comm_s: float
    exposed_s: float
    bytes_sent: int


class StepMeter:
    def __init__(self, strategy):
        self.strategy = strategy
        self._start_by_axis = strategy.bytes_sent_by_axis()
        self.start = self.last = self.totals()
        self.steps = self.all_steps = 0
        self.aside_s = 0.0  # seconds set aside() after the first step

    def totals(self) -> Totals:
        s = self.strategy
        by_axis = s.bytes_sent_by_axis()
        return Totals(time.perf_counter(), s.comm_seconds, s.exposed_seconds, sum(by_axis.values()))

    def count(self) -> None:
        self.steps += 1
        self.all_steps += 1
        if self.all_steps == 1:  # where the first step, the warm-up, ended
            self.first = self.totals()

    def window(self) -> Window:
        """The steps since the last window (or the start); the next window opens now."""
        now = self.totals()
        window = Window(self.steps, *(b - a for a, b in zip(self.last, now)))
        self.last, self.steps = now, 0
        return window

    def total(self) -> Window:
        """Every step since the meter was made."""
        return Window(self.all_steps, *(b - a for a, b in zip(self.start, self.totals())))

    @contextlib.contextmanager
    def aside(self):
        """Time spent in this block (a checkpoint save, a replica check) is not a step's:
        steady() leaves it out."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.all_steps >= 1:  # after the first step: inside steady()'s span
                self.aside_s += time.perf_counter() - start

    def steady(self) -> Window:
        """Every step after the first (which also makes buffers and touches fresh memory),
        or the first alone if it is the only one; time set aside() not counted."""
        if self.all_steps < 2:
            return self.total()
        now = self.totals()
        seconds = now.seconds - self.first.seconds - self.aside_s
        rest = (b - a for a, b in zip(self.first[1:], now[1:]))
        return Window(self.all_steps - 1, seconds, *rest)

    def bytes_by_axis(self) -> dict[str, int]:
        """Bytes this rank sent since the meter was made, per axis: every mesh axis of AXES
        is present, 0 where the strategy has none."""
        now = {**dict.fromkeys(AXES, 0), **self.strategy.bytes_sent_by_axis()}
        return {axis: sent - self._start_by_axis.get(axis, 0) for axis, sent in now.items()}

    def so_far(self, skipped: list[int], before: dict) -> dict:
        """The final record's running counts over the whole run: those carried in the
        checkpoint this launch resumed from (`before`, {} without one) plus this launch's
        (from the first step on), and the steps skipped. time_s is thus the loop's time in
        every launch together, start-up and loading not counted. Plain Python numbers: a
        checkpoint keeps them in its JSON skeleton, which reshards with any layout."""
        total, axes = self.total(), before.get("bytes_sent_by_axis", {})
        by_axis = self.bytes_by_axis().items()
        return {
            "time_s": float(before.get("time_s", 0.0) + total.seconds),
            "comm_s": float(before.get("comm_s", 0.0) + total.comm_s),
            "exposed_comm_s": float(before.get("exposed_comm_s", 0.0) + total.exposed_s),
            "bytes_sent_per_rank": int(before.get("bytes_sent_per_rank", 0) + total.bytes_sent),
            "bytes_sent_by_axis": {a: int(axes.get(a, 0) + b) for a, b in by_axis},
            "skipped_steps": [int(s) for s in [*before.get("skipped_steps", []), *skipped]],
        }
