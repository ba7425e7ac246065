"""Checkpoint folders: names, completion markers, listing, retention.

``<run.dir>/checkpoints/global_step<N>/`` is one checkpoint. It counts only once ``COMPLETE.json``
(:data:`MARKER`) is in it, written atomically (:func:`write_json_atomic`) by rank 0 after every rank
has finished writing; a folder without it is a save that was cut off and is never resumed from.
This module knows the folders and the marker, not what is inside them: the engine and trainer state
are :mod:`memtrain.parallel.checkpoint`, the memory bank's rows :mod:`memtrain.parallel.bank_checkpoint`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memtrain.errors import CheckpointError

MARKER = "COMPLETE.json"
TRAINER_STATE = "trainer_state.json"
_TAG_RE = re.compile(r"^global_step(\d+)$")


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"global_step{step}"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    permanent: bool
    world_size: int

    @property
    def tag(self) -> str:
        return self.path.name


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON through a temporary file, fsync and a rename: readers never see half a file.
    The parent folder is created; the temporary name carries the process id, so concurrent writers of one
    path (two evaluations of a checkpoint) never write into each other's file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_checkpoints(run_dir: Path) -> tuple[list[CheckpointInfo], list[Path]]:
    """(complete checkpoints sorted by step, incomplete tag folders)."""
    root = checkpoint_root(run_dir)
    complete, incomplete = [], []
    if not root.is_dir():
        return complete, incomplete
    for child in root.iterdir():
        m = _TAG_RE.match(child.name)
        if not m or not child.is_dir():
            continue
        marker = child / MARKER
        if not marker.is_file():
            incomplete.append(child)
            continue
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            incomplete.append(child)
            continue
        complete.append(CheckpointInfo(child, int(m.group(1)), bool(info.get("permanent", False)),
                                       int(info.get("world_size", 1))))
    complete.sort(key=lambda c: c.step)
    incomplete.sort(key=lambda p: p.name)
    return complete, incomplete


def latest_checkpoint(run_dir: Path) -> Optional[CheckpointInfo]:
    complete, _ = list_checkpoints(run_dir)
    return complete[-1] if complete else None


def mark_complete(path: Path, step: int, permanent: bool, world_size: int) -> None:
    """Write the completion marker of checkpoint folder ``path`` (rank 0, after every rank has written)."""
    write_json_atomic(path / MARKER, {"step": step, "permanent": permanent, "world_size": world_size,
                                      "time": time.time()})


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete complete, non-permanent checkpoints beyond the newest ``keep_last``, and incomplete
    tags older than the newest complete checkpoint."""
    complete, incomplete = list_checkpoints(run_dir)
    removed = []
    regular = [c for c in complete if not c.permanent]
    for info in regular[:-keep_last] if keep_last > 0 else regular:
        shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info.path)
    if complete:
        newest = complete[-1].step
        for p in incomplete:
            m = _TAG_RE.match(p.name)
            if m and int(m.group(1)) < newest:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def read_trainer_state(info: CheckpointInfo) -> dict:
    try:
        return json.loads((info.path / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {info.path} is marked complete but its {TRAINER_STATE} cannot be "
                              f"read ({e}); delete {info.path / MARKER} to fall back to an older checkpoint")


def resolve(path: str | Path) -> CheckpointInfo:
    """A complete checkpoint from a ``global_stepN`` folder or a run directory (its newest one)."""
    p = Path(path)
    if (p / MARKER).is_file() and _TAG_RE.match(p.name):
        found = [c for c in list_checkpoints(p.parent.parent)[0] if c.path == p]
        if found:
            return found[0]
    if p.is_dir():
        info = latest_checkpoint(p)
        if info is not None:
            return info
    raise CheckpointError(f"{path} is neither a complete checkpoint folder (global_stepN with {MARKER}) nor a run "
                          "directory holding one; point to a run.dir or one of its checkpoints/global_stepN")


def summarize(info: CheckpointInfo) -> dict[str, Any]:
    return {"path": str(info.path), "step": info.step, "permanent": info.permanent, "world_size": info.world_size}
