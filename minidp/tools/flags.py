"""What a config of flags can say about itself, and `flag()`, the field that declares one.

TrainConfig (cli/training/config.py) is a dataclass of `flag(...)` fields over `Flags`; the
command line is generated from its fields (tools/parser.add_fields). `Flags` answers, for
any such dataclass with `steps`, `strategy` and `model` fields: a field's default (a
step-counted one's follows --steps), whether it was set, the config with the unset step
counts filled in, whether a field applies to this --strategy and --model, and the header
line. The checks of the values are the config's own (its validate()).

The metadata keys `flag` takes:
  choices      the values the command line accepts
  strategies   the --strategy names it belongs to (none: every one); set under another,
               it is refused, never silently ignored
  models       the --model names it belongs to (none: every one)
  with         the flag that turns its feature on (the header hides it while that is off)
  of_steps     (numerator, denominator, least): unset, max(least, steps * n // d)
  interval     the values it may take, "[0, 1)" or "[0, inf)": a bracket takes its end in
               (the command line's checks refuse the rest, NaN too, in one line)
  on_resume    what a resumed run must keep equal (cli/training/resume.py refuses another):
               "model" (the model), "data" (the order of the data), "run" (what each step
               does from the saved step on: the learning rate, the optimizer, ...)
"""

from dataclasses import field, fields, replace


def flag(default, help: str, *, with_: str | None = None, **metadata):
    """A TrainConfig field: its default, its --help line and its metadata (listed above;
    `with_` is the "with" key, a Python keyword)."""
    if with_ is not None:
        metadata["with"] = with_
    return field(default=default, metadata={"help": help, **metadata})


def outside(value, interval: str) -> bool:
    """Whether `value` lies outside `interval` ("[0, 1)", "[0, inf)": a bracket takes its end
    in, a parenthesis leaves it out). NaN lies outside every interval."""
    lo, hi = (float(end) for end in interval[1:-1].split(","))
    above_lo = lo <= value if interval[0] == "[" else lo < value
    below_hi = value <= hi if interval[-1] == "]" else value < hi
    return not (above_lo and below_hi)


def kept_on_resume(config_class, kind: str) -> tuple[str, ...]:
    """The fields whose metadata says a resumed run keeps them: "model", "data" or "run"."""
    return tuple(f.name for f in fields(config_class) if f.metadata.get("on_resume") == kind)


class Flags:
    """The methods of a config of `flag` fields (see the module doc)."""

    def default_of(self, name: str):
        """Flag `name`'s default here: a step-counted one's is its fraction of --steps."""
        meta = type(self).__dataclass_fields__[name].metadata
        if "of_steps" not in meta:
            return type(self).__dataclass_fields__[name].default
        numerator, denominator, least = meta["of_steps"]
        return max(least, self.steps * numerator // denominator)

    def is_set(self, name: str) -> bool:
        """Whether flag `name` was given a value other than its default (resolved or not)."""
        value = getattr(self, name)
        return value is not None and value != self.default_of(name)

    def resolved(self) -> "Flags":
        """This config with each step-counted flag left unset filled in from --steps. Resolve
        last: `replace(config.resolved(), steps=N)` keeps the numbers filled in for the old
        --steps (replace the unresolved config, then resolve)."""
        unset = {
            f.name: self.default_of(f.name)
            for f in fields(self)
            if "of_steps" in f.metadata and getattr(self, f.name) is None
        }
        return replace(self, **unset) if unset else self

    def applies(self, name: str) -> bool:
        """Whether field `name` means anything under this --strategy and --model (the header
        prints only those; setting one that does not is refused by validate)."""
        meta = type(self).__dataclass_fields__[name].metadata
        strategies = meta.get("strategies", (self.strategy,))  # no list: every one
        models = meta.get("models", (self.model,))
        return self.strategy in strategies and self.model in models

    def header(self) -> str:
        """The config line of the run's header: the fields that apply to this --strategy and
        --model, less those of a feature left off (--prune's schedule without --prune, say)."""
        shown = []
        for f in fields(self):
            feature = f.metadata.get("with")  # the flag that turns this one's feature on
            if self.applies(f.name) and (feature is None or self.is_set(feature)):
                shown.append(f"{f.name}={getattr(self, f.name)}")
        return "config: " + " ".join(shown)

    def out_of_interval(self) -> tuple[str, object, str] | None:
        """The first (name, value, interval) whose value, resolved, lies outside its field's
        "interval"; None if every one is inside its own."""
        resolved = self.resolved()
        for f in fields(self):
            value, interval = getattr(resolved, f.name), f.metadata.get("interval")
            if interval is not None and outside(value, interval):
                return f.name, value, interval
        return None

    def misplaced(self) -> tuple[str, str, tuple, str] | None:
        """The first field set under a --strategy or --model it does not belong to, as
        (name, "strategy" or "model", the ones it belongs to, this config's); None: none."""
        for f in fields(self):
            if not self.applies(f.name) and self.is_set(f.name):
                if self.strategy not in f.metadata.get("strategies", (self.strategy,)):
                    return f.name, "strategy", f.metadata["strategies"], self.strategy
                return f.name, "model", f.metadata.get("models"), self.model
        return None
