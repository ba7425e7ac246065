"""`make install` checks the disk before it builds the environment (tools/check_space.py, the Makefile).

A full disk used to fail minutes into pip with "[Errno 28] No space left on device" and leave a half-filled
`.venv`; now it is one line, exit 2, before the environment is created.
"""

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from tools import check_space

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "check_space.py")
Usage = collections.namedtuple("Usage", "total used free")


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=cwd)


def test_enough_space_passes_and_too_little_is_one_line(tmp_path, monkeypatch):
    seen = []

    def usage(path):
        seen.append(path)
        return Usage(100e9, 90e9, 7.5e9)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # pip's temporary folder on the same file system
    monkeypatch.setattr(tempfile, "tempdir", None)
    venv = str(tmp_path / "a" / "b" / ".venv")
    assert check_space.problem(venv, 7) is None
    message = check_space.problem(venv, 8)
    # The nearest existing directory is measured: the venv and its parents do not exist yet.
    assert seen == [str(tmp_path), str(tmp_path)]
    assert message == (
        f"make install: 7.5 GB free on the file system of {tmp_path}, but the virtual environment {venv} "
        "needs about 8 GB (PyTorch's CUDA build and its NVIDIA libraries); free some space, or put the "
        "environment on a larger disk with `make VENV=/path/to/venv ...` (`INSTALL_GB=0` skips this check)"
    )
    assert "\n" not in message
    assert check_space.problem(venv, 0) is None  # 0 skips: disk_usage is not even asked
    assert len(seen) == 2


def test_a_temporary_folder_on_another_file_system_is_checked_for_the_downloads(tmp_path, monkeypatch):
    """pip keeps the downloaded wheels (3.8 GB at the peak) in TMPDIR: on another file system, that one needs
    TEMP_GB and the environment's the rest."""
    venv_fs, temp = tmp_path / "disk", tmp_path / "scratch"
    venv_fs.mkdir()
    temp.mkdir()
    free = {str(venv_fs): 7.5e9, str(temp): 3.9e9}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100e9, 0, free[path]))
    monkeypatch.setattr(check_space, "device", lambda path: 1 if path == str(venv_fs) else 2)
    venv = str(venv_fs / ".venv")
    assert check_space.problem(venv, 11, str(temp)) == (
        f"make install: 3.9 GB free on the file system of the temporary folder {temp}, but pip needs about 4 GB "
        "there for the packages it downloads; free some space, or point TMPDIR at a larger disk (`TMPDIR=/path/to/tmp "
        "make ...`) (`INSTALL_GB=0` skips this check)")
    free[str(temp)] = 4e9
    assert check_space.problem(venv, 11, str(temp)) is None  # 7 GB here, 4 there: enough
    assert check_space.problem(venv, 11.6, str(temp)).startswith(
        f"make install: 7.5 GB free on the file system of {venv_fs}, but the virtual environment {venv} needs about "
        "7.6 GB ")
    monkeypatch.setattr(check_space, "device", lambda path: 1)  # the same file system: all 11 GB on it
    assert check_space.problem(venv, 11, str(temp)).startswith(f"make install: 7.5 GB free on the file system of "
                                                              f"{venv_fs}, but the virtual environment {venv} needs "
                                                              "about 11 GB ")
    monkeypatch.setenv("TMPDIR", str(temp))  # the default follows TMPDIR, as pip's does
    monkeypatch.setattr(tempfile, "tempdir", None)  # Python caches the folder it found first
    monkeypatch.setattr(check_space, "device", lambda path: 1 if path == str(venv_fs) else 2)
    free[str(temp)] = 1e9
    assert str(temp) in check_space.problem(venv, 11)


def test_command_line(tmp_path):
    venv = str(tmp_path / ".venv")
    ok = run(venv, "0.001")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "", "")
    full = run(venv, "1e9")  # a billion GB: no disk has it
    assert full.returncode == 2 and full.stdout == ""
    assert full.stderr.count("\n") == 1 and full.stderr.startswith("make install: ")
    assert "Traceback" not in full.stderr
    for bad in ("abc", "-1", "nan", "inf"):
        out = run(venv, bad)
        assert out.returncode == 2
        assert out.stderr == f"make install: INSTALL_GB={bad!r} is not a number of gigabytes (0 skips the check)\n"
    assert run(venv).returncode == 2
    assert not os.path.exists(venv)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_install_stops_before_creating_the_environment(tmp_path):
    """The Makefile runs the check before `python -m venv`, so a refusal leaves no environment behind."""
    venv = tmp_path / "venv"
    # Under `make test` this make is a sub-make: without make's own variables it behaves as when typed.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(
        ["make", "-s", "install", f"VENV={venv}", "INSTALL_GB=1e9"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env=env,
    )
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\* ", line)]
    assert len(lines) == 1 and lines[0].startswith("make install: ") and str(venv) in lines[0]
    assert not venv.exists()
    # An existing environment is not checked again (a reinstall after setup.py changes needs little space).
    dry = subprocess.run(["make", "-n", "install", f"VENV={venv}"], capture_output=True, text=True, cwd=ROOT, env=env)
    install = [line for line in dry.stdout.splitlines() if "check_space" in line or " -m venv " in line]
    assert len(install) == 2 and "check_space.py" in install[0] and " -m venv " in install[1]
    assert all(line.startswith(f"test -x {venv}/bin/python || ") for line in install)
    assert "--no-cache-dir" in dry.stdout
