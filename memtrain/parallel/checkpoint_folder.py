"""Checkpoint folders: names, the completion marker and its checksums, listing, reading, retention.

``<run.dir>/checkpoints/global_step<N>/`` is one checkpoint. Every rank writes its files into the
temporary folder ``.global_step<N>.partial`` (:func:`partial_tag_for`, a name :func:`list_checkpoints`
never matches); rank 0 then hashes the files (the ranks share the work), writes ``COMPLETE.json``
(:data:`MARKER`) with every file's size and xxh64 checksum, renames the folder to ``global_step<N>``
(:func:`publish`) and points ``checkpoints/latest`` at it (:func:`write_latest`, the file DeepSpeed's own
tools such as ``zero_to_fp32.py`` read). A folder is a checkpoint only once it has its name and its
marker; a ``global_step<N>`` without the marker (an older save cut off, or a marker deleted to fall
back) is incomplete and never resumed from, and partial folders of killed saves are removed at the next
save. A marker that exists but cannot be parsed (or lacks its step, permanence or world size) makes the
folder *damaged* (:class:`DamagedCheckpoint`): the save wrote it complete, so it is neither skipped as
incomplete nor ever pruned; a resume or evaluation that would have taken it stops with one line naming the
marker and the fallback (:func:`latest_checkpoint`).

:func:`verify` checks the files against the marker's checksums (collective over the ranks, each
hashing its share). Readers hold a shared ``flock`` on the marker while they read (:func:`reading`);
:func:`prune` takes an exclusive one before deleting a folder and skips any folder being read.

This module knows the folders and the marker, not what is inside them: the engine and trainer state
are :mod:`memtrain.parallel.checkpoint`, the memory bank's rows :mod:`memtrain.parallel.bank_checkpoint`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from memtrain.errors import CheckpointError
from memtrain.locking import exclusive_nowait, hold_shared
from memtrain.parallel.dist import gather_strings

MARKER = "COMPLETE.json"
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"  # DeepSpeed's name: zero_to_fp32.py and load_checkpoint(tag=None) read it
HASH = "xxh64"
CHUNK = 8 << 20  # bytes read at a time while hashing
_TAG_RE = re.compile(r"^global_step(\d+)$")
# Temporary folders: a save being written (.partial) and a folder on its way out (.trash: replaced by a
# new save of its step, or pruned). Both start with a dot, so neither is ever listed as a checkpoint.
_LEFTOVER_RE = re.compile(r"^\.global_step(\d+)\.(partial|trash)$")
# Written into a checkpoint after it was marked complete (the universal conversion, its pointer file and
# its temporary folder) or the marker itself: not covered by the checksums.
_UNRECORDED = {MARKER, "universal", "universal.tmp", "latest_universal"}


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"global_step{step}"


def partial_tag_for(step: int) -> str:
    """The folder a save of ``step`` is written into before it is renamed to :func:`tag_for`."""
    return f".global_step{step}.partial"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    permanent: bool
    world_size: int

    @property
    def tag(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class DamagedCheckpoint:
    """A ``global_step<N>`` folder whose marker exists but cannot be used: ``problem`` says why (it cannot be
    read or parsed, or lacks a field). Only a save writes the marker, after every file: such a folder was
    complete, and treating it as incomplete (resuming from an older one, then pruning it) lost it."""
    path: Path
    step: int
    problem: str

    @property
    def tag(self) -> str:
        return self.path.name


# --------------------------------------------------------------------------------------------------
# Atomic small files


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` through a temporary file, fsync and a rename: readers never see half a file, and a failed
    write leaves the old file (or none) and no temporary one. The parent folder is created; the temporary name
    carries the process id, so concurrent writers of one path (two evaluations of a checkpoint) never write
    into each other's file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no half-written temporary file stays behind
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: dict) -> None:
    """:func:`write_text_atomic` of ``data`` as indented JSON."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (a rename into it) durable; a no-op where folders cannot be
    opened for it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def free_bytes(path: Path) -> float:
    """Bytes free to this user on the file system holding ``path``; infinity where that cannot be read."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return float("inf")


def write_latest(run_dir: Path, tag: str) -> None:
    """Point ``<run.dir>/checkpoints/latest`` at ``tag``, as DeepSpeed's ``save_latest`` would (the tag,
    no newline), atomically. Written only for a complete checkpoint that has its final name."""
    write_text_atomic(checkpoint_root(run_dir) / LATEST, tag)


# --------------------------------------------------------------------------------------------------
# Listing


def _marker_problem(data: Any, step: int) -> Optional[str]:
    """What makes parsed marker ``data`` of folder ``global_step<step>`` unusable, or None: the fields
    every memtrain version wrote (step, permanent, world_size), with their types, and ``files`` a table."""
    if not isinstance(data, dict):
        return f"{MARKER} is not a JSON object"
    missing = [k for k in ("step", "permanent", "world_size") if k not in data]
    if missing:
        return f"{MARKER} lacks {', '.join(missing)}"
    if type(data["step"]) is not int or data["step"] != step:
        return f"{MARKER} records step {data['step']!r} in the folder of step {step}"
    if type(data["world_size"]) is not int or data["world_size"] < 1:
        return f"{MARKER} records world_size {data['world_size']!r}"
    if not isinstance(data["permanent"], bool):
        return f"{MARKER} records permanent {data['permanent']!r}"
    if not isinstance(data.get("files", {}), dict):
        return f"{MARKER} records files as {type(data['files']).__name__}, not a table"
    return None


def _scan(run_dir: Path) -> tuple[list[CheckpointInfo], list[Path], list[DamagedCheckpoint]]:
    """(complete checkpoints by step, incomplete tag folders by name, damaged checkpoints by step)."""
    root = checkpoint_root(run_dir)
    complete, incomplete, damaged = [], [], []
    if not root.is_dir():
        return complete, incomplete, damaged
    for child in root.iterdir():
        m = _TAG_RE.match(child.name)
        if not m or not child.is_dir():
            continue
        step, marker = int(m.group(1)), child / MARKER
        if not marker.is_file():
            incomplete.append(child)
            continue
        try:
            data = json.loads(marker.read_text(encoding="utf-8"))
        except FileNotFoundError:  # deleted since is_file(): to fall back past it, or pruned
            if child.is_dir():
                incomplete.append(child)
            continue
        except OSError as e:
            damaged.append(DamagedCheckpoint(child, step, f"{MARKER} cannot be read ({e.strerror or e})"))
            continue
        except ValueError as e:  # JSONDecodeError (cut short, overwritten), UnicodeDecodeError (binary garbage)
            damaged.append(DamagedCheckpoint(child, step, f"{MARKER} cannot be parsed ({e})"))
            continue
        problem = _marker_problem(data, step)
        if problem:
            damaged.append(DamagedCheckpoint(child, step, problem))
            continue
        complete.append(CheckpointInfo(child, step, data["permanent"], data["world_size"]))
    complete.sort(key=lambda c: c.step)
    incomplete.sort(key=lambda p: p.name)
    damaged.sort(key=lambda d: d.step)
    return complete, incomplete, damaged


def list_checkpoints(run_dir: Path) -> tuple[list[CheckpointInfo], list[Path]]:
    """(complete checkpoints sorted by step, incomplete tag folders: those without a marker). Partial folders
    of saves in progress or killed (:func:`partial_tag_for`) are neither, nor are damaged checkpoints
    (:func:`damaged_checkpoints`)."""
    complete, incomplete, _ = _scan(run_dir)
    return complete, incomplete


def damaged_checkpoints(run_dir: Path) -> list[DamagedCheckpoint]:
    """The tag folders of ``run_dir`` whose marker exists but cannot be used, by step."""
    return _scan(run_dir)[2]


def leftovers(run_dir: Path) -> list[Path]:
    """Temporary folders in ``<run.dir>/checkpoints``: partial saves (killed, or the one in progress) and
    folders left half-deleted."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _LEFTOVER_RE.match(p.name) and p.is_dir())


