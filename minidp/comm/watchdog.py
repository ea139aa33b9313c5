"""The watchdog: a deadline for the data exchange of every collective, at no cost to it.

Under the default checks (checks.py) a collective's deadline covers the rendezvous, the
fingerprint exchange; once every rank has shown the same call, the data moves on MPI's
blocking calls, which have no deadline (polling with one cost the main job time:
docs/collectives.md). A rank that freezes *inside* the data exchange (stopped, swapped out,
a hung driver) would then hold every other rank in its `Sendrecv` forever. The watchdog
closes that gap the way NCCL's watchdog and PyTorch's async error handling do:

    main thread, per collective              watchdog thread, one per process
    ---------------------------              --------------------------------
    rendezvous (its own deadline)            every POLL_S seconds, for each group:
    group.exchanging_since = now               since = group.exchanging_since
    data exchange: group.waiting_on = peer     if since is set and now - since > timeout:
      (MPI's blocking calls, GIL released)       print one line: the collective, the
    group.exchanging_since = None                group, this rank, the peer it waits on;
                                                 then MPI_Abort the job (abort.py:
                                                 the lowest rank that saw it speaks)

The hot path pays two attribute writes per collective and one per message (`waiting_on`,
set by p2p.py's blocking calls); the thread wakes POLL_S apart and reads a few attributes.
It cannot know without messages which ranks have finished the call, so the rank names
itself and the peer it waits on: when several ranks are past the deadline at once, the
lowest of them speaks and its abort ends the others (abort.py's turns), so the line is
printed once. A slow rank within the deadline is never taken for a frozen one: the
deadline is `group.timeout` (MINIDP_TIMEOUT) from the start of the data exchange, and the
watchdog fires only past it. Groups whose waits poll against a deadline themselves
(checks off with a timeout: `group.deadline` set) or have none (`group.timeout` None) are
left alone.
"""

import threading
import time
import weakref

from minidp.comm.abort import abort_job

POLL_S = 0.25  # how often the watchdog looks: it fires within POLL_S of the deadline

_groups: "weakref.WeakSet" = weakref.WeakSet()
_started = threading.Lock()
_thread: threading.Thread | None = None


def watch(group) -> None:
    """Watch `group` from now on (group.py calls it for every group it makes); the first
    call starts the thread."""
    global _thread
    with _started:  # the thread copies _groups under the same lock
        _groups.add(group)
        if _thread is None:
            _thread = threading.Thread(target=_run, name="minidp-watchdog", daemon=True)
            _thread.start()


def overdue(group, now: float) -> float | None:
    """Seconds `group`'s data exchange has run at `now` if that is past its deadline, else
    None (read without a lock: a collective that ends meanwhile is caught next time)."""
    since, timeout = group.exchanging_since, group.timeout
    if since is None or timeout is None or group.deadline is not None:
        return None
    return now - since if now - since > timeout else None


def report(group, seconds: float) -> str:
    """The watchdog's one line about `group`'s overdue collective."""
    name, algo, _ = group._doing
    me = group.world_ranks[group.rank]
    peer = group.waiting_on
    if isinstance(peer, int) and 0 <= peer < group.size:
        waits = f"waiting on rank {peer} (world {group.world_ranks[peer]})"
    else:  # MPI's own collective, or a wait on several peers
        others = ", ".join(str(w) for w in group.world_ranks if w != me)
        waits = f"waiting on the group's other ranks (world {others})"
    return (
        f"minidp: watchdog: world rank {me} (rank {group.rank} of the group of world ranks "
        f"{list(group.world_ranks)}): {name} #{group._seq} (algo={algo}) has spent "
        f"{seconds:.1f} s in its data exchange, past the "
        f"{group.timeout:g} s deadline (MINIDP_TIMEOUT), {waits}; aborting the job\n"
    )


def _run() -> None:
    while True:
        time.sleep(POLL_S)
        now = time.perf_counter()
        with _started:  # a WeakSet changed while copied would raise
            groups = list(_groups)
        for group in groups:
            try:
                seconds = overdue(group, now)
                line = None if seconds is None else report(group, seconds)
            except Exception:  # a group freed or changing meanwhile: look again next time
                continue
            if line is not None:
                abort_job(line, 1, turn="timeout")
