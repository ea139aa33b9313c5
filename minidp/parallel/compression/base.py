"""What every gradient compressor shares: error feedback, the exchange's contract, the counts.

A compressor is a DDP communication hook that holds its own state, as PyTorch's
`powerSGD_hook` with its `PowerSGDState`. A user builds one by name, with plain keyword
arguments, and registers it on the DDP that wraps their own model:

    ddp = DistributedDataParallel(model, group)
    ddp.register_comm_hook(PowerSGD(rank=2))      # or TopK(density=0.01), FP16(), ...
    ... loss.backward(); ddp.finish_gradient_sync(); opt.step()

Every compressor takes `algo` (the allreduce algorithm for what is still allreduced), `seed`
(the seed every rank shares) and `warmup` (see below); its `state_dict()` holds its
residuals, round counters and any warm start. The compressors: FP16, BF16 (cast.py),
TopK, RandomK (sparse.py), Sign, SignNoEF, QSGD (quant.py), PowerSGD
(lowrank.py); table.py's `make_compressor` builds one from a spec NAME:PARAM (`--compress`).

`compressor(bucket, group)` leaves in `bucket.data` the sum over the group of every rank's
*compressed* bucket, instead of the exact sum an allreduce gives. One round, on rank w,
for the bucket's flat gradient g:

    Δ_w     = g_w + e_w               e_w: the residual, what earlier rounds did not send
    C(Δ_w)  = what rank w sends       (top-k of Δ_w, its sign, a low-rank approximation...)
    e_w     = Δ_w - C(Δ_w)            error feedback: keep what was dropped, send it later
    bucket  = Σ_w C(Δ_w)              the same bits on every rank

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD")
turns a biased compressor into one whose errors are sent later instead of lost: over the
rounds, everything a rank ever computed reaches the sum. Without it (`error_feedback =
False`: the casts, QSGD, sign-noef) e_w stays zero and only C(Δ_w)'s own bias remains.

`warmup=STEPS` (`--compress-warmup`) sends each bucket's first STEPS rounds uncompressed,
with the allreduce, as PyTorch's PowerSGD hook does (`start_powerSGD_iter`): the first
steps, when the gradient changes fastest and the residual would hold the most, cost full
bytes.

The residuals are training state: they belong to the compressor, one per bucket and rank,
and `state_dict()` carries them (with the round counters and any warm start) so that a
resumed run continues bit for bit. They are keyed by the bucket's index: one compressor per
DDP, as one PowerSGDState per hook in PyTorch.

A subclass implements one method, `exchange(delta, out, key, group, shapes)`: write
Σ_w C(Δ_w) into `out` on every rank and return C(Δ_w), this rank's own contribution as the
others decode it (the base class turns it into the residual and the error counts). Every
rank must leave identical bits in `out`: a sum of gathered contributions is taken in rank
order, and anything random is drawn from a seed every rank shares (or from one the other
ranks never need, for what only this rank decodes).
"""

import math

import numpy as np

from minidp import comm
from minidp.parallel.data_parallel.buckets import Bucket


