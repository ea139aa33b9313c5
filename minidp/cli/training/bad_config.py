"""BadConfig, the one error a flag value that cannot work raises, and a field's flag name."""


class BadConfig(ValueError):
    """A flag value that cannot work: reported as one line, on rank 0, exit code 2."""


def flag_name(name: str) -> str:
    """A field's flag: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")
