"""The command line, the face over the pieces: `python -m minidp [train|bench|info|...]`.

    commands.py     the subcommands, how a job ends on an error (main), and the table of
                    the tools beside the face it runs by name (cost/, minidp_bench/)
    training/       TrainConfig (each flag with its default and check), the one loop,
                    tasks, checkpoints of a run, preemption
    strategies/     the `--strategy` recipes: pieces of minidp.parallel wrapped around
                    the task's model

The parser every command shares and `python -m minidp plot` are tools (minidp/tools/); the
prediction of a run is the cost model's (minidp/cost/predict.py, predicted.py).
"""