class Compressor:
    """A communication hook that sends less than the allreduce; see the module docstring.

    `algo`: the allreduce algorithm for the parts that are still allreduced; `seed`: the
    seed every rank shares; `warmup`: rounds of each bucket allreduced uncompressed first.
    A subclass with a parameter names it in `param` (the keyword that `--compress NAME:PARAM`
    sets, e.g. "density"), checks it and keeps it as the attribute of that name before
    calling this `__init__` (which reads it for `spec`)."""

    name = ""  # the --compress name
    param: str | None = None  # the keyword argument `--compress NAME:PARAM` sets
    error_feedback = False

    def __init__(self, *, algo: str = "auto", seed: int = 0, warmup: int = 0):
        if algo != "auto" and algo not in comm.ALGORITHMS["allreduce"]:
            choices = ", ".join(("auto", *comm.ALGORITHMS["allreduce"]))
            raise invalid(self, "algo", algo, f"the allreduce algorithm must be one of {choices}")
        if not is_integer(seed):
            raise invalid(self, "seed", seed, "the seed must be an integer")
        if not is_integer(warmup) or warmup < 0:
            raise invalid(self, "warmup", warmup, "the warmup must be an integer >= 0")
        self.allreduce_algo, self.seed = algo, int(seed)
        self.warmup = int(warmup)  # rounds of each bucket sent uncompressed first
        self.algo = self.spec  # what the timeline labels each bucket with
        self.residuals: dict[int, np.ndarray] = {}  # e_w, by bucket index
        self.rounds: dict[int, int] = {}  # how many times each bucket has been reduced
        self.sent: dict[int, np.ndarray] = {}  # a sparsifier's indices S_w, last round's
        self.error_sq = 0.0  # Σ over rounds of ||Δ_w - C(Δ_w)||², this rank's
        self.input_sq = 0.0  # Σ over rounds of ||Δ_w||²

    @property
    def spec(self) -> str:
        """The --compress value that builds this compressor again."""
        return self.name if self.param is None else f"{self.name}:{getattr(self, self.param):g}"

    def __call__(self, bucket: Bucket, group: comm.Group) -> None:
        """DDP's hook: reduce the bucket in place (its views give the parameters' shapes)."""
        self.reduce(bucket.data, bucket.index, group, [v.shape for v in bucket.views])

    def reduce(self, x: np.ndarray, key: int, group: comm.Group, shapes=None) -> None:
        """Replace the flat gradient x by Σ_w C(x_w + e_w), keeping e_w under `key`.

        `shapes`: the shapes of the tensors laid end to end in x (None: one vector). The
        first `warmup` rounds are the plain allreduce (no residual, nothing counted)."""
        if self.round(key) < self.warmup:
            comm.allreduce(x, out=x, algo=self.allreduce_algo, group=group)
            self.rounds[key] = self.round(key) + 1
            return
        delta = x + self.residuals[key] if key in self.residuals else x.copy()
        mine = self.exchange(delta, x, key, group, shapes or [x.shape])
        self.rounds[key] = self.round(key) + 1
        dropped = delta - mine
        if self.error_feedback:
            self.residuals[key] = dropped
        self.error_sq += float(np.dot(dropped, dropped))
        self.input_sq += float(np.dot(delta, delta))

    def round(self, key: int) -> int:
        """How many rounds bucket `key` has had before this one (seeds what is random)."""
        return self.rounds.get(key, 0)

    def exchange(self, delta, out, key, group, shapes) -> np.ndarray:
        """Write Σ_w C(Δ_w) into out on every rank; return this rank's C(Δ_w)."""
        raise NotImplementedError

    # ---- what the run reports --------------------------------------------------------------
    def relative_error(self) -> float | None:
        """||Δ - C(Δ)|| / ||Δ|| over every round so far, this rank's (None before any)."""
        return math.sqrt(self.error_sq / self.input_sq) if self.input_sq > 0 else None

    def residual_norm(self) -> float | None:
        """||e_w||, all buckets, this rank's now (None: no error feedback)."""
        if not self.error_feedback:
            return None
        return math.sqrt(sum(float(np.dot(e, e)) for e in self.residuals.values()))

    def nbytes(self) -> int:
        """The memory the compressor holds across steps (residuals, and any warm start)."""
        return sum(e.nbytes for e in self.residuals.values())

    # ---- resuming ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "spec": self.spec,
            "residuals": {k: e.copy() for k, e in self.residuals.items()},
            "rounds": dict(self.rounds),
            "error_sq": self.error_sq,
            "input_sq": self.input_sq,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["spec"] != self.spec:
            raise ValueError(f"compressor state is for {state['spec']}, this is {self.spec}")
        self.residuals = {k: e.copy() for k, e in state["residuals"].items()}
        self.rounds = dict(state["rounds"])
        self.error_sq, self.input_sq = state["error_sq"], state["input_sq"]


def is_integer(value) -> bool:
    """An int (NumPy's too), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def invalid(compressor: Compressor, argument: str, value, must: str) -> ValueError:
    """The error for a bad argument, naming it: "PowerSGD(rank=0): the rank must be ..."."""
    return ValueError(f"{type(compressor).__name__}({argument}={value!r}): {must}")


def gather_sum(payloads: list[np.ndarray], decode, out: np.ndarray, group: comm.Group) -> None:
    """out = Σ_r decode(rank r's payloads), summed in rank order: identical bits everywhere.

    For contributions an allreduce cannot add up (packed bits, indices): each rank's
    payloads (every rank passes arrays of the same sizes and dtypes) are allgathered, and
    `decode(*arrays)` turns one rank's back into a vector the size of out. The cost: each
    rank sends its payload to p - 1 others, (p - 1)·m bytes, which grows with p where an
    allreduce's 2(p - 1)/p·n does not: why the gathering compressors pay most at few ranks."""
    gathered = [comm.allgather(a, group=group) for a in payloads]
    out[...] = 0
    for r in range(group.size):
        out += decode(*(g[r] for g in gathered))


def uncompressed_bytes(n_bytes: int, p: int) -> float:
    """What the bandwidth-optimal allreduce (ring, Rabenseifner) sends per rank for n bytes:
    2(p - 1)/p·n, the baseline every compression ratio is measured against."""
    return 2 * (p - 1) / p * n_bytes
