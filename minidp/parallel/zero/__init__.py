"""ZeRO's sharding as pieces (the paper's Ψ table: minidp/cli/strategies/zero.py): optimizer.py
(stage 1, ZeroRedundancyOptimizer), flat.py (the flat vector and each rank's chunks),
grads.py (stages 2-3: reduce-scatter when ready), stage3.py (layers gathered around their
use), sharded.py (stages 2 and 3 assembled), fsdp.py (FullyShardedDataParallel).
"""
