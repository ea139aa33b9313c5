"""Who is still in the job after the last clock: the parameter server's dropped workers.

Under ASP / SSP a server drops a worker that stays silent past the timeout (server.py), and
training goes on without it. A dropped worker may be dead, stopped, or only slow; either
way no collective after training may wait for it (the final memory gather, the model's
broadcast from the servers, the record). So after the last clock:

    servers       the dropped masks of every server, OR-ed (one allreduce among servers)
    first server  ──MEMBERS──► every worker: that mask (messages.py); it waits only for
                  the sends to live workers
    live worker   waits for it (at most `timeout`)
    dropped one   that still runs: a server's reply told it to stop, or, its pull
                  unanswered once the servers are done, it finds MEMBERS waiting
    every live rank: group.members(live ranks), a group made by the live ranks alone
    a dropped worker that still runs (a server's reply told it to stop): a group of its own

With no worker dropped nothing is sent and the group stays as it was. Then, in the record
(`account`): who was dropped and when, and which dropped workers did not end (a dropped
worker that still runs says BYE as it ends; the first server waits `timeout` for it, and
the live ranks' group deadline, MINIDP_TIMEOUT, is lengthened by as much so that the
collective after it does not give up first): the command line ends the job with MPI_Abort
once all is written, since a stopped rank would hold MPI_Finalize forever.
"""

import time

import numpy as np

from minidp import comm
from minidp.parallel.param_server import messages
from minidp.tools.log import print0


def live_group(
    group: comm.Group, ps: comm.Group, n_workers: int, *, server=None, stopped: bool = False,
    server_group: comm.Group | None = None, timeout: float = 60.0,
) -> tuple[comm.Group, list[int]]:  # fmt: skip
    """(the group of the ranks of `group` still in the job, their ranks in `group`).

    Ranks 0..n_workers-1 of `group` (and of `ps`, the same ranks) are workers, the rest
    servers; `server` is this rank's ShardServer (None on a worker); `stopped`: this worker
    was told it was dropped."""
    if stopped:
        return group.members([group.rank]), [group.rank]
    dropped = np.zeros(n_workers, np.int64)
    if server is not None:
        dropped[server.dropped] = 1
        if server_group is not None and server_group.size > 1:
            dropped = comm.allreduce(dropped, op="max", group=server_group)
        if group.rank == n_workers:  # the first server tells every worker
            messages.tell_members(ps, dropped)
    else:
        messages.hear_members(ps, dropped, n_workers, timeout)
    live = [r for r in range(group.size) if r >= n_workers or not dropped[r]]
    if len(live) == group.size:
        return group, live
    return group.members(live), live


NONE_DROPPED = {
    "duplicates_dropped": 0,
    "dropped_workers": [],
    "dropped_at_clock": {},
    "workers_not_ended": [],
}
"""The record's drop keys before `account` has run."""


def account(
    group: comm.Group, ps: comm.Group, n_workers: int, live_ranks: list[int], *, server=None,
    stopped: bool = False, timeout: float = 60.0,
) -> dict:  # fmt: skip
    """Collective over `group` (the live ranks; a stopped worker, alone, says BYE): the
    record's "duplicates_dropped", "dropped_workers", "dropped_at_clock" (the clocks complete
    when a server dropped it) and "workers_not_ended"."""
    W = n_workers
    if stopped:
        messages.say_bye(ps, W, timeout)
    dropped = [w for w in range(W) if w not in live_ranks]
    deadline = group.timeout
    longer = bool(dropped) and deadline is not None  # the first server listens up to
    if longer:  # `timeout` for BYEs before it joins: the others wait as long
        group.timeout = deadline + timeout
    lost = np.full(2 * W + 1, -1, np.int64)  # - | clock each was dropped at | silent?
    if server is not None:
        for w, clock in server.dropped_at.items():
            lost[1 + w] = clock
    if dropped and ps.rank == W and not stopped:  # the first server listens for BYEs
        lost[1 + W + np.array(messages.hear_byes(ps, dropped, timeout), np.int64)] = 1
    lost = comm.allreduce(lost, op="max", group=group)
    if longer:  # every live rank is here: the group's own deadline again
        group.timeout = deadline
    resends = np.array([server.duplicates if server is not None else 0], np.int64)
    lost[0] = comm.allreduce(resends, group=group)[0]  # summed over every server
    at = {str(w): int(lost[1 + w]) for w in range(W) if lost[1 + w] >= 0}
    return {
        "duplicates_dropped": int(lost[0]),
        "dropped_workers": [int(w) for w in at],
        "dropped_at_clock": at,
        "workers_not_ended": [w for w in range(W) if lost[1 + W + w] == 1],
    }


def end_without(workers: list[int]) -> None:
    """The job's record is written, but a dropped parameter-server worker never ended (dead
    or stopped): it would hold MPI_Finalize forever, so world rank 0 ends the job with
    MPI_Abort(0) (exit code 0: the run itself finished; `account`'s "workers_not_ended"
    names them). The other ranks wait in Finalize."""
    from mpi4py import MPI

    from minidp.comm.abort import SPEAK_S, abort_job

    if MPI.COMM_WORLD.Get_rank() == 0:
        print0(
            f"minidp: dropped worker(s) {', '.join(map(str, workers))} never ended; ending the "
            "job (MPI_Abort, code 0) now that everything is written"
        )
        time.sleep(SPEAK_S)  # the launcher forwards the line before the abort
        abort_job("", 0)
