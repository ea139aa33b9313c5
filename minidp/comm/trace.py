"""A timeline of what each rank did and when, as a Chrome-trace JSON file.

    with timeline.span("backward", track="compute"):
        loss.backward()

Each rank records spans on named tracks (compute on the main thread, communication on the
comm thread); `timeline.save(path, group)` gathers every rank's spans to rank 0, which
writes one file: one process per rank, one thread per track. Open it in ui.perfetto.dev or
chrome://tracing to see communication hidden behind backward (or not).
"""

import contextlib
import json
import threading
import time

import numpy as np

from minidp import comm

TRACKS = {"compute": 1, "communication": 2}


class Timeline:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    @property
    def t0(self) -> float:
        """When the timeline began (perf_counter seconds): an event's "ts" is microseconds
        after it."""
        return self._t0

    @contextlib.contextmanager
    def span(self, name: str, track: str = "compute", **args):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, track, start, time.perf_counter(), **args)

    def add(self, name: str, track: str, start: float, end: float, **args) -> None:
        """Record a span measured elsewhere (perf_counter seconds)."""
        if self.enabled:
            event = {
                "name": name,
                "ph": "X",
                "tid": TRACKS[track],
                "ts": (start - self._t0) * 1e6,
                "dur": (end - start) * 1e6,
                "args": args,
            }
            with self._lock:
                self.events.append(event)

    def save(self, path: str, group: comm.Group) -> None:
        """Collective: gather every rank's spans; rank 0 writes the Chrome-trace file."""
        # perf_counter is one clock for all processes of a machine: shift every rank's spans
        # to the earliest rank's start so that the ranks line up (across machines, roughly)
        start = comm.allreduce(np.array([self._t0]), op="min", group=group)[0]
        shift = (self._t0 - start) * 1e6
        mine = json.dumps([{**event, "ts": event["ts"] + shift} for event in self.events])
        texts = comm.gather_text(mine, root=0, group=group)
        if group.rank != 0:
            return
        trace = []
        for rank, text in enumerate(texts):
            trace.append(
                {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
            )
            for track, tid in TRACKS.items():
                trace.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": rank,
                        "tid": tid,
                        "args": {"name": track},
                    }
                )
            trace.extend({**event, "pid": rank} for event in json.loads(text))
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
