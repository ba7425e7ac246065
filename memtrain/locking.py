"""Advisory file locks (``flock``) that keep a folder from being deleted while a process reads it.

One protocol, used for checkpoint folders (:mod:`memtrain.parallel.checkpoint_folder`: readers against
retention) and for the cache folders of remote data (:mod:`memtrain.data.loader`: running readers against a
newer run's clean-up). A reader holds a shared lock on a marker file inside the folder (:func:`hold_shared`)
for as long as it reads; a deleter takes an exclusive lock on the same file without waiting
(:func:`exclusive_nowait`) and deletes only when it gets it. A reader that took its lock after the deleter
removed or replaced the marker notices (the file it locked is no longer the one at the path) and treats the
folder as gone. Where the filesystem has no locks (Lustre without ``-o flock``, some FUSE mounts) the reader
goes on unprotected and the deleter learns so (``"no-locks"``), and decides. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from typing import Iterator, Literal, Optional

# flock errors that mean "this filesystem has no locks": the callers then go on without the protection the lock gave
NO_LOCK_ERRNOS = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL, errno.EBADF})

ExclusiveState = Literal["locked", "busy", "no-locks", "missing"]


def hold_shared(marker: Path) -> Optional[int]:
    """Open ``marker`` and take a shared lock on it, waiting only while a deleter holds it (that is, while it
    deletes this very folder). Returns the descriptor, which holds the lock until it is closed (where the
    filesystem has no locks it holds none), or None when the marker was removed or replaced before the lock
    was taken: the folder is gone, or is another one now."""
    try:
        fd = os.open(marker, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError as e:
            if e.errno not in NO_LOCK_ERRNOS:
                raise
        held = os.fstat(fd)
        try:
            now = os.stat(marker)
        except FileNotFoundError:
            now = None
    except BaseException:
        os.close(fd)
        raise
    if now is None or (now.st_ino, now.st_dev) != (held.st_ino, held.st_dev):
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def exclusive_nowait(marker: Path) -> Iterator[ExclusiveState]:
    """Try an exclusive lock on ``marker`` without waiting, held for the block. Yields ``"locked"`` (no reader
    holds it: the folder may be deleted), ``"busy"`` (a reader holds it), ``"no-locks"`` (the filesystem has
    none: the caller decides) or ``"missing"`` (no such file)."""
    try:
        try:
            fd = os.open(marker, os.O_RDWR)  # NFS turns flock into fcntl locks: exclusive needs write access
        except PermissionError:
            fd = os.open(marker, os.O_RDONLY)
    except FileNotFoundError:
        yield "missing"
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            state: ExclusiveState = "locked"
        except BlockingIOError:
            state = "busy"
        except OSError as e:
            if e.errno not in NO_LOCK_ERRNOS:
                raise
            state = "no-locks"
        yield state
    finally:
        os.close(fd)


__all__ = ["NO_LOCK_ERRNOS", "exclusive_nowait", "hold_shared"]
