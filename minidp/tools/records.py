"""JSON-lines records (the training loop's `--json FILE`), written so that a crash never
loses them.

    records = Records(path)        # FILE replaced at once by an empty file (atomically)
    records.write({"step": 0, ...}) # one whole line, written and flushed as it is made
    records.write(final)           # the final record is the last line
    records.close()

What a reader of FILE can count on, whatever happened to the run:
- it belongs to this run from the start: an empty file is written under a temporary name in
  the same directory and renamed over FILE (rename is atomic on POSIX), so a run killed
  early leaves an empty file, never the previous run's records looking current;
- every line is whole JSON: each record is one `os.write` of its line; a write that fails
  midway (a full disk) is cut back to the last whole line before the error is raised;
- what was logged before a crash is there: nothing is held in memory until the end.

Written by one rank (the loop's rank 0); `Records(None)` writes nothing. A resumed run
(`--resume`) keeps the step records FILE holds from before its checkpoint's step.
"""

import json
import os

from minidp.tools.memory import CATEGORIES


class Records:
    """One JSON-lines file, replaced at start and appended to a whole line at a time."""

    def __init__(self, path: str | None, keep_before: int = 0):
        """`keep_before`: a resumed run's first step; FILE's step records before it (the
        run that saved the checkpoint wrote them) are kept, at the top of the new file."""
        self.fd: int | None = None
        if path:
            kept = _steps_before(path, keep_before) if keep_before else b""
            directory, name = os.path.split(os.path.abspath(path))
            temporary = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
            self.fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(self.fd, kept)
            os.replace(temporary, path)  # the descriptor now writes the file named `path`
            self.end = len(kept)  # bytes of whole lines written

    def write(self, record: dict) -> None:
        """Append `record` as one line, flushed to the file at once."""
        if self.fd is None:
            return
        line = (json.dumps(record) + "\n").encode()
        try:
            written = 0
            while written < len(line):  # os.write may write less than asked
                written += os.write(self.fd, line[written:])
        except OSError:
            os.ftruncate(self.fd, self.end)  # never leave half a line
            raise
        self.end += len(line)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _steps_before(path: str, start: int) -> bytes:
    """The whole lines of `path` that are step records of steps before `start` (b"" when
    there is no such file): what a resumed run keeps of the records before its checkpoint."""
    if not os.path.exists(path):
        return b""
    kept = []
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a cut line: not a record
                continue
            if isinstance(record, dict) and "final_loss" not in record:
                if isinstance(record.get("step"), int) and record["step"] < start:
                    kept.append(line if line.endswith(b"\n") else line + b"\n")
    return b"".join(kept)


def closing_lines(final: dict) -> list[str]:
    """A run's closing lines from its final record: losses, the spread between replicas,
    what was sent, and the memory of each rank (its categories and the OS's peak RSS)."""
    by_axis = ", ".join(f"{a} {b / 1e6:.1f}" for a, b in final["bytes_sent_by_axis"].items())
    per_rank = final["memory_bytes_per_rank"]
    names = [n for n in CATEGORIES if n in per_rank] + [n for n in per_rank if n not in CATEGORIES]
    memory = " | ".join(f"{n} {'/'.join(f'{b / 1e6:.3f}' for b in per_rank[n])}" for n in names)
    load = final.get("expert_load")  # --experts: the router's counts over the run
    experts = [
        f"experts' load, tokens per expert per layer (top-k assignments over the run): "
        f"{load['tokens_per_expert']} | dropped {load['dropped']}"
        for load in [load]
        if load
    ]
    return [
        f"done: {final['steps']} steps in {final['time_s']:.1f}s | final loss "
        f"{final['final_loss']:.4f} | validation loss {final['val_loss']:.4f} | "
        f"param L2 {final['param_l2']:.6f}",
        f"max |param difference| across ranks: {final['max_param_diff']:.3g} | comm "
        f"{final['comm_s']:.2f}s (exposed {final['exposed_comm_s']:.2f}s) | "
        f"{final['bytes_sent_per_rank'] / 1e6:.1f} MB sent per rank ({by_axis})",
        f"memory per rank, MB: {memory} | peak RSS (the OS's) "
        + "/".join(f"{b / 1e6:.0f}" for b in final["peak_rss"]),
    ] + experts


def progress(step: int, loss: float, lr: float, w, batch_size: int, task, say) -> dict:
    """Print one progress line for the logging window `w` (meter.Window) that ends at
    `step`; return its JSON record. `task` names its unit (tokens, examples) and how many
    a global batch's example holds."""
    n = w.steps
    rate = batch_size * task.items_per_example * n / w.seconds
    say(
        f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | "
        f"{rate:,.0f} {task.unit}/s | comm {1e3 * w.comm_s / n:.1f} ms/step "
        f"({100 * w.comm_s / w.seconds:.0f}%, exposed {1e3 * w.exposed_s / n:.1f} ms) | "
        f"{w.bytes_sent / n / 1e6:.2f} MB sent/rank/step"
    )
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        f"{task.unit}_per_s": rate,
        "comm_s_per_step": w.comm_s / n,
        "exposed_comm_s_per_step": w.exposed_s / n,
        "bytes_sent_per_step": w.bytes_sent / n,
    }
