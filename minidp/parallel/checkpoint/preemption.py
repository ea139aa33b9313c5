"""Preemption: a signal asks a run to stop, and it stops where it can be resumed.

    with Preemption() as preemption:              # SIGTERM, SIGINT (+ "SIGUSR1": extra=)
        preemption.arm(group)                     # from here a signal is only noted
        for step in range(start, steps):
            train_one_step()
            if signum := preemption.agreed():     # collective: did any rank get one?
                checkpoint.save(state, path, group, step=step + 1)
                break
        preemption.disarm("past the last step")   # from here a signal ends the job

Schedulers warn a job before they kill it: SLURM sends SIGTERM (or, with
`--signal=USR1@120`, SIGUSR1 two minutes before the time limit), Kubernetes sends SIGTERM
and waits its grace period, Ctrl-C at `mpiexec` sends SIGINT. MPICH's launcher forwards
these three to every rank (not SIGUSR2 or SIGHUP: they end the launcher). Armed, each
rank's handler only notes the signal; unarmed (nothing to save yet, or no folder to save
to), it ends the job at once: one line from the lowest rank, MPI_Abort, exit code
128 + the signal's number (the shell's convention for "ended by that signal").

Why agree: the launcher forwards a signal to every rank, but each gets it between other
instructions, one still in step 37, another already in step 38. One allreduce (MAX) of a
number at the same point of the same step gives every rank the same answer, so all save
the same step (Megatron-LM's exit-signal handler gathers a flag every iteration in the same
way). Once a signal is noted, more change nothing; a second Ctrl-C at `mpiexec` makes the
launcher itself abort the job. The command line's loop (cli/training/loop.py) arms it over
its saves' group with --save-dir, and `--resume DIR` then goes on bit for bit.
"""

import signal
import sys

import numpy as np

from minidp import comm
from minidp.tools.log import RunStopped, print0

SIGNALS = ("SIGTERM", "SIGINT")  # always; `extra` adds SIGUSR1 (the CLI's --save-signal)


class Preemption:
    """The signal handlers of one run (a `with` block) and the per-step agreement.

    Until `arm(group)` and after `disarm(why)` a signal ends the job at once; armed, it is
    noted, and `agreed()` (collective over the group) tells every rank whether any rank
    got one. `extra`: --save-signal's name, or "none"."""

    def __init__(self, extra: str = "none", why: str = "nothing is saved before the first step"):
        names = SIGNALS + ((extra,) if extra != "none" else ())
        self.signals = [signal.Signals[name] for name in names]
        self.group, self.why, self.noted, self.step, self.previous = None, why, 0, 0, {}

    def __enter__(self) -> "Preemption":
        try:
            for signum in self.signals:
                self.previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread (train() called from a thread): none
            self.__exit__()
        return self

    @property
    def listening(self) -> bool:
        """Whether its handlers are installed (inside the `with`, on the main thread)."""
        return bool(self.previous)

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def arm(self, group: comm.Group) -> None:
        """From now on a signal is noted and agreed on over `group` after a step."""
        self.group = group

    def disarm(self, why: str) -> None:
        """From now on a signal ends the job at once, `why` in its line."""
        self.group, self.why = None, why

    def _handle(self, signum: int, frame) -> None:
        if self.group is None:
            name = signal.Signals(signum).name
            stop_now(f"{name} at step {self.step}, at once ({self.why})", 128 + signum)
        self.noted = self.noted or signum  # the first one: the loop looks after the step

    def agreed(self) -> int:
        """Collective over the armed group: the signal any rank noted (0: none), on every
        rank; 0 at once, no collective, when not armed or not listening."""
        if self.group is None or not self.listening:
            return 0
        mine = np.array([self.noted], dtype=np.int64)
        return int(comm.allreduce(mine, op="max", group=self.group)[0])


def stop_now(message: str, code: int) -> None:
    """End the job from a signal handler: alone, one line and exit `code`; among other
    ranks, MPI_Abort, the lowest rank saying the line (every rank got the same signal)."""
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            from minidp.comm.abort import abort_job

            abort_job(f"minidp: stopped: {message}", code, turn="error")
    print0(f"minidp: stopped: {message}", file=sys.stderr)
    raise SystemExit(code)


class Preempted(RunStopped):
    """Every rank agreed on a signal (checkpoint.Preemption) and stopped after the same
    step, saved."""

    label = "stopped"

    def __init__(self, signum: int, done: int, steps: int, path: str, folder: str):
        name = signal.Signals(signum).name
        super().__init__(
            f"{name} after {done} of {steps} steps; saved {path} (to go on, the same command "
            f"with --resume {folder})"
        )
        self.code = 128 + signum
        self.record = {"stopped_by": name, "steps_done": done, "checkpoint": path}
