"""One step of the step model (step.py) as a timeline, in the Chrome-trace format of `--trace`.

    spans = step_spans(layout, shapes, compute, net, batch_size=B)
    write_trace("sim.json", spans, ranks=4)      # open beside a measured trace in Perfetto

step.py prices every collective of the step (calls.py) and says which hide; this lays the
same seconds out in time, on trace.py's two tracks, so the spans end at step.py's step_s:

    compute        | forward |           | backward ........ | gradient sync wait | | optimizer |
    communication            | fwd calls |    | DP buckets ...... | bwd calls | after |

    forward calls    (TP's g, ZeRO-3's gathers) after the forward, on the critical path
    DP's backward    reduced by the communication thread while backward runs when the layout
    calls            overlaps (ending with backward if they fit: step.py hides min(comm,
                     backward)); otherwise, and past backward's end, the compute track waits
    other backward   (TP's f, ZeRO-3's) after them, exposed; then the "after" calls (the loss,
    calls            the clip's norm, ZeRO's allgather), then the optimizer

A real run interleaves the calls with the compute they belong to (a TP layer's allreduce
inside its forward); the model only knows their sum, so each phase's calls are drawn
together. Names are the training run's (parallel/step.py's spans; comm_thread.py's
"allreduce bucket i" with args bytes and algo; "runs": the algorithm auto resolves to).

The file is what trace.Timeline.save writes: {"traceEvents": [...], "displayTimeUnit": "ms"},
per rank a "process_name" and a "thread_name" per track, then "X" events with name, ph, tid,
ts and dur in microseconds, args, pid. The model's ranks are alike, so `ranks` copies of
rank 0's spans are written.
"""

import json
from typing import NamedTuple

from minidp import cost
from minidp.comm.trace import TRACKS
from minidp.cost.step import call_time, predict, step_calls


class Span(NamedTuple):
    track: str  # "compute" or "communication" (trace.TRACKS)
    name: str
    start: float  # seconds from the step's start
    end: float
    args: dict


def _label(call, index: int) -> str:
    if call.axis == "dp" and call.phase == "backward":
        return f"{call.collective} bucket {index}"
    return f"{call.axis} {call.collective}"


def step_spans(layout, shapes, compute, net, *, batch_size: int, itemsize: int = 4) -> list:
    """The spans of one step on rank 0: the docstring's timeline of step.predict's terms
    (each rank on a core of its own: net.cores 0)."""
    if net.cores:
        raise ValueError("step_spans draws ranks on cores of their own: pass net.cores=0")
    p = predict(layout, shapes, compute, net, batch_size=batch_size, itemsize=itemsize)
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    calls = [c for c in step_calls(layout, shapes, itemsize, batch_size) if sizes[c.axis] > 1]
    timed = [(c, call_time(c, sizes[c.axis], net)) for c in calls]
    spans: list[Span] = []

    def run(phase_calls, start: float) -> float:
        for index, (call, seconds) in enumerate(phase_calls):
            nbytes = call.n * call.itemsize
            runs = cost.resolve(call.collective, call.algo, sizes[call.axis], nbytes)
            args = {"bytes": nbytes, "algo": call.algo, "runs": runs}
            spans.append(Span("communication", _label(call, index), start, start + seconds, args))
            start += seconds
        return start

    spans.append(Span("compute", "forward", 0.0, p.forward_s, {}))
    t = run([ct for ct in timed if ct[0].phase == "forward"], p.forward_s)
    backward = [ct for ct in timed if ct[0].phase == "backward"]
    hideable = [ct for ct in backward if ct[0].axis == "dp"]
    rest = [ct for ct in backward if ct[0].axis != "dp"]
    overlaps = layout.overlap and layout.zero_stage < 3
    if not overlaps:
        rest, hideable = hideable + rest, []
    spans.append(Span("compute", "backward", t, t + p.backward_s, {}))
    comm = sum(seconds for _, seconds in hideable)
    end = run(hideable, t + max(0.0, p.backward_s - comm))
    end = run(rest, max(end, t + p.backward_s))
    if end > t + p.backward_s:
        spans.append(Span("compute", "gradient sync wait", t + p.backward_s, end, {}))
    end = run([ct for ct in timed if ct[0].phase == "after"], end)
    spans.append(Span("compute", "optimizer", end, end + p.optimizer_s, {}))
    return spans


def step_length(spans: list[Span]) -> float:
    """The last span's end: the step's seconds."""
    return max(s.end for s in spans)


def chrome_trace(spans: list[Span], ranks: int = 1) -> dict:
    """The Chrome-trace object of trace.Timeline.save, with the same spans on every rank."""
    events = []
    for rank in range(ranks):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for track, tid in TRACKS.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}}
            )
        for span in spans:
            events.append(
                {
                    "name": span.name,
                    "ph": "X",
                    "tid": TRACKS[span.track],
                    "ts": span.start * 1e6,
                    "dur": (span.end - span.start) * 1e6,
                    "args": dict(span.args),
                    "pid": rank,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, spans: list[Span], ranks: int = 1) -> None:
    """Save chrome_trace(spans, ranks) as JSON at path."""
    with open(path, "w") as f:
        json.dump(chrome_trace(spans, ranks), f)


__all__ = ["Span", "chrome_trace", "step_length", "step_spans", "write_trace"]
