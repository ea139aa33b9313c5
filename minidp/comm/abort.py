"""Ending the whole job from one rank: its one line on the terminal, then MPI_Abort.

A rank that finds a fault the others cannot see (a peer that never answered, an error of
its own, a signal) must end the job, or the other ranks would wait for it forever. Three
things make that end readable and clean:

    once      several ranks often find one fault: every neighbour of a frozen rank times
              out, every rank may run into the same bug. Each waits its turn before it
              speaks, and the first abort ends the others before theirs:

                  turn         rank r speaks after         for
                  "now"        0 s                         a fault only this rank reports
                  "error"      0 s on rank 0, else         an error of its own (a bug:
                               STAGGER_S                   rank 0's abort ends the rest)
                  "timeout"    min(r, 4) x STAGGER_S       a peer never heard from

              An error speaks within STAGGER_S of happening, so the line gives the real
              cause, not a neighbour's "heard nothing from rank 3", unless that
              neighbour's deadline (MINIDP_TIMEOUT from when it began to wait) falls in
              that second. Among timeouts the lowest rank speaks first (ranks from 4 up
              share a turn: two of them alone print two lines).
    alone     MPICH prints its own line for MPI_Abort ("Abort(1) on node 0 ..."): ours
              already said why, so stderr goes to /dev/null just before the abort.
    clean     MPICH keeps its shared-memory segment in /dev/shm (mpich_shm_*) until
              MPI_Finalize, which an aborted job never reaches: each rank removes the
              names of the segments it maps itself (this job's, no one else's) before it
              aborts. Processes that map them keep their memory; only the names go.

A job killed from outside (SIGKILL, a launcher that tears it down) runs none of this: its
segment stays behind (docs/faults.md says how to find such leftovers).
"""

import os
import sys
import time

from minidp.tools.log import JobError, die, world_rank
from minidp.tools.memory import OutOfMemory

STAGGER_S = 1.0  # between two ranks' turns to speak: more than SPEAK_S and the abort's spread
SPEAK_S = 0.5  # after the line, before the abort: the launcher forwards the line first
SHM_PREFIX = "/dev/shm/mpich_shm_"


def own_shared_memory() -> list[str]:
    """The /dev/shm files of MPICH's that this process maps (its job's segment)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if SHM_PREFIX in line}
    except OSError:  # no /proc (not Linux): nothing to find
        return []
    return sorted(p for p in paths if p.startswith(SHM_PREFIX))


def remove_own_shared_memory() -> None:
    for path in own_shared_memory():
        try:
            os.unlink(path)
        except OSError:  # another rank of the job removed it first
            pass


def abort_job(line: str = "", code: int = 1, *, turn: str = "now") -> None:
    """Print `line` (one line, "" for none) on stderr once this rank's `turn` has come
    ("now", "error" or "timeout": see above), and end every rank of the job with
    MPI_Abort(code)."""
    from mpi4py import MPI

    rank = world_rank()
    time.sleep({"now": 0, "error": min(rank, 1), "timeout": min(rank, 4)}[turn] * STAGGER_S)
    sys.stderr.flush()
    if line:
        try:
            os.write(2, (line.rstrip("\n") + "\n").encode())  # one write: never interleaved
        except OSError:  # no one reads stderr any more: end all the same
            pass
        time.sleep(SPEAK_S)
    remove_own_shared_memory()
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)  # MPICH's "Abort(1) on node ..." line after ours
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # Abort may return before the launcher ends us: nothing more runs


def end_job(error: BaseException) -> None:
    """An error on one rank ends the whole job at once (MPI_Abort), its cause printed once:
    the command line's end, and a script's (`except BaseException as e: end_job(e)`).

    Without this the other ranks would wait forever in their next collective. The cause is
    one line for a JobError (its message says all), a MemoryError (the allocation that
    failed) and a CollectiveTimeout (it names the peer never heard from), else the rank's
    traceback. A rank whose error another rank reports (`reported_elsewhere`) prints
    nothing and gives that rank time to abort first.
    What several ranks may find at once (a bug every rank runs into, a timeout) is said
    once, by the rank whose turn comes first (comm/abort.py). Alone (no other rank to stop)
    it returns, and a one-line error becomes one line, exit code 1."""
    from minidp.comm.errors import CollectiveTimeout

    timeout = isinstance(error, CollectiveTimeout)
    if isinstance(error, MemoryError):  # NumPy's "Unable to allocate 7.5 GiB for an array"
        error = OutOfMemory(f"out of memory: {error or 'an allocation failed'}")
    if not _other_ranks_running():
        if timeout or isinstance(error, JobError):
            raise die(str(error), code=1) from None
        return
    import traceback

    if getattr(error, "reported_elsewhere", False):
        time.sleep(10.0)  # the rank that found it speaks and aborts: that ends us
        abort_job("", 1)
    elif timeout:  # every neighbour of the silent rank finds it
        abort_job(f"minidp: error: {error}", 1, turn="timeout")
    elif isinstance(error, JobError):  # found by the one rank that reports it (memory:
        abort_job(f"minidp: error: {error}", 1, turn=error.turn)  # maybe by all at once)
    else:  # a bug: maybe on every rank
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        report = f"minidp: rank {rank} failed; aborting all ranks. Root cause:\n"
        abort_job(report + traceback.format_exc(), 1, turn="error")


def _other_ranks_running() -> bool:
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI

    return MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1
