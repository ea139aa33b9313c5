"""Gradient compression: DDP communication hooks that send fewer bytes than the allreduce.

    ddp = DistributedDataParallel(model, group)
    ddp.register_comm_hook(TopK(density=0.001))   # each bucket: Σ_w C(g_w + e_w), e_w kept

The classes are the library (base.py says how to use one); this module is the
command line's one translation from `--compress NAME[:PARAM]` (with `--strategy dp`):
`make_compressor("topk:0.001", algo, seed, warmup)` is `TopK(density=0.001, algo=algo,
seed=seed, warmup=warmup)`, None for "none". Bytes per rank per step for a bucket of n
float32 values on p ranks, against the allreduce's 2(p-1)/p·4n (ratios at p = 2 and 4):

    name         PARAM: keyword what goes on the wire                    EF   ratio p=2 / 4
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

Where each idea lives: base.py (error feedback, the residual, the shared
contract), cast.py (fp16, bf16 by hand), sparse.py (top-k, random-k),
quant.py (sign, QSGD), lowrank.py (PowerSGD).

When it pays: compression trades bytes for compute (selecting, packing, decoding) and, for
the allgathered ones, for a cost that grows with p. It helps when the network is the
bottleneck; on ranks that share a machine's memory and cores, as here, it rarely makes a
step faster (Agarwal et al., MLSys 2022, found the same on real clusters).
"""

import inspect

from minidp.parallel.compression.base import Compressor, uncompressed_bytes
from minidp.parallel.compression.cast import BF16, FP16
from minidp.parallel.compression.lowrank import PowerSGD
from minidp.parallel.compression.quant import QSGD, Sign, SignNoEF
from minidp.parallel.compression.sparse import RandomK, TopK

COMPRESSORS: dict[str, type[Compressor]] = {
    c.name: c for c in (FP16, BF16, TopK, RandomK, Sign, SignNoEF, QSGD, PowerSGD)
}
"""The --compress names; each class's `param` names the keyword PARAM sets, and a bare name
means that keyword's default (topk, randomk: density 0.01; qsgd: levels 4; powersgd: rank 2)."""


def default_param(name: str) -> float | None:
    """The value a bare --compress NAME gives its class's parameter: the keyword's default."""
    cls = COMPRESSORS[name]
    return None if cls.param is None else inspect.signature(cls).parameters[cls.param].default


def parse_compress(spec: str) -> tuple[str, float | None]:
    """(name, param) of a spec NAME[:PARAM] (--compress's value): the name checked, the
    number read (an integral one as an int); the class checks the value (make_compressor).
    ValueError, one line naming the spec (the command line puts its flag in front)."""
    name, _, text = spec.partition(":")
    if name != "none" and name not in COMPRESSORS:
        raise ValueError(
            f"{spec!r}: unknown compressor {name!r}; choose from none, " + ", ".join(COMPRESSORS)
        )
    if name == "none" or COMPRESSORS[name].param is None:
        if text:
            raise ValueError(f"{spec!r}: {name} takes no parameter")
        return name, None
    if not text:
        return name, default_param(name)
    try:
        param = float(text)
    except ValueError:
        raise ValueError(f"{spec!r}: {text!r} is not a number") from None
    return name, int(param) if param.is_integer() else param


def make_compressor(
    spec: str, algo: str = "auto", seed: int = 0, warmup: int = 0
) -> Compressor | None:
    """The compressor a --compress value names (None for "none": the plain allreduce), built
    with its class's keywords: "powersgd:2" is PowerSGD(rank=2, algo=..., seed=..., ...).
    `warmup`: rounds of each bucket allreduced uncompressed first (--compress-warmup). A bad
    value is the class's ValueError, with the spec in front."""
    name, param = parse_compress(spec)
    if name == "none":
        return None
    cls = COMPRESSORS[name]
    keywords = {} if cls.param is None else {cls.param: param}
    try:
        return cls(**keywords, algo=algo, seed=seed, warmup=warmup)
    except ValueError as error:
        raise ValueError(f"{spec!r}: {error}") from None


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
    "BF16",
    "COMPRESSORS",
    "FP16",
    "QSGD",
    "Compressor",
    "PowerSGD",
    "RandomK",
    "Sign",
    "SignNoEF",
    "TopK",
    "compression_line",
    "compression_record",
    "make_compressor",
    "parse_compress",
    "uncompressed_bytes",
]