def latest_checkpoint(run_dir: Path, strict: bool = True) -> Optional[CheckpointInfo]:
    """The newest complete checkpoint of ``run_dir``, or None. ``strict``: CheckpointError when a damaged
    checkpoint (:class:`DamagedCheckpoint`) is newer than it, naming the marker and the fallback; resuming or
    evaluating the older one instead would silently drop the damaged one's steps. Error messages that only
    name the last good checkpoint pass ``strict=False``."""
    complete, _, damaged = _scan(run_dir)
    newest = complete[-1] if complete else None
    newer = [d for d in damaged if newest is None or d.step > newest.step]
    if strict and newer:
        raise damaged_error(newer[-1])
    return newest


def previous_checkpoint(info: CheckpointInfo | DamagedCheckpoint) -> Optional[CheckpointInfo]:
    """The newest complete checkpoint of ``info``'s run older than ``info``."""
    older = [c for c in list_checkpoints(info.path.parent.parent)[0] if c.step < info.step]
    return older[-1] if older else None


def fallback(info: CheckpointInfo | DamagedCheckpoint) -> str:
    """The fix for a damaged checkpoint: fall back to the previous complete one (deleting the markers of
    damaged ones between them too), or start over."""
    prev = previous_checkpoint(info)
    if prev is not None:
        between = [d for d in damaged_checkpoints(info.path.parent.parent) if prev.step < d.step < info.step]
        markers = " and ".join(str(p / MARKER) for p in [info.path] + [d.path for d in reversed(between)])
        return f"delete {markers} to resume from {prev.path}"
    if isinstance(info, DamagedCheckpoint):
        return f"the run has no complete checkpoint older than {info.path}: start a new run.dir"
    return f"{info.path} is the run's only complete checkpoint: start a new run.dir"


