"""The command line, the face over the pieces: `python -m minidp [train|bench|info|...]`.

commands.py     the subcommands and how a job ends on an error (main)
parser.py       the one argument parser the commands and benchmarks share
training/       TrainConfig (each flag with its default and check), the one loop,
                tasks, checkpoints of a run, preemption, the prediction of a run
strategies/     the `--strategy` recipes: pieces of minidp.parallel wrapped around
                the task's model
loss_curves.py  `python -m minidp plot`; torch_train.py: the same loop in PyTorch
"""
