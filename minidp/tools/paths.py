"""Whether a run can write where it is told to, asked before it starts (the command line's
checks: a typo in an output path must not cost a finished run's results). Each answer is
None (it can) or the reason it cannot, for the caller to put after its flag."""

import os
import tempfile


def unwritable_file(path: str) -> str | None:
    """Why a file `path` could not be written (a directory, or a folder that takes no file)."""
    if os.path.isdir(path):
        return "names a directory; give a file name"
    return unwritable_dir(os.path.dirname(os.path.abspath(path)))


def uncreatable_dir(directory: str) -> str | None:
    """Why `directory` could not be made: the nearest one that exists takes no file."""
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):  # the directories it would create
        existing = os.path.dirname(existing)
    return unwritable_dir(existing)


def unwritable_dir(directory: str) -> str | None:
    """Why no file can be created in `directory` (tried: root passes os.access)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as error:
        return f"cannot write in {directory} ({error.strerror})"


def same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
