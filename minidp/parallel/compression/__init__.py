"""Gradient compression as DDP communication hooks: base.py (Compressor, error feedback, the
exchange), cast.py (fp16, bf16), sparse.py (top-k, random-k), quant.py (sign, QSGD),
lowrank.py (PowerSGD), table.py (the --compress names). Where else to compress:
update.py (each rank's optimizer step) and velocity.py (DGC's momentum correction).
"""
