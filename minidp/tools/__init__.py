"""Small tools every layer may use, none of them MPI's: printing from rank 0 and the job's
errors (log.py), the names all parts agree on (names.py), how a vector is cut into one chunk
per rank (chunks.py), pictures (plots.py), memory counted by category (memory.py), and what
this process runs on (info.py, `python -m minidp info`).
"""
