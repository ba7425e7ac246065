"""memtrain.locking: the flock protocol that keeps checkpoint folders and remote-data cache folders from being
deleted while a process reads them, and its two users' policies where the filesystem has no locks (checkpoint
retention deletes anyway; the data cache keeps the folder). flock locks belong to open file descriptions, so two
``os.open`` of one file in this process conflict as two processes would."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from memtrain import locking
from memtrain.locking import exclusive_nowait, hold_shared


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _no_locks(monkeypatch, code: int = errno.ENOLCK) -> None:
    def flock(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(locking.fcntl, "flock", flock)


def test_a_reader_keeps_the_deleter_out_until_it_closes(tmp_path):
    marker = tmp_path / "marker"
    marker.write_text("x")
    fd = hold_shared(marker)
    assert fd is not None
    other = hold_shared(marker)  # readers share
    assert other is not None
    os.close(other)
    with exclusive_nowait(marker) as state:
        assert state == "busy"
    os.close(fd)
    with exclusive_nowait(marker) as state:
        assert state == "locked"
    with exclusive_nowait(marker) as state:  # released with the block
        assert state == "locked"


def test_a_missing_or_replaced_marker_reads_as_gone(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    assert hold_shared(marker) is None
    with exclusive_nowait(marker) as state:
        assert state == "missing"
    marker.write_text("old")
    real = locking.fcntl.flock

    def deleted_meanwhile(fd, op):  # the deleter removed the folder and a new one took its name before the lock
        (tmp_path / "new").write_text("new")
        os.replace(tmp_path / "new", marker)
        real(fd, op)

    monkeypatch.setattr(locking.fcntl, "flock", deleted_meanwhile)
    before = _open_fds()
    assert hold_shared(marker) is None
    assert _open_fds() == before  # the descriptor of the replaced file is closed


def test_without_locks_the_reader_goes_on_and_the_deleter_is_told(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    marker.write_text("x")
    _no_locks(monkeypatch)
    fd = hold_shared(marker)
    assert fd is not None  # unprotected, but reading
    with exclusive_nowait(marker) as state:
        assert state == "no-locks"
    os.close(fd)


def test_other_lock_errors_raise_and_close_the_descriptor(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    marker.write_text("x")
    _no_locks(monkeypatch, errno.EIO)
    before = _open_fds()
    with pytest.raises(OSError, match="Input/output error"):
        hold_shared(marker)
    with pytest.raises(OSError, match="Input/output error"):
        with exclusive_nowait(marker):
            pass
    assert _open_fds() == before


def test_checkpoint_retention_deletes_without_locks_and_the_data_cache_keeps(tmp_path, monkeypatch):
    from memtrain.data import loader
    from memtrain.parallel import checkpoint_folder

    ckpt = tmp_path / "global_step3"
    ckpt.mkdir()
    (ckpt / checkpoint_folder.MARKER).write_text("{}")
    cache = tmp_path / "data-0123"
    cache.mkdir()
    (cache / loader.META).write_text("{}")

    fd = hold_shared(ckpt / checkpoint_folder.MARKER)
    held_cache = hold_shared(cache / loader.META)
    assert not checkpoint_folder.remove_unless_read(ckpt) and ckpt.is_dir()  # being read: stays
    loader._remove_unheld_cache(cache)
    assert cache.is_dir()
    os.close(fd)
    os.close(held_cache)

    _no_locks(monkeypatch)
    loader._remove_unheld_cache(cache)
    assert cache.is_dir()  # a running reader may use it: kept
    assert checkpoint_folder.remove_unless_read(ckpt) and not ckpt.exists()  # retention must go on
    monkeypatch.undo()
    loader._remove_unheld_cache(cache)
    assert not cache.exists()  # nobody holds it


def test_readers_of_a_folder_without_locks(tmp_path: Path, monkeypatch):
    """checkpoint_folder.reading on a filesystem without locks reads unprotected, and still says "removed" when
    the folder is gone."""
    from memtrain.errors import CheckpointError
    from memtrain.parallel import checkpoint_folder

    ckpt = tmp_path / "checkpoints" / "global_step3"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoint_folder.MARKER).write_text("{}")
    info = checkpoint_folder.CheckpointInfo(path=ckpt, step=3, permanent=False, world_size=1)
    _no_locks(monkeypatch)
    with checkpoint_folder.reading(info) as got:
        assert got is info
    (ckpt / checkpoint_folder.MARKER).unlink()
    with pytest.raises(CheckpointError, match="was removed while it was being read"):
        with checkpoint_folder.reading(info):
            pass
