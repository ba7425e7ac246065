"""Fixtures shared by several test modules (opt in per module with ``pytest.mark.usefixtures``), and the
suite's skip policy.

Skip policy: a test may be skipped only when it is marked ``gpu`` (no CUDA device here) or ``slurm`` (no
working ``sbatch``); both are skipped here, at collection, with the reason. Any other skip (an
``importorskip`` of a broken install, a ``pytest.skip`` inside a test, an xfail) fails the run: the
session's exit status becomes 1 and the summary lists the offenders. ``MEMTRAIN_GPU_TIER_ON_CPU=1``
runs the ``gpu`` tier on CPU (to check the tier's own code where no GPU is at hand). ``make test`` runs the
suite on two pytest-xdist workers, one test file per worker at a time (``-n 2 --dist loadfile``; module fixtures
stay on one worker): the skip markers are applied where tests are collected (the workers) and travel with each
report (``user_properties``) to where the policy is judged (the controller, or the one process without xdist).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Without a GPU, Triton kernels run under the interpreter. Set before anything imports triton: triton.language
# builds its own jit functions (tl.sum, tl.max, ...) at import, in the mode the variable gives then.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # nested device-function calls skip Triton's redundant re-patching of triton.language (tests/triton_interpreter.py)
    from triton_interpreter import install as _install_interpreter_speedup

    _install_interpreter_speedup()

# pytest-xdist workers share the cores (``make test``: 2 workers on 2 cores): each worker, and each process a test
# starts (training runs read OMP_NUM_THREADS: memtrain.parallel.dist.cpu_threads), takes its share of intra-op
# threads, unless OMP_NUM_THREADS is set already. A thread pool larger than the cores it gets spin-waits at every
# parallel region: a tiny training run beside one busy process took 14.5 s with 2 threads, 8.4 s with 1.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    from memtrain.parallel.dist import cpu_threads

    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(cpu_threads(_workers, {})))
    torch.set_num_threads(cpu_threads(_workers))

ALLOWED_SKIP_MARKERS = ("gpu", "slurm")
SKIP_ALLOWED = "memtrain_skip_allowed"  # a user property on the reports of gpu- and slurm-marked tests


def _slurm_reason() -> str | None:
    """Why Slurm cannot run jobs here, or None when ``sbatch`` and a controller answer."""
    if shutil.which("sbatch") is None:
        return "no sbatch on PATH (Slurm is not installed)"
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol ping failed ({e})"
    if out.returncode != 0 or "UP" not in out.stdout:
        return f"no Slurm controller answers (scontrol ping: {(out.stdout + out.stderr).strip()[:200]})"
    return None


class SkipPolicy:
    """The skip policy of the module docstring, as a plugin (registered in :func:`pytest_configure`)."""

    def __init__(self, config) -> None:
        self.worker = hasattr(config, "workerinput")  # an xdist worker: it collects and runs, the controller judges
        self.bad: list[str] = []

    def pytest_collection_modifyitems(self, config, items):
        gpu_reason = None
        if not torch.cuda.is_available() and os.environ.get("MEMTRAIN_GPU_TIER_ON_CPU") != "1":
            gpu_reason = "needs a CUDA GPU: the GPU tier runs with `pytest -m gpu` on a GPU machine"
        slurm_reason = _slurm_reason() if any(item.get_closest_marker("slurm") for item in items) else None
        for item in items:
            if gpu_reason and item.get_closest_marker("gpu"):
                item.add_marker(pytest.mark.skip(reason=gpu_reason))
            if slurm_reason and item.get_closest_marker("slurm"):
                item.add_marker(pytest.mark.skip(reason=f"needs Slurm: {slurm_reason}"))
        for item in items:
            if any(item.get_closest_marker(m) for m in ALLOWED_SKIP_MARKERS):
                item.user_properties.append((SKIP_ALLOWED, True))  # copied into each of its reports

    def pytest_runtest_logreport(self, report):
        if self.worker or not report.skipped or (SKIP_ALLOWED, True) in report.user_properties:
            return
        if hasattr(report, "wasxfail"):
            self.bad.append(f"{report.nodeid} (xfail: {report.wasxfail})")
        else:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.bad.append(f"{report.nodeid} (skipped: {reason})")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if self.bad and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.bad:
            terminalreporter.section("skips that are not allowed (only gpu- and slurm-marked tests may skip)",
                                     red=True)
            for line in self.bad:
                terminalreporter.line(line, red=True)


def pytest_configure(config):
    config.pluginmanager.register(SkipPolicy(config), "memtrain-skip-policy")


def streaming_dataset(**kwargs):
    """A ``StreamingDataset`` built under memtrain's host lock, as the loader builds its own
    (``memtrain.data.loader._host_prefix_lock``): Streaming picks a shared-memory prefix by scanning ``/dev/shm``,
    so a test's dataset built beside another xdist worker's training run could take the same prefix
    (``FileExistsError: .../NNNNNN_locals`` in that run)."""
    from streaming import StreamingDataset

    from memtrain.data.loader import _host_prefix_lock

    with _host_prefix_lock():
        return StreamingDataset(**kwargs)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors run fastest on one intra-op thread: more threads only spin-wait when other processes
    share the cores (5x slower under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def poison_empty(monkeypatch):
    """``poison_empty(module)``: the Triton kernels' wrapper module's ``_empty`` (every buffer its kernels write)
    returns NaN-filled tensors for this test, so an element a kernel leaves unwritten shows in the result."""
    def nan_empty(*shape, device, dtype=torch.float32):
        return torch.full(shape, float("nan"), device=device, dtype=dtype)

    def poison(module):
        monkeypatch.setattr(module, "_empty", nan_empty)
        return module
    return poison


@pytest.fixture
def tiny_titans_recipe():
    """``tiny_titans_recipe(variant="mac", n_layers=2, **titans)``: a Titans LM recipe small enough for the Triton
    kernels under the interpreter (d_model 24, 2 heads, 40 tokens of vocabulary, 32-token sequences; a 2-head memory
    with chunks of 3 and MAC segments of 8, 2 persistent tokens, ``kernel: triton``); ``titans`` overrides or adds
    ``model.titans`` keys."""
    from memtrain.config import recipe_from_dict

    def make(variant: str = "mac", n_layers: int = 2, **titans):
        return recipe_from_dict({
            "model": {"type": "titans", "vocab_size": 40, "d_model": 24, "n_layers": n_layers, "n_heads": 2,
                      "ffn_dim": 48, "max_seq_len": 32,
                      "titans": {"variant": variant, "memory_heads": 2, "memory_chunk_size": 3, "segment_len": 8,
                                 "persistent_tokens": 2, "memory_max_lr": 0.1, "memory_init_lr": 0.05,
                                 "kernel": "triton", **titans}},
            "data": {"seq_len": 32, "tokenizer": {"vocab_size": 40}}})
    return make


class _OpNames(TorchDispatchMode):
    """Records the names of the operators (ATen's and custom ones) that run within it, in order: ``names``."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def op_names():
    """``with op_names() as ops:`` records the operators that run inside the block in ``ops.names``."""
    return _OpNames
