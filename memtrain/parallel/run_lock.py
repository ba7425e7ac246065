"""The run directory's lock: one training run writes a ``run.dir`` at a time.

``<run.dir>/run.lock`` is created with ``O_CREAT | O_EXCL`` (so exactly one creator wins) and holds JSON
naming its holder: host, pid, the process's start time (``/proc/<pid>/stat``, to tell a reused pid
apart), ``SLURM_JOB_ID`` when set, when it started, the command line, and a random token (the
identity :meth:`RunLock.release` checks). Rank 0 of the trainer holds it for the run's life.

A lock that exists is *stale*, and taken over, when its holder cannot be running any more:

- it is on this host and its pid is not alive, or is alive with another start time (pid reuse);
- it is on another host and names our ``SLURM_JOB_ID``: a requeued incarnation of the same Slurm job
  (Slurm requeues a job only after the old incarnation ended).

Anything else (a live process here, any process on another host) is refused with a
:class:`memtrain.errors.LaunchError` naming the holder and the fix. A lock from another host that
crashed cannot be told from a running one: the message says to delete the file.

Taking over is race-free: the acquirers that found the same stale file serialise on an exclusive
``flock`` of that file; under it each checks that the path still names that very file (same inode)
before unlinking it and creating its own with ``O_EXCL``. The first one through replaces the file; the
others then see a different inode, read the new holder (alive) and are refused; an acquirer creating
the file in between (it found no file at all) wins the ``O_EXCL`` race against the taker-over, who is
refused in turn. On a filesystem without ``flock`` the inode check alone remains (a window of
microseconds).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from memtrain.errors import LaunchError
from memtrain.locking import NO_LOCK_ERRNOS

LOCK = "run.lock"
_UNREADABLE_WAIT_S = 2.0  # a lock file just created by O_EXCL is empty until its writer has written it


def process_start_time(pid: int) -> Optional[int]:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or
    None where there is no /proc or no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def identity() -> dict[str, Any]:
    """This process as a lock holder."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_time": process_start_time(pid),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None, "started": time.time(),
            "command": " ".join([sys.executable, *sys.argv]), "token": uuid.uuid4().hex}


def stale_reason(holder: dict[str, Any], me: dict[str, Any]) -> Optional[str]:
    """Why lock ``holder`` cannot be running any more (seen from ``me``), or None when it may be."""
    pid = holder.get("pid")
    if holder.get("host") == me["host"] and isinstance(pid, int):
        if not pid_alive(pid):
            return f"pid {pid} on {me['host']} is not running"
        start = process_start_time(pid)
        if holder.get("start_time") is not None and start is not None and start != holder.get("start_time"):
            return f"pid {pid} on {me['host']} is another process now (started later)"
        return None
    if me.get("slurm_job_id") and holder.get("slurm_job_id") == me["slurm_job_id"]:
        return f"it is an earlier incarnation of this Slurm job {me['slurm_job_id']} (requeued)"
    return None


class RunLock:
    """``<run_dir>/run.lock`` (see the module docstring). ``acquire()`` creates ``run_dir`` if needed and
    raises LaunchError when another live run holds it; ``release()`` removes the file only while it still
    names this lock. Usable as a context manager. ``replaced``: why a stale lock was taken over, if one was."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.holder: Optional[dict[str, Any]] = None  # our identity while held
        self.replaced: Optional[str] = None

    # -- the file ------------------------------------------------------------------------------------
    def _create(self, me: dict[str, Any]) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, (json.dumps(me, indent=2) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def _open(self) -> Optional[tuple[int, Any]]:
        """(fd, holder) of the current lock file; holder None when it cannot be parsed (yet); None when there
        is no file."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            data = b""
            while True:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                data += chunk
            holder = json.loads(data.decode())
            if not isinstance(holder, dict):
                holder = None
        except (OSError, ValueError):
            holder = None
        return fd, holder

    def _take_over(self, fd: int, me: dict[str, Any]) -> bool:
        """Replace the stale lock file open as ``fd`` by ours; False when another acquirer got there first."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held by another taker-over for a few syscalls at most
        except OSError as e:
            if e.errno not in NO_LOCK_ERRNOS:
                raise
        judged = os.fstat(fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return self._create(me)
        if (now.st_ino, now.st_dev) != (judged.st_ino, judged.st_dev):
            return False  # already replaced: judge the new holder
        os.unlink(self.path)
        return self._create(me)

    # -- the API ---------------------------------------------------------------------------------------
    def acquire(self) -> "RunLock":
        if self.holder is not None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        me = identity()
        unreadable_since = None
        for _ in range(1000):  # every pass either wins, is refused, or saw the file change under it
            if self._create(me):
                self.holder = me
                return self
            opened = self._open()
            if opened is None:
                continue  # released in between: try to create it again
            fd, holder = opened
            try:
                if holder is None:
                    unreadable_since = unreadable_since or time.monotonic()
                    if time.monotonic() - unreadable_since < _UNREADABLE_WAIT_S:
                        time.sleep(0.05)
                        continue
                    raise LaunchError(f"{self.path} exists but cannot be read as a lock; if no training run uses "
                                      f"{self.run_dir}, delete {self.path}")
                reason = stale_reason(holder, me)
                if reason is None:
                    raise LaunchError(self._refusal(holder))
                if self._take_over(fd, me):
                    self.holder, self.replaced = me, f"replaced a stale {self.path}: {reason}"
                    return self
            finally:
                os.close(fd)
        raise LaunchError(f"could not take {self.path}: it kept changing; if no training run uses {self.run_dir}, "
                          f"delete {self.path}")

    def release(self) -> None:
        """Remove the lock file if it still names this lock (a lock taken over meanwhile is left alone)."""
        if self.holder is None:
            return
        opened = self._open()
        if opened is not None:
            fd, holder = opened
            try:
                if isinstance(holder, dict) and holder.get("token") == self.holder["token"]:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
        self.holder = None

    def _refusal(self, holder: dict[str, Any]) -> str:
        started = holder.get("started")
        since = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
                 if isinstance(started, (int, float)) else "an unknown time")
        slurm = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
        return (f"run.dir {self.run_dir} is in use by another training run: host {holder.get('host')}, pid "
                f"{holder.get('pid')}, since {since}{slurm} ({self.path}); wait for it to finish or stop it; if it "
                f"is gone (another host that crashed), delete {self.path}")

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = ["LOCK", "RunLock", "identity", "pid_alive", "process_start_time", "stale_reason"]
