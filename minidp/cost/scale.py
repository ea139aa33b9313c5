"""What happens at 1,024 ranks: minidp.cost's formulas walked over ranks, sizes and bandwidths.

    rows = crossover([2, 4, 1024], [1 << 10, 1 << 30], Network(5e-6, 1 / 12.5e9, 1 / 20e9))

Every figure here is a formula of minidp.cost evaluated, never a measurement:

    crossover       every allreduce algorithm's time(p, N) (cost.time); the winner, its
                    margin over the runner-up, and what `auto` picks (cost.resolve)
    compute         6·Ψ·tokens FLOPs per rank per step (forward 2Ψ, backward 4Ψ per token:
                    Kaplan et al. 2020) at a sustained FLOP rate
    compression     each compressor as the collectives it calls (compression/table.py's
                    wire formats) plus its own compute: the bandwidth below which it pays
    zero traffic    the bytes a rank sends per step, exactly cost.sent's (one call over
                    the whole flat vector: the buckets' sums differ by rounding only)
    activations     memory.estimated_bytes's per-layer count, over the layers and the
                    tensor-parallel share a rank holds

A network is step.py's: α (s per message), β (s per byte), γ (s per byte reduced).
Pure Python: no MPI, except that cost.resolve reads comm/auto.py's thresholds.
"""

from typing import NamedTuple

from minidp import cost
from minidp.cost.calls import compressor_calls, gpt_shapes, powersgd_calls
from minidp.cost.step import Compute, Layout, Network, memory, predict


def seconds(net: Network, collective: str, algo: str, p: int, n: int, itemsize: int) -> float:
    """cost.time with the network's α, β, γ, δ."""
    return cost.time(collective, algo, p, n, itemsize, **net.terms())


ALLREDUCE = tuple(
    name for name, model in cost.COSTS["allreduce"].items() if name not in ("shm", "mpi")
)
"""The allreduce algorithms with an α-β-γ formula: every one minidp writes by hand."""


