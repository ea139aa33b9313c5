"""The run-time face: every flag (config.py, checked in config_checks.py and
scheme_checks.py), the one training loop (loop.py: the task it trains is models/tasks.py's,
what it measures per step tools/meter.py's), checkpoints of a run (resume.py). The
strategies it drives are minidp.cli.strategies.

Nothing here is imported by the library below it (the engine, comm, the parallel pieces).
"""
