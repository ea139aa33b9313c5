"""Gradient compression: DDP communication hooks that send fewer bytes than the allreduce.

    ddp = DistributedDataParallel(model)
    compressor = make_compressor("topk:0.001", algo="auto", seed=0)   # None for "none"
    ddp.register_comm_hook(compressor)     # each bucket: Σ_w C(g_w + e_w), e_w kept

`--compress NAME[:PARAM]` with `--strategy dp`. Bytes per rank per step for a bucket of n
float32 values on p ranks, against the allreduce's 2(p-1)/p·4n (ratios at p = 2 and 4):

    name         PARAM          what goes on the wire                    EF   ratio p=2 / 4
    none         -              the allreduce itself                     -    1 / 1
    fp16, bf16   -              16-bit values, alltoall + allgather      no   2 / 2
    topk         density (0.01) k = density·n (index, value) pairs,      yes  1/(2d) / 1/(4d)
                                allgathered
    randomk      density (0.01) k values at shared random indices,       yes  1/d / 1/d
                                allreduced
    sign         -              1 bit per value + a scale, allgathered   yes  32 / 16
    sign-noef    -              the same, without error feedback         no   32 / 16
    qsgd         levels S (4)   b = bit_length(2S) bits per value,       no   32/b / 16/b
                                allgathered
    powersgd     rank r (2)     P and Q factors, allreduced              yes  nm / r(n+m)

Where each idea lives: compress_base.py (error feedback, the residual, the shared
contract), compress_cast.py (fp16, bf16 by hand), compress_sparse.py (top-k, random-k),
compress_quant.py (sign, QSGD), compress_lowrank.py (PowerSGD).

When it pays: compression trades bytes for compute (selecting, packing, decoding) and, for
the allgathered ones, for a cost that grows with p. It helps when the network is the
bottleneck; on ranks that share a machine's memory and cores, as here, it rarely makes a
step faster (Agarwal et al., MLSys 2022, found the same on real clusters).
"""

import math

from minidp.parallel.compress_base import Compressor, uncompressed_bytes
from minidp.parallel.compress_cast import BF16, FP16
from minidp.parallel.compress_lowrank import PowerSGD
from minidp.parallel.compress_quant import QSGD, Sign, SignNoEF
from minidp.parallel.compress_sparse import RandomK, TopK

COMPRESSORS: dict[str, type[Compressor]] = {
    c.name: c for c in (FP16, BF16, TopK, RandomK, Sign, SignNoEF, QSGD, PowerSGD)
}
DEFAULT_PARAM = {"topk": 0.01, "randomk": 0.01, "qsgd": 4, "powersgd": 2}
"""The PARAM a bare name means; the other compressors take none."""


def parse_compress(spec: str) -> tuple[str, float | None]:
    """(name, param) of a --compress value; ValueError, one line, for one that cannot work."""
    name, _, text = spec.partition(":")
    if name != "none" and name not in COMPRESSORS:
        raise ValueError(
            f"--compress {spec!r}: unknown compressor {name!r}; choose from none, "
            + ", ".join(COMPRESSORS)
        )
    if name not in DEFAULT_PARAM:
        if text:
            raise ValueError(f"--compress {spec!r}: {name} takes no parameter")
        return name, None
    try:
        param = float(text) if text else float(DEFAULT_PARAM[name])
    except ValueError:
        raise ValueError(f"--compress {spec!r}: {text!r} is not a number") from None
    if name in ("topk", "randomk") and not 0 < param <= 1:
        raise ValueError(f"--compress {spec!r}: the density must be in (0, 1], got {param:g}")
    if name in ("powersgd", "qsgd"):
        what = "the rank" if name == "powersgd" else "the number of levels S"
        top = 127 if name == "qsgd" else math.inf  # qsgd's codes 0..2S fit a byte
        if param != int(param) or not 1 <= param <= top:
            bound = "an integer >= 1" if top == math.inf else f"an integer in [1, {top}]"
            raise ValueError(f"--compress {spec!r}: {what} must be {bound}, got {param:g}")
        param = int(param)
    return name, param


def make_compressor(
    spec: str, algo: str = "auto", seed: int = 0, warmup: int = 0
) -> Compressor | None:
    """The compressor a --compress value names (None for "none": the plain allreduce);
    `warmup`: rounds of each bucket allreduced uncompressed first (--compress-warmup)."""
    name, param = parse_compress(spec)
    if name == "none":
        return None
    return COMPRESSORS[name](param, algo=algo, seed=seed, warmup=warmup)


def compression_record(spec: str, compressor, buckets, sent: int, steps: int, p: int) -> dict:
    """The final record's compression fields: `sent` bytes this rank sent for gradients in
    `steps` steps, against what the allreduce of the same buckets sends (uncompressed_bytes).

    grad_bytes_sent and grad_bytes_uncompressed are per rank per step; compression_ratio is
    their quotient; compression_error the relative ||Δ - C(Δ)|| / ||Δ|| over the run and
    residual_norm ||e|| at the end, both this rank's (None where they do not apply)."""
    per_step = sent / steps if steps else 0.0
    baseline = sum(uncompressed_bytes(b.data.nbytes, p) for b in buckets)
    return {
        "compress": spec,
        "grad_bytes_sent": per_step,
        "grad_bytes_uncompressed": baseline,
        "compression_ratio": baseline / per_step if per_step else None,
        "compression_error": compressor.relative_error() if compressor else 0.0,
        "residual_norm": compressor.residual_norm() if compressor else None,
    }


def compression_line(record: dict) -> str:
    """The closing line that says what compression did, from compression_record's fields."""

    def show(value, spec):
        return "-" if value is None else format(value, spec)

    return (
        f"compress {record['compress']}: {record['grad_bytes_sent']:,.0f} gradient bytes "
        f"sent per rank per step, against {record['grad_bytes_uncompressed']:,.0f} "
        f"uncompressed: ratio {show(record['compression_ratio'], '.1f')}x | relative error "
        f"{show(record['compression_error'], '.3g')} | residual norm "
        f"{show(record['residual_norm'], '.3g')}"
    )


__all__ = [
    "COMPRESSORS",
    "Compressor",
    "compression_line",
    "compression_record",
    "make_compressor",
    "parse_compress",
    "uncompressed_bytes",
]
