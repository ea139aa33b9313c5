"""ZeRO's sharding as pieces: plain.py (stage 3 in one file, to read first), optimizer.py
(stage 1, ZeroRedundancyOptimizer), flat.py (the flat vector and each rank's chunks),
grads.py (stages 2-3: reduce-scatter when ready), stage3.py (layers gathered around their
use), sharded.py (stages 2 and 3 assembled), fsdp.py (FullyShardedDataParallel), stages.py
(stages 1-3 as one piece, with the paper's Ψ table: what `--strategy zero` drives) and
over_tp.py (ZeRO over a mesh's DP axis on a tensor-parallel model).
"""