def damaged_error(damaged: DamagedCheckpoint) -> CheckpointError:
    """The error for a damaged checkpoint's marker, as :func:`verify` reports a damaged file: the folder,
    the problem, the fallback."""
    return CheckpointError(f"checkpoint {damaged.path} is damaged: {damaged.problem}; {fallback(damaged)}")


def removed(info: CheckpointInfo) -> CheckpointError:
    """The error for a complete checkpoint that disappeared while (or before) it was read."""
    return CheckpointError(f"checkpoint {info.path} was removed while it was being read (pruned by the training "
                           "run that writes its run.dir, or deleted); use a newer checkpoint of that run, or pass "
                           "the run.dir to take its newest")


def is_removed(info: CheckpointInfo) -> bool:
    """Whether ``info``'s folder (or its marker) is gone: a read error is then no damage to report."""
    return not (info.path / MARKER).is_file()


def resolve(path: str | Path) -> CheckpointInfo:
    """A complete checkpoint from a ``global_stepN`` folder or a run directory (its newest one)."""
    p = Path(path)
    if (p / MARKER).is_file() and _TAG_RE.match(p.name):
        complete, _, damaged = _scan(p.parent.parent)
        found = [c for c in complete if c.path == p]
        if found:
            return found[0]
        for d in damaged:
            if d.path == p:
                raise damaged_error(d)
    if p.is_dir():
        info = latest_checkpoint(p)
        if info is not None:
            return info
    raise CheckpointError(f"{path} is neither a complete checkpoint folder (global_stepN with {MARKER}) nor a run "
                          "directory holding one; point to a run.dir or one of its checkpoints/global_stepN")


def summarize(info: CheckpointInfo) -> dict[str, Any]:
    return {"path": str(info.path), "step": info.step, "permanent": info.permanent, "world_size": info.world_size}


def read_trainer_state(info: CheckpointInfo) -> dict:
    try:
        return json.loads((info.path / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        if is_removed(info):
            raise removed(info) from None
        raise CheckpointError(f"checkpoint {info.path} is marked complete but its {TRAINER_STATE} cannot be "
                              f"read ({e}); {fallback(info)}") from None


# --------------------------------------------------------------------------------------------------
# Checksums


def hash_file(path: Path, sync: bool = False) -> tuple[int, str]:
    """(size in bytes, xxh64 hex digest) of ``path``, read in :data:`CHUNK` pieces. ``sync``: also fsync
    the file (a save makes its files durable before renaming their folder into place)."""
    import xxhash

    h = xxhash.xxh64()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
        if sync:
            try:
                os.fsync(f.fileno())
            except OSError:
                pass
    return size, h.hexdigest()


def checkpoint_files(folder: Path) -> list[str]:
    """Every file under checkpoint folder ``folder`` the marker records (POSIX paths relative to it,
    sorted): all but the marker itself and the universal conversion's output."""
    folder = Path(folder)
    names = []
    for dirpath, dirnames, filenames in os.walk(folder):
        rel = Path(dirpath).relative_to(folder)
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames if d not in _UNRECORDED]
            filenames = [f for f in filenames if f not in _UNRECORDED and not f.startswith(f".{MARKER}.")]
        names += [(rel / f).as_posix() for f in filenames]
    return sorted(names)


def hash_files(folder: Path, names: list[str], sync: bool = False) -> dict[str, dict[str, Any]]:
    """``{name: {"size": bytes, "xxh64": hex}}`` for files ``names`` of ``folder``."""
    out = {}
    for name in names:
        size, digest = hash_file(Path(folder) / name, sync=sync)
        out[name] = {"size": size, HASH: digest}
    return out


def mark_complete(path: Path, step: int, permanent: bool, world_size: int,
                  files: Optional[dict[str, dict[str, Any]]] = None) -> None:
    """Write the completion marker of checkpoint folder ``path`` (rank 0, after every rank has written):
    step, permanence, the world size, the time, and (``files``, from :func:`hash_files`) every file's size
    and checksum."""
    data: dict[str, Any] = {"step": step, "permanent": permanent, "world_size": world_size, "time": time.time()}
    if files is not None:
        data["algorithm"] = HASH
        data["files"] = dict(sorted(files.items()))
    write_json_atomic(path / MARKER, data)


def _check(folder: Path, name: str, want: dict[str, Any]) -> Optional[str]:
    """What differs between file ``name`` and its record, or None."""
    path = folder / name
    try:
        size = path.stat().st_size
        if size != want.get("size"):
            return f"{name} has {size} bytes but {want.get('size')} were written (size mismatch)"
        _, digest = hash_file(path)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror or e})"
    if digest != want.get(HASH):
        return f"{name} has xxh64 {digest} but {want.get(HASH)} was written (checksum mismatch)"
    return None


