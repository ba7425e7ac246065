"""The suite's skip policy (tests/conftest.py): only ``gpu``- and ``slurm``-marked tests may skip; any
other skip or xfail fails the run, so a broken install of a hard dependency cannot pass as skipped.
Checked by running pytest with this conftest on a throwaway test file, in one process and as ``make test`` runs
the suite (two pytest-xdist workers: the markers are seen where tests are collected, the policy is judged by the
controller)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
INI = """[pytest]
markers =
    gpu: a CUDA device
    slurm: a working Slurm
"""


XDIST = [[], ["-n", "2", "--dist", "loadfile"]]


def _run(tmp_path: Path, body: str, xdist: list[str]) -> subprocess.CompletedProcess:
    for name in ("conftest.py", "triton_interpreter.py"):  # the conftest and the helper it imports
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_sample.py").write_text("import pytest\n\n\ndef test_ok():\n    pass\n\n\n" + body)
    env = {k: v for k, v in os.environ.items() if k != "MEMTRAIN_GPU_TIER_ON_CPU"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the sample's gpu test skips on a GPU machine too
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *xdist],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("xdist", XDIST, ids=["one process", "xdist"])
def test_gpu_and_slurm_tests_skip_with_their_reason(tmp_path, xdist):
    out = _run(tmp_path, xdist=xdist, body="@pytest.mark.gpu\ndef test_needs_gpu():\n    pass\n\n\n"
                         "@pytest.mark.slurm\ndef test_needs_slurm():\n    pass\n")
    from conftest import _slurm_reason

    assert out.returncode == 0, out.stdout
    assert "needs a CUDA GPU: the GPU tier runs with `pytest -m gpu`" in out.stdout
    if _slurm_reason() is None:  # a working Slurm: its test runs
        assert "2 passed, 1 skipped" in out.stdout
    else:
        assert "1 passed, 2 skipped" in out.stdout and "needs Slurm: " in out.stdout


@pytest.mark.parametrize("xdist", XDIST, ids=["one process", "xdist"])
def test_any_other_skip_or_xfail_fails_the_run(tmp_path, xdist):
    body = ("def test_optional_dependency():\n    pytest.importorskip('a_package_that_is_not_installed')\n\n\n"
            "@pytest.mark.xfail(reason='known bug')\ndef test_known_bug():\n    assert False\n")
    out = _run(tmp_path, body, xdist)
    assert out.returncode == 1, out.stdout
    assert "skips that are not allowed (only gpu- and slurm-marked tests may skip)" in out.stdout
    assert "test_sample.py::test_optional_dependency (skipped: Skipped: could not import 'a_package_that_is_not_installed'" \
        in out.stdout
    assert "test_sample.py::test_known_bug (xfail: known bug)" in out.stdout
