"""The package's layers (.importlinter, README "Architecture"): `lint-imports` passes on the tree, and
each contract breaks when a forbidden import is added to a copy of the package.

The mutations are written into a copy under tmp_path (memtrain/, tools/, .importlinter) and
lint-imports runs there: it puts its working directory first on sys.path, so the copy, not the
installed package, is analysed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.import_contracts import forbidden_uses  # needs import-linter: the dev extras (make install)

REPO = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(LINT + ["--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_lint_imports_passes():
    out = lint(REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "Contracts: 5 kept, 0 broken." in out.stdout, out.stdout[-3000:]


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layers")
    shutil.copytree(REPO / "memtrain", root / "memtrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", root / ".importlinter")
    return root


# (file to change, code appended inside a function, the contract that must break, text in the report)
MUTATIONS = {
    "model imports data": ("memtrain/model/anchor.py", "from memtrain.data import loader",
                           "Layers", "memtrain.model.anchor -> memtrain.data.loader"),
    "data imports the launcher": ("memtrain/data/prepare.py", "from memtrain.launcher import metrics",
                                  "Layers", "memtrain.data.prepare -> memtrain.launcher.metrics"),
    "parallel imports eval": ("memtrain/parallel/bank.py", "import memtrain.eval.common",
                              "Layers", "memtrain.parallel.bank -> memtrain.eval.common"),
    "config imports model": ("memtrain/config.py", "import memtrain.model.flops",
                             "Layers", "memtrain.config -> memtrain.model.flops"),
    "kernels import config": ("memtrain/kernels/__init__.py", "from memtrain import config",
                              "memtrain.kernels imports nothing", "memtrain.kernels -> memtrain.config"),
    "model imports deepspeed": ("memtrain/model/flops.py", "import deepspeed",
                                "memtrain.model imports no DeepSpeed", "memtrain.model.flops -> deepspeed"),
    "model imports torch.distributed": ("memtrain/model/titans/memory.py", "import torch.distributed as dist",
                                        "free of distribution", "memtrain.model.titans.memory uses torch.distributed"),
    "a circle in parallel": ("memtrain/parallel/checkpoint_folder.py", "from memtrain.parallel import checkpoint",
                             "No import circles", ".checkpoint_folder -> .checkpoint"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_forbidden_import_breaks_a_contract(copy, name):
    rel, code, contract, report = MUTATIONS[name]
    path = copy / rel
    original = path.read_text()
    try:
        path.write_text(original + f"\n\ndef _added_by_test():\n    {code}  # noqa\n")
        out = lint(copy)
    finally:
        path.write_text(original)
    assert out.returncode != 0, out.stdout[-3000:]
    # An upward import also closes a circle between the two layers: that contract may break as well.
    broken = out.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and report in broken, broken[-3000:]


def test_forbidden_uses_reads_every_spelling():
    src = '''
import torch
import torch.distributed as dist
from torch.distributed import barrier
from torch import distributed, nn


def f():
    import deepspeed.comm
    torch.distributed.all_reduce(x)
    torch.nn.functional.relu(x)
'''
    found = forbidden_uses(src, ["torch.distributed", "deepspeed"])
    assert found == [(3, "torch.distributed"), (4, "torch.distributed"), (5, "torch.distributed"),
                     (9, "deepspeed"), (10, "torch.distributed")]
    clean = "import torch\nfrom torch import nn\nx = torch.nn.Linear(2, 2)\n"
    assert forbidden_uses(clean, ["torch.distributed"]) == []
