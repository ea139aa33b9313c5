"""Speed trick: a short GIL switch interval while a communication thread runs.

The communication thread (comm_thread.py) and backward take turns holding the GIL for their
Python code. By default a thread that wants the GIL waits up to 5 ms (sys.getswitchinterval)
for the other to let go of it: a convoy that slows an overlapped step (docs/data_parallel.md).
While any communication thread runs, the interval is SWITCH_INTERVAL_S instead, restored
when the last such thread ends. CommThread takes it as its `around` context (DDP's
`quick_gil` trick); the bits do not depend on it (test_ddp_tricks.py), and `bench dp --case
tricks` measures it.
"""

import contextlib
import sys
import threading

SWITCH_INTERVAL_S = 2e-4  # how often the GIL changes hands while a comm thread runs
_handover = {"threads": 0, "saved": 0.0}  # how many threads hold the short interval now
_handover_lock = threading.Lock()


@contextlib.contextmanager
def quick_gil_handover():
    """Shorten sys.setswitchinterval while the block runs; the last block out restores it."""
    with _handover_lock:
        if _handover["threads"] == 0:
            _handover["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_handover["saved"], SWITCH_INTERVAL_S))
        _handover["threads"] += 1
    try:
        yield
    finally:
        with _handover_lock:
            _handover["threads"] -= 1
            if _handover["threads"] == 0:
                sys.setswitchinterval(_handover["saved"])