# ---- which allreduce wins -------------------------------------------------------------------
def crossover(groups, sizes, net: Network, itemsize: int = 4) -> list[dict]:
    """One row per (p, bytes): each algorithm's seconds, the winner, its margin (runner-up's
    time / winner's), auto's choice and how much slower than the winner it is (1 = matches)."""
    rows = []
    for p in groups:
        for nbytes in sizes:
            n = max(nbytes // itemsize, 1)
            times = {a: seconds(net, "allreduce", a, p, n, itemsize) for a in ALLREDUCE}
            ranked = sorted(times, key=times.get)
            best, second = ranked[0], ranked[1]
            auto = cost.resolve("allreduce", "auto", p, n * itemsize)
            rows.append(
                {
                    "p": p,
                    "bytes": n * itemsize,
                    "times": times,
                    "winner": best,
                    "margin": times[second] / times[best] if times[best] else 1.0,
                    "auto": auto,
                    "auto_slowdown": times[auto] / times[best] if times[best] else 1.0,
                }
            )
    return rows


# ---- the model and its compute ------------------------------------------------------------
class GPT(NamedTuple):
    """minidp's GPT (nn.GPT: untied head) at a size: L blocks of width C, H heads, V, T."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int

    @property
    def params(self) -> int:
        """Ψ = L(12C² + 13C) + (2V + T + 2)C: calls.gpt_shapes's tensors, summed."""
        L, C = self.layers, self.hidden
        return L * (12 * C * C + 13 * C) + (2 * self.vocab + self.seq + 2) * C

    def shapes(self, tp: int = 1):
        return gpt_shapes(self.layers, self.hidden, self.vocab, self.seq, tp)


def gpt_of(params: float, layers: int = 24, vocab: int = 50257, seq: int = 2048) -> GPT:
    """The GPT of `layers` blocks, width a multiple of 128 (heads of 128 channels), whose Ψ
    is nearest `params`."""
    widths = range(128, 1 << 17, 128)
    C = min(widths, key=lambda c: abs(GPT(layers, c, c // 128, vocab, seq).params - params))
    return GPT(layers, C, C // 128, vocab, seq)


def flops_compute(model: GPT, seqs: int, flops: float, memory_bytes_per_s: float) -> Compute:
    """step.Compute of one process on `seqs` sequences, from FLOPs: forward 2Ψ, backward
    4Ψ per token (6Ψ a token: Kaplan et al. 2020) at `flops` per second; AdamW reads Ψ's
    weights, gradients and two moments and writes three of them: 28 bytes a parameter at
    fp32, at `memory_bytes_per_s`."""
    tokens, psi = seqs * model.seq, model.params
    return Compute(
        forward_s=2 * psi * tokens / flops,
        backward_s=4 * psi * tokens / flops,
        optimizer_s=28 * psi / memory_bytes_per_s,
        examples=seqs,
        params=psi,
    )


def scaling(ranks, model: GPT, compute: Compute, net: Network, *, bucket_mb: float) -> list:
    """Data parallelism's efficiency against ranks, weak scaling (compute.examples sequences
    per rank): step.predict's step without and with overlap, with auto's algorithm, and with
    overlap and the algorithm whose whole step is fastest ("best": every algorithm and auto
    tried on the step, since its buckets are not all of one size and auto picks per
    bucket, so best is never slower than auto); efficiency = compute / step."""

    def step_of(p: int, overlap: bool, algo: str):
        layout = Layout("dp", dp=p, overlap=overlap, algo=algo, bucket_mb=bucket_mb, shm=False)
        return predict(layout, model.shapes(), compute, net, batch_size=compute.examples * p)

    rows = []
    for p in ranks:
        row = {"p": p}
        algos = ("auto", *ALLREDUCE) if p > 1 else ("auto",)  # one rank: nothing to send
        tried = {algo: step_of(p, True, algo) for algo in algos}
        row["best_algo"] = best = min(tried, key=lambda algo: tried[algo].step_s)
        for key, overlap, algo in (
            ("serial", False, "auto"),
            ("overlap", True, "auto"),
            ("best", True, best),
        ):
            pred = step_of(p, overlap, algo)
            row[key] = pred.step_s
            row[key + "_exposed"] = pred.exposed_comm_s
            row[key + "_efficiency"] = pred.compute_s / pred.step_s
        row["compute"] = pred.compute_s
        rows.append(row)
    return rows


# ---- compression: each compressor as the collectives it calls (calls.compressor_calls) ---------
COMPRESSORS = (
    ("fp16", None),
    ("topk", 0.01),
    ("topk", 0.001),
    ("randomk", 0.01),
    ("sign", None),
    ("qsgd", 4),
    ("powersgd", 2),
)
"""The compressors the breakeven table walks (PowerSGD's bytes follow the matrices' shapes:
pass `dims`)."""


def exchange_terms(name: str, param, n: int, p: int, net: Network, dims=()) -> tuple:
    """(a, b): the exchange takes a + b·β seconds (the formulas are linear in β); `dims`:
    the shapes of the n values' tensors, which PowerSGD factors (one bucket of them all)."""
    if name != "powersgd":
        calls = compressor_calls(name, param, n, p)
    elif dims:
        calls = powersgd_calls(dims, param)
    else:
        raise ValueError("powersgd's exchange needs the tensors' shapes (dims)")
    zero, one = net._replace(beta=0.0), net._replace(beta=1.0)
    a = sum(seconds(zero, c, "auto", p, m, s) for c, m, s in calls)
    return a, sum(seconds(one, c, "auto", p, m, s) for c, m, s in calls) - a


def breakeven(name, param, n: int, p: int, net, compress_bytes_per_s: float, backward=0.0, dims=()):
    """The bandwidth (bytes/s) below which compressing n float32 values per step beats the
    plain allreduce on p ranks, in the step: the exchange hides behind `backward` seconds
    (step.py's overlap: exposed = max(0, exchange - backward); 0: no overlap), and the
    compressor's own compute, encoding the n values and decoding the bytes it receives at
    compress_bytes_per_s, adds to the step (it runs where backward runs). 0: it never pays
    (it sends no fewer bytes, or its compute costs more than it saves even at 0.8 Mb/s);
    inf: it pays at any bandwidth. PowerSGD (`dims`: the shapes) is priced the same way,
    its two small matmuls per matrix taken at the same rate as the others' encoding."""
    a0, b0 = exchange_terms("none", None, n, p, net)
    a1, b1 = exchange_terms(name, param, n, p, net, dims)  # b1: the bytes on its critical path
    work = (4 * n + b1) / compress_bytes_per_s

    def gain(bandwidth: float) -> float:  # seconds saved a step; grows once plain is exposed
        plain = max(0.0, a0 + b0 / bandwidth - backward)
        return plain - work - max(0.0, a1 + b1 / bandwidth - backward)

    low, high = 1e5, 1e15  # 0.8 Mb/s .. 8 Pb/s
    if b1 >= b0 or gain(low) <= 0:
        bandwidth = 0.0
    elif gain(high) > 0:
        bandwidth = float("inf")
    else:
        for _ in range(100):  # bisection in log bandwidth: gain falls as bandwidth rises
            middle = (low * high) ** 0.5
            low, high = (middle, high) if gain(middle) > 0 else (low, middle)
        bandwidth = low
    return {
        "compress": f"{name}:{param}" if param else name,
        "p": p,
        "ratio": b0 / b1 if b1 else float("inf"),
        "work_s": work,
        "bandwidth": bandwidth,
    }


# ---- ZeRO's traffic, exact ------------------------------------------------------------------
ZERO_CALLS = {  # parallel/zero/stages.py: what each stage sends per step over the flat vector
    "dp": (("allreduce", "ring"),),
    "zero-1": (("reduce_scatter", "ring"), ("allgather", "ring")),
    "zero-2": (("reduce_scatter", "ring"), ("allgather", "ring")),
    "zero-3": (("allgather", "ring"), ("allgather", "ring"), ("reduce_scatter", "ring")),
}


def zero_traffic(p: int, params: int, itemsize: int = 4, rank: int = 0) -> list[dict]:
    """Bytes and messages rank `rank` sends per step, DP and ZeRO stages 1-3 (cost.sent);
    stage 3 gathers the parameters twice (forward, backward): 1.5x DP's bytes."""
    rows = []
    for scheme, calls in ZERO_CALLS.items():
        sent = [cost.sent(c, a, p, rank, params, itemsize) for c, a in calls]
        rows.append(
            {
                "scheme": scheme,
                "p": p,
                "messages": sum(s.messages for s in sent),
                "bytes": sum(s.bytes for s in sent),
            }
        )
    base = rows[0]["bytes"]
    for row in rows:
        row["vs_dp"] = row["bytes"] / base if base else 1.0
    return rows


# ---- memory per rank ------------------------------------------------------------------------
def activations(model: GPT, seqs: int, tp: int = 1, pp: int = 1, itemsize: int = 4) -> int:
    """Bytes one forward of `seqs` sequences keeps for backward: memory.estimated_bytes's
    per-layer count, 3·B·H·T² (scores, masked, softmax) + 20·B·T·C, over the layers a rank
    holds; tensor parallelism splits the heads and the MLP, so it divides both (the layer
    norms' inputs stay whole: a lower bound)."""
    B, H, T, C = seqs, model.heads, model.seq, model.hidden
    per_layer = 3 * B * H * T * T + 20 * B * T * C
    return int(per_layer * model.layers / pp / tp * itemsize)


def memory_table(
    model: GPT, world: int, seqs: int, tp: int, pp: int, itemsize=4, bucket_mb: float = 25.0
) -> list:
    """Bytes per rank of each scheme on `world` ranks (step.memory; pp: a stage of 1/pp of
    the layers, its share of the embeddings, holding pp micro-batches' activations as
    1F1B's first stage does). seqs: sequences per data-parallel rank (one micro-batch
    each for pp)."""
    shapes, rows = model.shapes(), []
    acts = activations(model, seqs, itemsize=itemsize)
    for name, stage in (("dp", 0), ("zero-1", 1), ("zero-2", 2), ("zero-3", 3)):
        layout = Layout("zero" if stage else "dp", dp=world, zero_stage=stage, bucket_mb=bucket_mb)
        rows.append(
            {"scheme": name, "layout": f"dp {world}", **memory(layout, shapes, itemsize, acts)}
        )
    tp_shapes = model.shapes(tp)
    tp_acts = activations(model, seqs, tp, itemsize=itemsize)
    rows.append(
        {
            "scheme": "tp",
            "layout": f"tp {tp} (dp 1)",
            **memory(Layout("tp", tp=tp), tp_shapes, itemsize, tp_acts),
        }
    )
    stage = shapes._replace(params=[sum(shapes.params) // pp])  # one segment: 1/pp
    pp_acts = activations(model, seqs * pp, pp=pp, itemsize=itemsize)
    rows.append(
        {
            "scheme": "pp",
            "layout": f"pp {pp} (dp 1)",
            **memory(Layout("dp"), stage, itemsize, pp_acts),
        }
    )
    dp = max(world // (tp * pp), 1)
    hybrid = tp_shapes._replace(params=[sum(tp_shapes.params) // pp])
    acts = activations(model, seqs * pp, tp, pp, itemsize)
    rows.append(
        {
            "scheme": "hybrid zero-1",
            "layout": f"dp {dp} x tp {tp} x pp {pp}",
            **memory(
                Layout("zero", dp=dp, tp=tp, zero_stage=1, bucket_mb=bucket_mb),
                hybrid,
                itemsize,
                acts,
            ),
        }
    )
    for row in rows:
        row["total"] = sum(
            row[k] for k in ("parameters", "gradients", "optimizer", "activations_peak")
        )
    return rows


__all__ = [
    "ALLREDUCE",
    "COMPRESSORS",
    "GPT",
    "activations",
    "breakeven",
    "compressor_calls",
    "crossover",
    "exchange_terms",
    "flops_compute",
    "gpt_of",
    "memory_table",
    "scaling",
    "seconds",
    "zero_traffic",
]
