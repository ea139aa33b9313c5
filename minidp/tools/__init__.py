"""Small tools for the layers above the engine (models, comm, the pieces, the face), none
of them on MPI at import (info.py asks MPI only when its command runs): printing from rank 0
and the job's errors (log.py), the names all parts agree on (names.py), how a vector is cut
into one chunk per rank (chunks.py), pictures (plots.py), memory counted by category
(memory.py), what this process runs on and one BLAS thread per rank (info.py, `python -m
minidp info`), the argument parser every command and benchmark shares (parser.py), JSON-lines
records a crash never cuts (records.py), a loop's logging window over running totals
(meter.py), and loss curves of finished runs (loss_curves.py, `python -m minidp plot`).
"""
