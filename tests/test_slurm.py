"""`memtrain submit` against a real one-node Slurm (tools/slurm-local.sh, which .ci/run starts), five CPU
jobs of 2 ranks on gloo at once: one that trains to the end (torchrun launcher), one preempted with
`scancel -s USR1` (the signal to the job's steps; srun launcher), one with `scancel -b -s USR1` (the
batch shell, as `--signal=B:USR1@...` does before the time limit; torchrun launcher, beside the first:
two torchrun jobs on one node must not meet in one rendezvous) and one with `scancel -s TERM` (the job's
steps, as on preemption; torchrun launcher, whose agent exited 1 on SIGTERM before it was told to leave that
signal to the wrapper). The preempted jobs must checkpoint, requeue themselves and finish with the
uninterrupted job's final loss. The fifth is cancelled (`scancel JOB`): it must checkpoint and stay cancelled (it
used to requeue itself and train on). Marked ``slurm``: skipped, saying
why, where no Slurm answers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 300
RECIPE = {
    "run": {"name": "sl", "seed": 7},
    "model": {"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 32,
              "tie_embeddings": False},
    "data": {"sources": ["builtin"], "seq_len": 32, "val_fraction": 0.02,
             "tokenizer": {"vocab_size": 320, "model_type": "bpe"}},
    "train": {"max_steps": STEPS, "global_batch_tokens": 256, "micro_batch_size": 2,
              "optimizer": {"lr": 3.0e-3}, "schedule": {"kind": "cosine", "warmup": "2 steps", "min_lr": 3.0e-4},
              "eval": {"every_steps": 150, "batches": 2}},
    "checkpoint": {"every_steps": 200, "keep_last": 3},
    "logging": {"every_steps": 50},
    "slurm": {"gpus_per_node": 0, "tasks_per_node": 2, "cpus_per_task": 1, "time": 20, "exclusive": False},
}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def _memtrain(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "memtrain", *args], cwd=root, env=_env(), capture_output=True,
                         text=True, timeout=600)
    if check:
        assert out.returncode == 0, f"{args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _job(text: str) -> str:
    m = re.search(r"submitted job (\d+)", text)
    assert m, text
    return m.group(1)


def _job_info(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
    return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)


def _log(run: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run / "slurm").glob("*.out")))


def _wait(predicate, what: str, timeout: float = 900.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _final(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), steps  # one row per step across the restart
    return rows[-1]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Five jobs submitted together: ``plain`` (torchrun) runs through; ``steps`` (srun) gets USR1 on its
    job steps, ``batch`` (torchrun) USR1 on its batch shell, ``term`` (torchrun) TERM on its job steps and
    ``cancel`` (srun) a plain ``scancel`` once they have logged step 100."""
    root = tmp_path_factory.mktemp("slurm")
    recipe = json.loads(json.dumps(RECIPE))
    recipe["data"]["dir"] = str(root / "data")
    (root / "sl.yaml").write_text(yaml.safe_dump(recipe))
    _memtrain(root, "prepare", "sl.yaml")
    runs = {name: root / "runs" / name for name in ("plain", "steps", "batch", "term", "cancel")}
    ids = {}
    for name, run in runs.items():
        extra = ["slurm.launcher=torchrun"] if name in ("plain", "batch", "term") else []
        ids[name] = _job(_memtrain(root, "submit", "sl.yaml", f"run.dir={run}", *extra).stdout)
    # each signalled as soon as it logs step 100 (a run takes ~15 s)
    pending = {"steps": ["--signal=USR1"], "batch": ["--signal=USR1", "--batch"], "term": ["--signal=TERM"],
               "cancel": []}

    def signal_those_at_step_100() -> bool:
        for name in list(pending):
            if "step 100/" in _log(runs[name]):
                subprocess.run(["scancel", *pending.pop(name), ids[name]], check=True, timeout=30)
            elif _job_info(ids[name]).get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING"):
                raise AssertionError(f"job {ids[name]} ({name}) ended before step 100:\n{_log(runs[name])[-3000:]}")
        return not pending

    _wait(signal_those_at_step_100, "jobs {steps}, {batch}, {term} and {cancel} to reach step 100".format(**ids))
    for job in ids.values():
        _wait(lambda job=job: _job_info(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
              f"job {job} to end")
    return root, runs, ids


def test_a_cpu_job_of_two_ranks_trains_to_the_end(jobs):
    root, runs, ids = jobs
    info = _job_info(ids["plain"])
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", info  # never requeued when done
    run = runs["plain"]
    log = _log(run)
    assert "2 rank(s) via torchrun on cpu (fp32)" in log and f"step {STEPS}/{STEPS}" in log
    assert "Traceback" not in log
    assert sorted(p.name for p in (run / "checkpoints").glob("global_step*")) == ["global_step200",
                                                                                  f"global_step{STEPS}"]
    assert (run / "checkpoints" / f"global_step{STEPS}" / "COMPLETE.json").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert _final(run)["step"] == STEPS
    script = next((run / "slurm").glob("job-*.sbatch")).read_text()
    assert "--gpus-per-node" not in script and "--nproc-per-node 2" in script


@pytest.mark.parametrize("name", ["steps", "batch", "term"])
def test_a_preempted_job_checkpoints_requeues_itself_and_finishes_as_uninterrupted(jobs, name):
    root, runs, ids = jobs
    info = _job_info(ids[name])
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    log = _log(runs[name])
    assert "(restart 0)" in log and "(restart 1)" in log  # one log, appended to by the restart
    assert re.search(r"stopped by signal at step \d+ \(checkpoint written\)", log)
    assert "requeueing job" in log and "resuming from" in log
    assert "Traceback" not in log and "KeyError" not in log, log[-4000:]
    if name == "batch":
        assert "memtrain: SIGUSR1 at" in log and "via torchrun" in log  # the shell forwarded it; torchrun lived
    elif name == "term":
        assert "via torchrun" in log and "SignalException" not in log  # torchrun lived and exited 0
    else:
        assert "via slurm" in log
    want, got = _final(runs["plain"]), _final(runs[name])
    assert got["step"] == STEPS
    assert got["loss/train"] == pytest.approx(want["loss/train"], rel=0, abs=1e-5)
    assert got["loss/val"] == pytest.approx(want["loss/val"], rel=0, abs=1e-5)
    attempts = [json.loads(line) for line in (runs[name] / "attempts.jsonl").read_text().splitlines()]
    assert [(a["event"], a.get("state")) for a in attempts] == [
        ("start", None), ("end", "preempted"), ("start", None), ("end", "complete")]
    assert attempts[2]["slurm_restart_count"] == 1 and attempts[2]["resumed_from_step"] == attempts[1]["step"]
    status = _memtrain(root, "status", str(runs[name])).stdout
    assert "complete" in status and "1 restart(s)" in status


def test_a_cancelled_job_checkpoints_and_stays_cancelled(jobs):
    root, runs, ids = jobs
    info = _job_info(ids["cancel"])
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    log = _log(runs["cancel"])
    assert "memtrain: SIGTERM at" in log and re.search(r"stopped by signal at step \d+ \(checkpoint written\)", log)
    assert (f"job {ids['cancel']} was ended by Slurm (SIGTERM, reason None: cancelled or preempted), so it is not "
            "requeued") in log and "requeueing" not in log and "(restart 1)" not in log
    attempts = [json.loads(line) for line in (runs["cancel"] / "attempts.jsonl").read_text().splitlines()]
    assert [(a["event"], a.get("state")) for a in attempts] == [("start", None), ("end", "preempted")]
    assert (runs["cancel"] / "checkpoints" / f"global_step{attempts[1]['step']}" / "COMPLETE.json").is_file()


def test_a_rejected_submission_leaves_nothing_behind(tmp_path):
    """A GPU request on a node without GPUs: sbatch refuses it; no script, no frozen recipe, no run dir."""
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"run": {"name": "gpu"}, "slurm": {"gpus_per_node": 1,
                                                                                         "time": 5}}))
    out = _memtrain(tmp_path, "submit", "r.yaml", f"run.dir={tmp_path / 'run'}", check=False)
    assert out.returncode == 2 and "sbatch rejected the job" in out.stderr and "nothing was written" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]
