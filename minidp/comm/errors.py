"""The errors a collective raises when ranks disagree or a peer never arrives."""


class CollectiveError(RuntimeError):
    """Base class: a collective could not complete consistently on every rank.

    `reported_elsewhere`: every rank of the group raises this same error (they all read the
    same table of fingerprints), and one other rank reports it, so the command line prints
    the cause once (comm/abort.py: end_job)."""

    def __init__(self, message: str = "", *, reported_elsewhere: bool = False):
        super().__init__(message)
        self.reported_elsewhere = reported_elsewhere


class CollectiveMismatch(CollectiveError):
    """Ranks of one group called different collectives, or passed different arguments."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete in time; the message names the ranks never heard from."""


class MessageSizeMismatch(CollectiveMismatch):
    """A message arrived shorter or longer than the receive posted for it: the ranks disagree
    on a size (shape, dtype or count). Raised on the rank that received it."""
