"""What the fused ops buy: each op, and each phase of the GPT's step, fused against composed
against PyTorch eager, side by side in one process, with page faults.

    python -m minidp bench fused [--iters 30] [--batch-size 16] [--json FILE]

Part 1, ops: forward and backward of each fused op of fused.py (LayerNorm, LayerNorm then
the MLP's first Linear, GELU, causal self-attention from the packed q/k/v, the embedding) at
the default GPT's shapes (B 16, T 64, C 64, 4 heads, float32), its composed version (the
graph it replaces) and torch's, one call each per round. Part 2, phases: the default GPT's
step (forward with the loss, backward, clip and AdamW) with GPT(fused=True),
GPT(fused=False) and the torch twin (torch_ref.py).
Contenders alternate, the order rotated each round; BLAS and torch at 1 thread. Reported:
median ms, the medians of per-round ratios to torch, and median minor page faults per call;
first, what one page fault costs (`fault_cost_us`).
The allocator setting (allocator.py) is the process's: compare runs with MINIDP_KEEP_MEMORY=0.
"""

import math
import time

import numpy as np

from minidp import Tensor, cross_entropy
from minidp.engine import nn, optim
from minidp.fast import fused
from minidp.fast.fused_attention import causal_self_attention
from minidp.models.gpt import GPT, GPTConfig, composed_attention
from minidp.tools.log import die
from minidp.tools.parser import Parser
from minidp_bench._common import (
    add_round_options,
    environment,
    median,
    median_ratio,
    minor_faults,
    print_table,
    summary,
    write_json,
)

CONTENDERS = ("fused", "composed", "torch")
PHASES = ("forward", "backward", "optimizer")


