"""Pipeline parallelism: layers cut into stages across ranks, micro-batches flowing through
them (GPipe, 1F1B, interleaved 1F1B, zero bubble).

The schedules, plain data checked before anything runs (no MPI in these):

    actions.py     an Action (stage, micro-batch, kind: F, B, W, SEND_F, RECV_F, ...) and the
                   stage -> rank placement (stage s on rank s % pp)
    schedules.py   the compute-only order of each rank: ScheduleGPipe, Schedule1F1B,
                   ScheduleInterleaved1F1B, ScheduleZeroBubbleH1; SCHEDULES, the one table
    lowering.py    add_send_recv: every send on its sender, its receive on the receiver,
                   in an order that cannot deadlock
    validate.py    validate: F before B before W on every stage, counts, placement
    dry_run.py     dry_run: the lowered lists executed with blocking receives; a deadlock is
                   "not progressing", reported as the grid with the stuck steps marked
    simulate.py    simulate: the timeline in unit time, idle time, bubble fraction against
                   the formulas, peak activations per stage
    diagram.py     the grid (`0F0 0F1 . 0B0 ...`, one row per rank) and the time-diagram PNG

The stage, what runs the actions on a model the user built:

    communications.py  activations forward and gradients back, as autograd ops
    split.py           a user's GPT or MLP cut into parts
    backward_split.py  backward as B (input gradients, sent at once) and W (weights, later)
    stage.py           PipelineStage: forward, backward, backward_input, backward_weight

    executor.py        run_schedule: `schedule.actions()[rank]` (lowered, validated,
                       dry-run) run in order, F, B, W on this rank's stages, each a span on
                       a Timeline; measured_bubble: the bubble from those spans

(Not built yet: the DP x TP x PP mesh.)

This file imports nothing.
"""
