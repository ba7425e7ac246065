"""The torchrun wrapper (``python -m memtrain.launcher.torchrun``), without Slurm: a 2-rank CPU run sent the
signals that ask for a checkpoint and a stop (SIGTERM, SIGUSR1) must checkpoint, record the attempt as
preempted and exit 0 with torchrun, which the batch script needs to requeue the job. Plain torchrun exited 1
with a traceback on SIGTERM, after terminating its workers (SIGKILL 30 s later, whether or not they were
writing a checkpoint). tests/test_slurm.py runs the wrapper inside real Slurm jobs with SIGUSR1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from memtrain.launcher.torchrun import AGENT_SIGNALS, torchrun_argv

RECIPE = {
    "run": {"name": "tr", "seed": 7},
    "model": {"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 32,
              "tie_embeddings": False},
    "data": {"sources": ["builtin"], "seq_len": 32, "val_fraction": 0.02,
             "tokenizer": {"vocab_size": 320, "model_type": "bpe"}},
    "train": {"max_steps": 100000, "global_batch_tokens": 256, "micro_batch_size": 2,
              "optimizer": {"lr": 3.0e-3}, "eval": {"every_steps": 100000, "batches": 1}},
    "checkpoint": {"every_steps": 100000},
    "logging": {"every_steps": 10},
}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_", "TORCHELASTIC_", "PET_"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torchrun")
    recipe = json.loads(json.dumps(RECIPE))
    recipe["data"]["dir"] = str(root / "data")
    path = root / "tr.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = subprocess.run([sys.executable, "-m", "memtrain", "prepare", str(path)], cwd=root, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signalled_torchrun_run_checkpoints_and_exits_0(recipe_file, tmp_path, sig):
    run = tmp_path / "run"
    log = tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "memtrain.launcher.torchrun", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "-m", "memtrain", "train", str(recipe_file),
           f"run.dir={run}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=recipe_file.parent, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            end = time.monotonic() + 300
            while "step 20/" not in log.read_text(errors="replace"):
                assert proc.poll() is None, f"torchrun ended before step 20:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < end, "no step 20 within 300 s"
                time.sleep(0.2)
            proc.send_signal(sig)  # to the agent alone, as srun delivers it to the task it started
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    assert "stopped by signal at step" in text
    records = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "end" and records[-1]["state"] == "preempted", records
    step = records[-1]["step"]
    assert (run / "checkpoints" / f"global_step{step}" / "COMPLETE.json").is_file()


def test_torchrun_is_told_to_leave_sigterm_to_the_wrapper():
    argv = ["--nproc-per-node", "2", "-m", "memtrain", "train", "r.yaml"]
    assert torchrun_argv(argv) == [f"--signals-to-handle={AGENT_SIGNALS}", *argv]
    assert "SIGTERM" not in AGENT_SIGNALS and "SIGUSR1" not in AGENT_SIGNALS
    # the wrapper's own setting goes first: torchrun keeps the last, so a caller's own setting wins
    from torch.distributed.run import get_args_parser

    mine = ["--signals-to-handle=SIGTERM", *argv]
    assert get_args_parser().parse_args(torchrun_argv(mine)).signals_to_handle == "SIGTERM"
