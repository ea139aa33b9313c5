"""The run-time face: every flag (config.py, checked in config_checks.py and
scheme_checks.py), the tasks a run trains (tasks.py: the model and its data from one seed),
the one training loop (loop.py) and what it measures per step (meter.py). The strategies it
drives are minidp.cli.strategies.

Nothing here is imported by the library below it (the engine, comm, the parallel pieces).
"""
