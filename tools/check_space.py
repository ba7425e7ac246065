"""Refuse `make install` in one line when the disk cannot hold the virtual environment.

The environment is 7.1 GB (measured 2026-11-29 with `du -sh .venv` after `make install`: PyTorch's CUDA
build and its NVIDIA libraries are 4.4 GB of it), and an install whose wheels come from PyPI peaks at 10.9 GB,
since pip keeps the downloaded wheels in a temporary folder until it has installed them (measured the same
day, sampling the environment and the temporary folder every 3 s). pip on a full disk fails minutes in, with
"[Errno 28] No space left on device" under a page of warnings, and leaves a half-filled `.venv`. This
check runs first, with only the standard library (it runs before the environment exists):

    python3 tools/check_space.py VENV_DIR GIGABYTES

exits 0 when the file system that will hold VENV_DIR has GIGABYTES free (GIGABYTES 0 skips the check),
and otherwise prints one line naming the file system, what is free, what is needed and the ways out,
and exits 2. pip downloads into the temporary folder (`TMPDIR`, else /tmp): of the 10.9 GB, the downloaded
wheels are at most 3.8 GB (the temporary folder's peak, the same measurement). So where that folder is on
another file system, it must have TEMP_GB free and the environment's file system the rest.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile

GB = 1e9
TEMP_GB = 4.0  # pip's downloaded wheels in the temporary folder: 3.8 GB at the peak, measured 2026-11-29


def existing_parent(path: str) -> str:
    """The nearest directory at or above `path` that exists (the venv itself does not yet)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def device(path: str) -> int:
    """The file system holding ``path`` (its device number)."""
    return os.stat(path).st_dev


def problem(venv: str, need_gb: float, temp: str | None = None) -> str | None:
    """None when there is room; otherwise the one-line message. ``temp``: pip's temporary folder (default
    Python's, which follows TMPDIR as pip's does)."""
    if need_gb <= 0:
        return None
    where = existing_parent(venv)
    temp = temp or tempfile.gettempdir()
    elsewhere = device(where) != device(temp)
    temp_gb = min(TEMP_GB, need_gb) if elsewhere else 0.0
    free = shutil.disk_usage(where).free
    if free < (need_gb - temp_gb) * GB:
        return (
            f"make install: {free / GB:.1f} GB free on the file system of {where}, but the virtual environment "
            f"{venv} needs about {need_gb - temp_gb:g} GB (PyTorch's CUDA build and its NVIDIA libraries); free some "
            f"space, or put the environment on a larger disk with `make VENV=/path/to/venv ...`"
            f" (`INSTALL_GB=0` skips this check)"
        )
    if elsewhere:
        free = shutil.disk_usage(temp).free
        if free < temp_gb * GB:
            return (
                f"make install: {free / GB:.1f} GB free on the file system of the temporary folder {temp}, but pip "
                f"needs about {temp_gb:g} GB there for the packages it downloads; free some space, or point TMPDIR "
                f"at a larger disk (`TMPDIR=/path/to/tmp make ...`) (`INSTALL_GB=0` skips this check)"
            )
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python3 tools/check_space.py VENV_DIR GIGABYTES", file=sys.stderr)
        return 2
    venv, need = argv
    try:
        need_gb = float(need)
    except ValueError:
        need_gb = float("nan")
    if not math.isfinite(need_gb) or need_gb < 0:
        print(f"make install: INSTALL_GB={need!r} is not a number of gigabytes (0 skips the check)", file=sys.stderr)
        return 2
    message = problem(venv, need_gb)
    if message:
        print(message, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
