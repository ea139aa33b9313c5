"""Preemption: a signal asks the run to stop, and it stops where it can be resumed.

Schedulers warn a job before they kill it: SLURM sends SIGTERM (or, with
`--signal=USR1@120`, SIGUSR1 two minutes before the time limit), Kubernetes sends SIGTERM
and waits its grace period, Ctrl-C at `mpiexec` sends SIGINT. MPICH's launcher forwards
each to every rank. What the loop does then:

    with --save-dir      each rank's handler only notes the signal. At the end of every
                         step the ranks agree whether any got one (one allreduce of a
                         number, MAX, on the saves' group); if so, every rank has finished
                         the same step, the loop saves there and ends: one line, exit code
                         128 + the signal's number (the shell's convention for "ended by
                         that signal"). `--resume DIR` goes on bit for bit.
    without              there is nothing to save and nothing to agree on: the handler ends
                         the job at once (one line from the lowest rank, MPI_Abort).

Why agree: the launcher forwards a signal to every rank, but each gets it between other
instructions, one still in step 37, another already in step 38. The allreduce at the same
point of the same step gives every rank the same answer, so all save the same step
(Megatron-LM's exit-signal handler gathers a flag every iteration in the same way). It
costs one small collective a step, paid only when there is a folder to save to.

A second signal while the run finishes its step and saves ends it at once, as above.
`--save-signal SIGUSR1` adds that signal to SIGTERM and SIGINT.
"""

import signal

import numpy as np

from minidp import comm
from minidp.log import RunStopped, print0

SIGNALS = ("SIGTERM", "SIGINT")  # always; --save-signal adds one (training/config.py)


class Preempted(RunStopped):
    """Every rank agreed on a signal and stopped after the same step."""

    label = "stopped"

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.code = 128 + signum


class Preemption:
    """The signal handlers of one training run (a `with` block) and the per-step agreement.

    `group`: the group to agree on (every rank of the run), or None when nothing would be
    saved: then a signal ends the job at once. `extra`: --save-signal's name or "none"."""

    def __init__(self, group: comm.Group | None, extra: str = "none"):
        names = SIGNALS + ((extra,) if extra != "none" else ())
        self.signals = [signal.Signals[name] for name in names]
        self.group, self.got, self.step, self.previous = group, 0, 0, {}

    def __enter__(self) -> "Preemption":
        try:
            for signum in self.signals:
                self.previous[signum] = signal.signal(signum, self._noted)
        except ValueError:  # not the main thread (train() called from a thread): none
            self.__exit__()
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def _noted(self, signum: int, frame) -> None:
        if self.group is not None and not self.got:
            self.got = signum  # the loop looks at the end of the step
            return
        name = signal.Signals(signum).name
        why = "nothing is saved without --save-dir" if self.group is None else "a second signal"
        stop_now(f"{name} at step {self.step}, at once ({why})", 128 + signum)

    def agreed(self) -> int:
        """Collective over the group: the signal any rank got (0: none), on every rank."""
        if self.group is None:
            return 0
        mine = np.array([self.got], dtype=np.int64)
        return int(comm.allreduce(mine, op="max", group=self.group)[0])


def stop_now(message: str, code: int) -> None:
    """End the job from a signal handler: alone, one line and exit `code`; among other
    ranks, MPI_Abort, the lowest rank saying the line (every rank got the same signal)."""
    import sys

    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            from minidp.comm.abort import abort_job

            abort_job(f"minidp: stopped: {message}", code, stagger=True)
    print0(f"minidp: stopped: {message}", file=sys.stderr)
    raise SystemExit(code)