def verify(info: CheckpointInfo, rank: int = 0, world: int = 1) -> None:
    """Check every file of ``info`` against the sizes and checksums in its marker; CheckpointError naming
    the first damaged file, what differs and the fallback. Collective when a process group runs and
    ``world > 1``: file ``i`` is checked by rank ``i % world`` and every rank raises the same error.
    A checkpoint written before checksums were recorded has nothing to check."""
    problems: list[str] = []
    files: dict[str, Any] = {}
    try:
        marker = json.loads((info.path / MARKER).read_text(encoding="utf-8"))
        files = marker.get("files") or {}
        if files and marker.get("algorithm", HASH) != HASH:
            problems.append(f"{MARKER} records checksums of algorithm {marker.get('algorithm')!r}, not {HASH}")
            files = {}
    except FileNotFoundError:
        problems.append("")  # removed: reported below
    except (OSError, ValueError) as e:  # ValueError: JSON cut short, or binary garbage (UnicodeDecodeError)
        problems.append(f"{MARKER} cannot be read ({e})")
    if problems and rank != 0:
        problems = []  # the marker is the same file for every rank: rank 0 reports it
    for i, name in enumerate(sorted(files)):
        if i % max(world, 1) == rank:
            found = _check(info.path, name, files[name])
            if found:
                problems.append(found)
    problems = gather_strings(problems) if world > 1 else problems
    if not problems:
        return
    problems = [p for p in problems if p]
    if not problems or is_removed(info):
        raise removed(info)
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise CheckpointError(f"checkpoint {info.path} is damaged: {problems[0]}{more}; {fallback(info)}")


# --------------------------------------------------------------------------------------------------
# Reading and retention


@contextlib.contextmanager
def reading(info: CheckpointInfo) -> Iterator[CheckpointInfo]:
    """Hold a shared lock on ``info``'s marker while the block reads the checkpoint: :func:`prune` (of
    any process) skips the folder meanwhile (:mod:`memtrain.locking`). CheckpointError when the folder was
    removed before the lock was taken. Where the filesystem has no locks the block runs unprotected."""
    fd = hold_shared(info.path / MARKER)
    if fd is None:
        raise removed(info)
    try:
        yield info
    finally:
        os.close(fd)


def _trash(path: Path) -> Path:
    """Rename folder ``path`` (a tag or a partial folder) out of the listing, to its ``.trash`` name."""
    m = _TAG_RE.match(path.name) or _LEFTOVER_RE.match(path.name)
    trash = path.with_name(f".global_step{m.group(1)}.trash") if m else path.with_name(f".{path.name}.trash")
    if trash != path:
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
    return trash


def remove_unless_read(path: Path) -> bool:
    """Delete checkpoint folder ``path`` unless a reader holds its marker (:func:`reading`): take an
    exclusive lock without waiting, move the folder out of the listing, delete it. False when it is
    being read (it stays; a later prune takes it). Where the filesystem has no locks it is deleted: retention
    must not stop there."""
    with exclusive_nowait(path / MARKER) as state:
        if state == "busy":
            return False
        if path.exists():
            shutil.rmtree(_trash(path), ignore_errors=True)
        return True


def publish(partial: Path, final: Path) -> None:
    """Rename the written and marked folder ``partial`` to its tag ``final`` (rank 0). A folder already
    there (an incomplete one left by an older save, or a marker deleted to fall back past it) is moved
    aside first and deleted; the parent folder is fsynced so the new name survives a crash."""
    old = None
    if final.exists():
        old = _trash(final)
    os.rename(partial, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete complete, non-permanent checkpoints beyond the newest ``keep_last`` (skipping any being
    read: :func:`reading`), incomplete tags older than the newest complete checkpoint, and leftover
    temporary folders (:func:`leftovers`). Returns the folders deleted. Damaged checkpoints
    (:func:`damaged_checkpoints`) are never deleted: only the user, who is told of them, decides. Called by
    rank 0 after a save; the run lock keeps any other save from being in progress."""
    complete, incomplete = list_checkpoints(run_dir)
    removed_paths = []
    regular = [c for c in complete if not c.permanent]
    for info in regular[:-keep_last] if keep_last > 0 else regular:
        if remove_unless_read(info.path):
            removed_paths.append(info.path)
    if complete:
        newest = complete[-1].step
        for p in incomplete:
            m = _TAG_RE.match(p.name)
            if m and int(m.group(1)) < newest:
                shutil.rmtree(p, ignore_errors=True)
                removed_paths.append(p)
    for p in leftovers(run_dir):
        shutil.rmtree(p, ignore_errors=True)
        removed_paths.append(p)
    return removed_paths