def op_calls(torch, B: int, T=64, C=64, H=4, V=96) -> dict:
    """{op name: {contender: call()}}, each call one forward and backward."""
    F = torch.nn.functional
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, C), C, C))
    W, bW = (0.02 * rng.standard_normal(s).astype(np.float32) for s in ((C, 4 * C), 4 * C))
    h = rng.standard_normal((B, T, 4 * C)).astype(np.float32)
    qkv = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    table, ids = rng.standard_normal((V, C)).astype(np.float32), rng.integers(0, V, (B, T))
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    plain_ln = nn.LayerNorm(C, fused=False)

    def composed_ln(x, w, b):
        plain_ln.weight, plain_ln.bias = w, b
        return plain_ln(x)

    def torch_attention(qkv):
        q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, dim=2))
        S = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(C // H))
        P = S.masked_fill(torch.from_numpy(future), -math.inf).softmax(dim=-1)
        return (P @ v).transpose(1, 2).reshape(B, T, C)

    def ours(fn, arrays):
        def call():
            inputs = [Tensor(a, requires_grad=True) for a in arrays]
            out = fn(*inputs)
            out.backward(np.ones(out.shape, dtype=np.float32))

        return call

    def theirs(fn, arrays):
        def call():
            inputs = [torch.tensor(a, requires_grad=True) for a in arrays]
            out = fn(*inputs)
            out.backward(torch.ones(out.shape))

        return call

    no_dropout = nn.Dropout(0.0, rng=rng)
    rows = {
        "layer_norm": (
            lambda x, w, b: fused.layer_norm(x, w, b, 1e-5),
            composed_ln,
            lambda x, w, b: F.layer_norm(x, (C,), w, b, eps=1e-5),
            [x, w, b],
        ),
        "layer_norm_linear": (
            lambda x, w, b, W, bW: fused.layer_norm_linear(x, w, b, 1e-5, W, bW),
            lambda x, w, b, W, bW: nn.linear(composed_ln(x, w, b), W, bW),
            lambda x, w, b, W, bW: F.linear(F.layer_norm(x, (C,), w, b, eps=1e-5), W.T, bW),
            [x, w, b, W, bW],
        ),
        "gelu": (fused.gelu, Tensor.gelu, lambda t: F.gelu(t, approximate="tanh"), [h]),
        "attention": (
            lambda t: causal_self_attention(t, H, future),
            lambda t: composed_attention(t, H, future, no_dropout),
            torch_attention,
            [qkv],
        ),
        "embedding": (
            lambda t: fused.embedding(t, ids),
            lambda t: t[ids],
            lambda t: t[torch.from_numpy(ids)],
            [table],
        ),
    }
    return {
        name: {"fused": ours(f, a), "composed": ours(c, a), "torch": theirs(t, a)}
        for name, (f, c, t, a) in rows.items()
    }


def step_phases(torch, B: int) -> dict:
    """{contender: [forward(), backward(loss), optimizer()]} for the default GPT's step."""
    from minidp.models.torch_ref import torch_model

    cfg = GPTConfig()
    rng = np.random.default_rng(0)
    idx, targets = (rng.integers(0, cfg.vocab_size, (B, cfg.block_size)) for _ in range(2))
    phases = {}
    for name in ("fused", "composed"):
        model = GPT(cfg, seed=1, fused=name == "fused")
        opt = optim.AdamW(model.parameters(), lr=1e-4)

        def update(_, model=model, opt=opt):
            optim.clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

        phases[name] = [lambda m=model: cross_entropy(m(idx), targets), Tensor.backward, update]
    net = torch_model(GPT(cfg, seed=1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    t_idx, t_targets = torch.from_numpy(idx).reshape(B, -1), torch.from_numpy(targets)

    def torch_forward():
        logits = net(t_idx)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, cfg.vocab_size), t_targets.reshape(-1)
        )

    def torch_update(_):
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    phases["torch"] = [torch_forward, lambda loss: loss.backward(), torch_update]
    return phases


def rounds(calls: dict, warmup: int, iters: int) -> tuple[dict, dict]:
    """Each contender's parts once per round, the order rotated: ({name: {part: [s]}},
    {name: {part: [faults]}}). A contender is a list of parts: part k gets part k-1's result."""
    names = list(calls)
    times = {n: {} for n in names}
    faults = {n: {} for n in names}
    for i in range(warmup + iters):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            result = None
            for part, call in enumerate(calls[name]):
                f0, t0 = minor_faults(), time.perf_counter()
                result = call() if part == 0 else call(result)
                dt, df = time.perf_counter() - t0, minor_faults() - f0
                if i >= warmup:
                    times[name].setdefault(part, []).append(dt)
                    faults[name].setdefault(part, []).append(df)
    return times, faults


def row(label: str, times: dict, faults: dict, part) -> dict:
    """One table row: each contender's median ms and faults, fused and composed over torch."""
    t = {n: times[n][part] for n in CONTENDERS}
    r = {"what": label}
    for n in CONTENDERS:
        r[f"{n}_ms"] = 1e3 * median(t[n])
        r[f"{n}_faults"] = median(faults[n][part])
    r["fused/torch"] = median_ratio(t["fused"], t["torch"])
    r["composed/torch"] = median_ratio(t["composed"], t["torch"])
    return r


def fault_cost_us(mib: int = 16, rounds: int = 11) -> float:
    """What one minor page fault costs here: writing `mib` MiB into fresh anonymous pages
    (an mmap, 4 KiB pages) against writing them into pages already mapped, per fault."""
    import mmap

    n = mib << 20
    mapped = np.zeros(n // 4, dtype=np.float32)
    fresh, again, faults = [], [], []
    for _ in range(rounds):
        pages = mmap.mmap(-1, n)
        array = np.frombuffer(pages, dtype=np.float32)
        f0, t0 = minor_faults(), time.perf_counter()
        array.fill(1)
        fresh.append(time.perf_counter() - t0)
        faults.append(minor_faults() - f0)
        del array
        pages.close()
        t0 = time.perf_counter()
        mapped.fill(1)
        again.append(time.perf_counter() - t0)
    return 1e6 * (median(fresh) - median(again)) / median(faults)


def main(argv: list[str]) -> int:
    from threadpoolctl import threadpool_limits

    parser = Parser(prog="minidp bench fused", description=summary(__doc__))
    add_round_options(parser, iters=30, warmup=3)
    parser.add_argument("--batch-size", type=int, default=16, help="B (default 16)")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        raise die("bench fused: needs torch (the CPU build)") from None
    torch.set_num_threads(1)
    env = environment()
    print(f"bench fused | B {args.batch_size}, float32, 1 thread | {env['blas']}", flush=True)
    print(f"a minor page fault costs {fault_cost_us():.2f} us here", flush=True)
    rows = []
    with threadpool_limits(limits=1, user_api="blas"):
        for name, calls in op_calls(torch, args.batch_size).items():
            times, faults = rounds({n: [c] for n, c in calls.items()}, args.warmup, args.iters)
            rows.append(row(name, times, faults, 0))
        phases = step_phases(torch, args.batch_size)
        times, faults = rounds(phases, args.warmup, args.iters)
    for name in CONTENDERS:  # the step: its three phases summed, round by round
        times[name]["step"] = [sum(ts) for ts in zip(*times[name].values())]
        faults[name]["step"] = [sum(fs) for fs in zip(*faults[name].values())]
    rows += [row(f"step: {p}", times, faults, k) for k, p in enumerate(PHASES)]
    rows.append(row("step: whole", times, faults, "step"))
    columns = [("what", "s")] + [(f"{n}_ms", ".3f") for n in CONTENDERS]
    columns += [("fused/torch", ".2f"), ("composed/torch", ".2f")]
    columns += [(f"{n}_faults", ",.0f") for n in CONTENDERS]
    print_table(rows, columns)
    write_json(args.json, [{"bench": "fused", **env, **r} for r in rows])
    return 0
