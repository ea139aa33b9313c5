"""One job at a time in a checkpoint folder: a lock its rank 0 holds while the job runs.

    with checkpoint.folder_lock("run", group):     # collective; FolderInUse if taken
        ... train, checkpoint.save(state, "run/step_000300", group, step=300) ...

Two jobs saving into one folder would overwrite each other's step_NNNNNN directories, and
a later `--resume run` would go on from the other job's weights without a word. So a job
that saves takes the folder first:

    rank 0     opens run/.lock and takes an exclusive flock on it, without waiting;
               writes its host, process id and start time into it (for the message)
    all ranks  learn the verdict (one broadcast): held, or FolderInUse naming the owner
    the end    the lock is released when the job leaves the `with`, or when rank 0's
               process ends in any way (the kernel drops a dead process's flock)

So a folder whose job crashed is free again: the .lock file stays, but no one holds it, and
the next job takes it over (its contents name the job that crashed). flock is advisory:
only programs that ask for it are kept out. On NFS, Linux takes it as a lock on the server
(NFSv4 byte-range locks), so jobs on different machines exclude each other too; on a
filesystem that keeps no locks at all (Lustre mounted without `flock`), rank 0 says so in a
warning and the job goes on unlocked rather than not saving.
"""

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time

from minidp import comm
from minidp.parallel.checkpoint.shards import CheckpointError

LOCK = ".lock"
UNSUPPORTED = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)  # flock's "no locks here"


class FolderInUse(CheckpointError):
    """Another job holds the checkpoint folder."""


@contextlib.contextmanager
def folder_lock(path: str, group: comm.Group):
    """Collective: hold `path`/.lock for the `with` block (rank 0 holds it); FolderInUse on
    every rank if another job holds it. Makes `path` if it does not exist."""
    held, verdict = None, ""
    if group.rank == 0:
        try:
            held = _take(path)
        except FolderInUse as error:
            verdict = str(error)
        except OSError as error:
            name = os.path.join(path, LOCK)
            if error.errno not in UNSUPPORTED:
                verdict = f"cannot lock {name}: {error.strerror}"
            else:  # a filesystem without locks (Lustre mounted without flock): go on
                print(
                    f"minidp: warning: cannot lock {name} ({error.strerror}): this filesystem "
                    "keeps no locks, so nothing stops a second job saving into this folder",
                    file=sys.stderr,
                    flush=True,
                )
    verdict = comm.broadcast_text(verdict, root=0, group=group)
    if verdict:
        raise FolderInUse(verdict)
    try:
        yield
    finally:
        if held is not None:
            os.close(held)  # the flock goes with the last descriptor of the open file


def _take(path: str) -> int:
    """Rank 0: the descriptor of path/.lock, flocked; FolderInUse if another holds it."""
    os.makedirs(path, exist_ok=True)
    name = os.path.join(path, LOCK)
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _owner(fd)
        os.close(fd)
        raise FolderInUse(
            f"{path} is in use by another job ({owner}): two jobs saving there would "
            "overwrite each other's checkpoints; give this one another folder, or wait for "
            "that one to end"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%F %T")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    return fd


def _owner(fd: int) -> str:
    """The holder's host, pid and start time as its .lock file says them."""
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"process {owner['pid']} on {owner['host']}, since {owner['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its .lock does not say which"
