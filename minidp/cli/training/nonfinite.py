"""A step whose loss or gradient is not finite: end the run naming it, or skip it.

The step skeleton (parallel/step.py) finds a non-finite global loss or global gradient
norm alike on every rank and then steps no optimizer (`StepResult.stepped` False). Here the
loop decides what follows, every rank alike:

    without --skip-nonfinite    TrainingDiverged naming the step and the rank(s) where it
                                appeared (every rank exits with one line, code 1)
    with --skip-nonfinite       every rank goes on with the parameters as they were; the
                                step is logged and counted (the final record's
                                "skipped_steps")

Where it appeared: the rare path spends one small allgather on each rank's own loss. A
rank whose own loss is not finite is named; when every own loss is finite, the NaN arose in
a gradient, and after the gradient sync every rank holds it, so the message says that.

The parameter server is the exception: its ranks are never at one step together, so no
collective can decide. Every party learns the global loss from the servers, and the first
server, which computes it, ends the job with the one line (DivergedOutOfStep).
"""

import numpy as np

from minidp import comm
from minidp.tools.log import JobError, RunStopped


class TrainingDiverged(RunStopped):
    """The loss or the gradient norm became NaN or infinite (found alike on every rank)."""


class DivergedOutOfStep(JobError):
    """The same under the parameter server, whose ranks do not step together: no rank may
    wait for the others at a step. The first server (which computes every clock's global
    loss) says it and ends the job (comm/abort.py: end_job); a worker, which learns the loss from a
    server's reply, stays silent (`reported_elsewhere`)."""


SKIPS_IN_A_ROW = 10  # then the run is stuck, not unlucky: it ends as without the flag


def nonfinite_step(
    step: int, result, config, group: comm.Group, say, log, skipped: list[int] = ()
) -> int:
    """Collective over `group` (every rank calls it at the same step): raise TrainingDiverged,
    or with --skip-nonfinite log the skipped step and return it. `skipped`: the steps
    skipped so far; the SKIPS_IN_A_ROW-th skip in a row ends the run too."""
    finite_loss = np.isfinite(result.loss)
    what = "the gradient norm is not finite" if finite_loss else f"loss is {result.loss}"
    if config.strategy == "ps":  # its ranks do not step in lockstep: no collective here
        first_server = group.size - config.servers
        raise DivergedOutOfStep(
            f"{what} at step {step} (the global loss of clock {step}, found by the servers): "
            f"try a lower --lr (now {config.lr}) or --dtype float64",
            reported_elsewhere=group.rank != first_server,
        )
    mine = np.array([0 if np.isfinite(result.local_loss) else 1], np.int64)
    ranks = np.flatnonzero(comm.allgather(mine, group=group)).tolist()
    named = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    where = (
        f" (it appeared on {named}: a non-finite loss of its own)"
        if ranks
        else " (every rank's own loss was finite: it appeared in a gradient)"
    )
    in_a_row = list(range(step - SKIPS_IN_A_ROW + 1, step))
    if config.skip_nonfinite and list(skipped[-len(in_a_row) :]) == in_a_row:
        raise TrainingDiverged(
            f"{what} at step {step}{where}, the {SKIPS_IN_A_ROW}th step skipped in a row: "
            "training is not recovering; try a lower --lr or --dtype float64"
        )
    if not config.skip_nonfinite:
        raise TrainingDiverged(
            f"{what} at step {step}{where}: try a lower --lr (now {config.lr}), "
            "--dtype float64, or --skip-nonfinite"
        )
    message = f"step {step}: {what}{where}; every rank skipped it (--skip-nonfinite)"
    say(message)
    log.write(message)
    return step
