"""User-facing error types.

Every error a user can cause (a bad recipe, missing data, an incompatible checkpoint) is raised as a
subclass of :class:`MemtrainError`. The command line prints its message on one line and exits with
code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno

# Errors only a write gets, from a file system that is full, over quota or read-only: the storage's, not a bug.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def is_storage_failure(error: BaseException) -> bool:
    """Whether ``error`` is a write the file system refused (:data:`STORAGE_ERRNOS`)."""
    return isinstance(error, OSError) and error.errno in STORAGE_ERRNOS


# Errors of a path this user may not create, write or read, or that runs into a file where a folder is needed
# (or the other way round): the location's, not a bug.
PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
PATH_ERRNOS = PERMISSION_ERRNOS | {errno.ENOTDIR, errno.EISDIR, errno.EEXIST}


def is_path_failure(error: BaseException) -> bool:
    """Whether ``error`` is a file operation refused for the path it names (:data:`PATH_ERRNOS`)."""
    return isinstance(error, OSError) and error.errno in PATH_ERRNOS and error.filename is not None


def path_line(error: OSError) -> str:
    """One line for :func:`is_path_failure`: the path, what is wrong with it, and the fix. A path that does not
    exist was being created, so its folder is named: the one this user may not write in, or the file in the way."""
    import getpass
    import os
    from pathlib import Path

    path = os.fsdecode(error.filename)
    where = "(data.dir for prepare, run.dir for train, --out for eval, generate and scaling)"
    if error.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        fix = f"choose another location {where}, and run the command again"
        here = Path(os.path.abspath(path))
        blocker = next((q for q in [*reversed(here.parents), here] if os.path.lexists(q) and not q.is_dir()), None)
        if error.errno == errno.ENOTDIR and blocker is not None:
            return f"cannot use {path}: {blocker} is a file, not a folder; {fix}"
        if error.errno == errno.EEXIST and os.path.lexists(here) and not here.is_dir():
            return f"cannot create the folder {path}: a file of that name is in the way; {fix}"
        if error.errno == errno.EISDIR:
            return f"cannot use {path}: it is a folder, where a file was expected; {fix}"
        return f"{path}: {error.strerror}; {fix}"
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    fix = f"fix the permissions or choose a location this user may use {where}, and run the command again"
    if not os.path.lexists(path):
        folder = os.path.dirname(os.path.abspath(path))
        return f"cannot create {path}: {error.strerror} (user {user} may not write in {folder}); {fix}"
    return f"{path}: {error.strerror} (user {user}); {fix}"


class MemtrainError(Exception):
    """An error caused by the user's input, with a message that names the problem and the fix.
    ``printed_by_another_rank``: another rank of the same command prints this error (the CLI exits with its code
    without printing it again)."""

    exit_code = 2
    printed_by_another_rank = False


class DataError(MemtrainError):
    """Missing, empty or malformed training data."""


class CheckpointError(MemtrainError):
    """A checkpoint that cannot be loaded into this run."""


class StorageError(MemtrainError):
    """A write the file system refused (full, over quota, read-only; for a checkpoint's save, any OSError): a
    checkpoint's save or another file of the run directory. The message names the file, the space left and the
    checkpoint the same command resumes from once the storage is fixed."""


class SettingError(MemtrainError):
    """An environment variable memtrain reads (a switch such as ``MEMTRAIN_TITANS_BACKWARD``) set to a value it
    does not take."""


class LaunchError(MemtrainError):
    """An inconsistent process-group environment (launcher variables, world size, devices)."""


class DivergenceError(MemtrainError):
    """Training stopped because the loss or the weights stopped being finite (``train.max_nonfinite_steps``).
    Its own exit code, 3, so that a job scheduler can tell a diverged run (requeueing will not help) from
    a bad input (2) and from a crash (1)."""

    exit_code = 3


class CollectiveError(MemtrainError):
    """A collective operation did not complete: another rank hung (``parallel.timeout_minutes`` passed)
    or died. Exit code 4: neither the input's fault (2) nor a bug of this process (1); the run resumes
    from its last checkpoint once the failed rank's cause is fixed."""

    exit_code = 4
