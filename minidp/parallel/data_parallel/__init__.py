"""Data parallelism, plain first: plain.py (one allreduce per parameter after backward), then
ddp.py (DistributedDataParallel: buckets.py, overlap on comm_thread.py, no_sync, hooks,
unused_params.py). Its speed tricks, each a module plugged in through ddp.TRICKS and
bit-equal to the plain path: shm_arena.py, coalesce.py, gil.py, host_stage.py.
"""
