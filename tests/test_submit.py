"""`memtrain submit`: sbatch rendering, quoting, and submission through a stand-in sbatch."""

import os
import re
import stat
from pathlib import Path

import pytest

from memtrain.config import RecipeError, recipe_from_dict
from memtrain.errors import LaunchError
from memtrain.launcher.cli import main
from memtrain.launcher.submit import render, submit


def test_render_srun_script_quotes_shell_values():
    recipe = recipe_from_dict({"run": {"name": "exp1"}, "slurm": {
        "nodes": 2, "gpus_per_node": 4, "partition": "gpu", "account": "proj-1", "time": "2-00:00:00",
        "directives": ["--constraint=h100"], "setup": ["module load cuda"]}})
    script = render(recipe, "/shared/my runs/recipe $HOME.yaml", workdir="/work dir", python="/venv/bin/python")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=4" in script
    assert "#SBATCH --gpus-per-node=4" in script and "#SBATCH --partition=gpu" in script
    assert "#SBATCH --account=proj-1" in script and "#SBATCH --constraint=h100" in script
    assert "#SBATCH --time=2-00:00:00" in script and "#SBATCH --signal=B:USR1@120" in script
    assert "#SBATCH --open-mode=append" in script and "#SBATCH --requeue" in script
    assert "cd '/work dir'" in script and "module load cuda" in script
    assert ("srun --kill-on-bad-exit=1 /venv/bin/python -m memtrain train '/shared/my runs/recipe $HOME.yaml'"
            in script)
    assert re.search(r"\$\{[a-z_]+\}", script) is None  # every template placeholder filled (the shell's are upper case)


def test_render_torchrun_script_runs_one_task_per_node():
    recipe = recipe_from_dict({"run": {"name": "exp2"}, "slurm": {"nodes": 3, "gpus_per_node": 8,
                                                                  "launcher": "torchrun"}})
    script = render(recipe, "/r.yaml", workdir="/w", python="python")
    assert "#SBATCH --ntasks-per-node=1" in script
    assert "-m memtrain.launcher.torchrun --nnodes 3 --nproc-per-node 8" in script
    assert '--rdzv-id "memtrain-$SLURM_JOB_ID" --rdzv-endpoint "$head:$port" -m memtrain train /r.yaml' in script


@pytest.mark.parametrize("slurm, key", [
    ({"partition": "gpu\n#SBATCH --x"}, "slurm.partition"),
    ({"directives": ["--mail-user=a b"]}, "slurm.directives[0]"),
    ({"job_name": "a;rm -rf"}, "slurm.job_name"),
])
def test_unsafe_directive_values_are_rejected(slurm, key):
    recipe = recipe_from_dict({"slurm": slurm})
    with pytest.raises(RecipeError, match=rf"^recipe error: {re.escape(key)}") as err:
        render(recipe, "/r.yaml", workdir="/w")
    assert err.value.key == key


def test_submit_without_sbatch_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchError, match="sbatch was not found"):
        submit(recipe_from_dict({"run": {"name": "x"}, "train": {"micro_batch_size": 4}}), "r.yaml", [])
    assert not (tmp_path / "runs").exists()


def test_submit_writes_frozen_recipe_and_script_and_calls_sbatch(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho "4242;cluster"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text("run: {name: sub}\ntrain: {max_steps: 10, micro_batch_size: 4}\n")
    assert main(["submit", str(recipe_path), "train.max_steps=50"]) == 0
    assert "submitted job 4242" in capsys.readouterr().out
    slurm_dir = tmp_path / "runs" / "sub" / "slurm"
    (frozen,) = slurm_dir.glob("recipe-*.yaml")
    (script,) = slurm_dir.glob("job-*.sbatch")
    assert "max_steps: 50" in frozen.read_text()
    assert str(frozen) in script.read_text()
    assert (fake.parent / "args").read_text().split() == ["--parsable", f"--output={slurm_dir}/%x-%j.out",
                                                          str(script)]


def test_dry_run_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text("run: {name: dry}\ntrain: {micro_batch_size: 4}\n")
    assert main(["submit", str(recipe_path), "--dry-run"]) == 0
    assert "#SBATCH --job-name=dry" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_a_batch_the_jobs_ranks_cannot_split_is_refused_before_sbatch(tmp_path, monkeypatch, capsys):
    """The default slurm section (8 GPUs) and the default batch (32 sequences of micro-batches of 8) do not fit:
    the job would have failed at its start after waiting in the queue. memtrain submit says so first."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text("run: {name: split}\n")
    assert main(["submit", "r.yaml", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (
        "memtrain: recipe error: train.global_batch_tokens: 32 sequences per step (global_batch_tokens 65536 / "
        "data.seq_len 2048) do not divide into micro-batches of train.micro_batch_size 8 x 8 ranks; choose a global "
        "batch that is a multiple of 131072 tokens")
    assert main(["submit", "r.yaml", "--dry-run", "slurm.nodes=2", "train.micro_batch_size=2"]) == 0  # 32 / (2 x 16)
    assert main(["submit", "r.yaml", "--dry-run", "slurm.gpus_per_node=0", "slurm.tasks_per_node=3"]) == 2
    assert "8 x 3 ranks" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_template_ships_with_the_repository():
    from memtrain.launcher import submit as mod

    assert Path(mod.TEMPLATE).is_file()


# --------------------------------------------------------------------------------------------------
# The rendered scripts as bash reads and runs them (not only as text)

RENDERED = {
    "srun": ({"run": {"name": "exp1"}, "slurm": {
        "nodes": 2, "gpus_per_node": 4, "partition": "gpu", "account": "proj-1", "time": "2-00:00:00",
        "directives": ["--constraint=h100"], "setup": ["module load cuda", "export NCCL_DEBUG=WARN"]}},
        "/shared/my runs/recipe $HOME.yaml"),
    "torchrun": ({"run": {"name": "exp2"}, "slurm": {"nodes": 3, "gpus_per_node": 8, "launcher": "torchrun",
                                                     "exclusive": True}}, "/r's.yaml"),
    "cpu": ({"run": {"name": "exp3"}, "slurm": {"gpus_per_node": 0, "tasks_per_node": 2, "cpus_per_task": 3,
                                                "time": 30, "exclusive": False, "signal_seconds": 60}}, "/r.yaml"),
}


def _directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].partition("=")
            out[key] = value
    return out


def _stand_ins(tmp_path: Path, preempted: bool) -> tuple[dict, Path]:
    """srun, scontrol and module stand-ins: srun records its argv, working directory and environment and,
    with ``preempted``, writes the trainer's "preempted" attempt record; scontrol prints node names and
    records a requeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "record.json"
    attempts = tmp_path / "run" / "attempts.jsonl"
    end = {"event": "end", "time": 1.0, "state": "preempted" if preempted else "complete", "step": 3}
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env python3\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
        f"os.makedirs({str(attempts.parent)!r}, exist_ok=True)\n"
        f"open({str(attempts)!r}, 'a').write(json.dumps({end!r}) + '\\n')\n")
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\nif [ \"$1\" = requeue ]; then echo \"$2\" > \"$(dirname \"$0\")/requeued\"; exit 0; fi\n"
        "printf 'node-a\\nnode-b\\nnode-c\\n'\n")
    (bin_dir / "module").write_text("#!/bin/sh\n")
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "HOME": "/home/someone", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node-[a-c]", "TMPDIR": str(tmp_path / "tmp")}
    return env, record


@pytest.mark.parametrize("kind", sorted(RENDERED))
def test_rendered_scripts_pass_bash_n_and_run_the_exact_command(kind, tmp_path):
    """`bash -n` accepts every rendered script; run under bash with stand-ins for srun and scontrol, the
    script changes into the work directory, exports the per-job caches and thread count, and hands srun
    exactly the intended argv (quoting checked by the shell itself: paths with spaces, quotes and $)."""
    import json
    import subprocess

    recipe_dict, recipe_path = RENDERED[kind]
    recipe_dict = json.loads(json.dumps(recipe_dict))
    recipe_dict["run"]["dir"] = str(tmp_path / "run")
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    script = render(recipe_from_dict(recipe_dict), recipe_path, workdir=str(workdir), python="/venv/bin/python")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    broken = tmp_path / "broken.sbatch"
    broken.write_text(script.replace("cd ", "cd '", 1))  # the negative control: bash -n does read it
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True).returncode != 0

    env, record = _stand_ins(tmp_path, preempted=False)
    ran = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "memtrain: job 4242 starts on " in ran.stdout and "(restart 0)" in ran.stdout
    assert "requeueing" not in ran.stdout and not (tmp_path / "bin" / "requeued").exists()  # complete: no requeue
    got = json.loads(record.read_text())
    assert got["cwd"] == str(workdir)
    job_tmp = str(tmp_path / "tmp" / "memtrain-4242")
    assert got["env"]["TMPDIR"] == job_tmp and got["env"]["TRITON_CACHE_DIR"] == job_tmp + "/triton"
    assert got["env"]["TORCH_EXTENSIONS_DIR"] == job_tmp + "/torch_extensions"
    assert not Path(job_tmp).exists()  # removed when the job ends
    d = _directives(script)
    if kind == "srun":
        assert got["argv"] == ["--kill-on-bad-exit=1", "/venv/bin/python", "-m", "memtrain", "train", recipe_path]
        assert got["env"]["OMP_NUM_THREADS"] == "8"
        assert d == {"--job-name": "exp1", "--nodes": "2", "--ntasks-per-node": "4", "--gpus-per-node": "4",
                     "--cpus-per-task": "8", "--time": "2-00:00:00", "--signal": "B:USR1@120", "--requeue": "",
                     "--open-mode": "append", "--partition": "gpu", "--account": "proj-1",
                     "--constraint": "h100", "--exclusive": ""}
    elif kind == "torchrun":
        assert got["argv"] == ["--kill-on-bad-exit=1", "/venv/bin/python", "-m", "memtrain.launcher.torchrun",
                               "--nnodes", "3", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                               "--rdzv-id", "memtrain-4242", "--rdzv-endpoint", f"node-a:{20000 + 4242}",
                               "-m", "memtrain", "train", recipe_path]
        assert got["env"]["OMP_NUM_THREADS"] == "8"  # per worker: the task's 64 CPUs over 8 workers
        assert d["--ntasks-per-node"] == "1" and d["--cpus-per-task"] == "64" and d["--gpus-per-node"] == "8"
    else:  # a CPU job: no GPU request, two ranks per node
        assert "--gpus-per-node" not in d and d["--ntasks-per-node"] == "2" and d["--cpus-per-task"] == "3"
        assert d["--time"] == "30" and d["--signal"] == "B:USR1@60" and got["env"]["OMP_NUM_THREADS"] == "3"


def test_a_preempted_run_requeues_its_job(tmp_path):
    """The trainer recorded its attempt as preempted (it stopped at a checkpoint before train.max_steps):
    the batch script requeues the job with scontrol."""
    import subprocess

    recipe = recipe_from_dict({"run": {"name": "p", "dir": str(tmp_path / "run")}, "slurm": {"gpus_per_node": 0}})
    path = tmp_path / "job.sbatch"
    path.write_text(render(recipe, "/r.yaml", workdir=str(tmp_path), python="python"))
    env, _ = _stand_ins(tmp_path, preempted=True)
    ran = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "stopped at a checkpoint before train.max_steps: requeueing job 4242" in ran.stdout
    assert (tmp_path / "bin" / "requeued").read_text().strip() == "4242"


def test_a_restart_that_fails_before_recording_its_attempt_is_not_requeued(tmp_path):
    """A requeued job whose restart fails before the trainer records its attempt (a damaged checkpoint, missing
    data, a bad node) finds the previous job's "preempted" line last in attempts.jsonl: it used to requeue itself
    forever. The script requeues only when the launcher exited 0 and this job appended the record. srun also
    gets the job's CPUs per task (SRUN_CPUS_PER_TASK: Slurm 22.05 stopped passing them on)."""
    import json
    import subprocess

    recipe = recipe_from_dict({"run": {"name": "p", "dir": str(tmp_path / "run")},
                               "slurm": {"gpus_per_node": 0, "cpus_per_task": 3}})
    path = tmp_path / "job.sbatch"
    path.write_text(render(recipe, "/r.yaml", workdir=str(tmp_path), python="python"))
    env, record = _stand_ins(tmp_path, preempted=True)
    attempts = tmp_path / "run" / "attempts.jsonl"
    attempts.parent.mkdir()
    srun = tmp_path / "bin" / "srun"
    working = srun.read_text()
    for code, writes in ((2, False), (0, False), (3, True)):  # failed at start; exited 0 silently; failed later
        attempts.write_text(json.dumps({"event": "end", "time": 0.5, "state": "preempted", "step": 2}) + "\n")
        srun.write_text("#!/usr/bin/env python3\nimport json, os, sys\n"
                        f"json.dump({{'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
                        + (f"open({str(attempts)!r}, 'a').write(json.dumps({{'event': 'end', 'state': 'preempted'}}) + "
                           "'\\n')\n" if writes else "")
                        + f"sys.exit({code})\n")
        ran = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert ran.returncode == code, (code, ran.stderr)
        assert "requeueing" not in ran.stdout and not (tmp_path / "bin" / "requeued").exists(), code
        assert f"training exited with status {code}" in ran.stdout
    assert json.loads(record.read_text())["env"]["SRUN_CPUS_PER_TASK"] == "3"
    srun.write_text(working)  # the stand-in that records "preempted" and exits 0: requeued
    attempts.write_text(json.dumps({"event": "end", "time": 0.5, "state": "complete", "step": 2}) + "\n")
    ran = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ran.returncode == 0 and (tmp_path / "bin" / "requeued").read_text().strip() == "4242", ran.stdout


@pytest.mark.parametrize("reason", ["None", "TimeLimit"])
def test_a_job_slurm_ends_is_requeued_only_at_its_time_limit(tmp_path, reason):
    """SIGTERM to the batch shell: Slurm is ending the job. The run checkpoints either way (the shell forwards the
    signal); the shell requeues only when scontrol gives the time limit as the reason. `scancel JOB` (Reason=None)
    used to requeue the job it cancelled, which then trained on."""
    import json
    import signal
    import subprocess
    import time

    recipe = recipe_from_dict({"run": {"name": "p", "dir": str(tmp_path / "run")}, "slurm": {"gpus_per_node": 0}})
    path = tmp_path / "job.sbatch"
    path.write_text(render(recipe, "/r.yaml", workdir=str(tmp_path), python="python"))
    env, _ = _stand_ins(tmp_path, preempted=True)
    attempts = tmp_path / "run" / "attempts.jsonl"
    ready = tmp_path / "ready"
    # srun: trains until SIGTERM reaches it, then records the stop at a checkpoint and exits 0, as the trainer does
    (tmp_path / "bin" / "srun").write_text(
        "#!/usr/bin/env python3\nimport json, os, signal, time\n"
        "stop = []\nsignal.signal(signal.SIGTERM, lambda *a: stop.append(1))\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "while not stop:\n    time.sleep(0.05)\n"
        f"os.makedirs({str(attempts.parent)!r}, exist_ok=True)\n"
        f"open({str(attempts)!r}, 'a').write(json.dumps({{'event': 'end', 'state': 'preempted', 'step': 5}})"
        " + '\\n')\n")
    (tmp_path / "bin" / "scontrol").write_text(
        "#!/bin/sh\nif [ \"$1\" = requeue ]; then echo \"$2\" > \"$(dirname \"$0\")/requeued\"; exit 0; fi\n"
        f"if [ \"$1\" = show ]; then echo \"JobId=4242 JobState=COMPLETING Reason={reason} Dependency=(null)\"; "
        "exit 0; fi\n"
        "printf 'node-a\\n'\n")
    job = subprocess.Popen(["bash", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           cwd=tmp_path)
    end = time.monotonic() + 60
    while not ready.exists():
        assert job.poll() is None and time.monotonic() < end, job.communicate()
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "memtrain: SIGTERM at " in out
    assert json.loads(attempts.read_text().splitlines()[-1])["state"] == "preempted"  # it checkpointed
    requeued = tmp_path / "bin" / "requeued"
    if reason == "TimeLimit":
        assert "requeueing job 4242" in out and requeued.read_text().strip() == "4242"
    else:
        assert not requeued.exists() and "requeueing" not in out
        assert ("job 4242 was ended by Slurm (SIGTERM, reason None: cancelled or preempted), so it is not requeued; "
                "submit it again to resume") in out


@pytest.mark.slurm
def test_rendered_script_passes_sbatch_test_only(tmp_path):
    """Where Slurm runs, sbatch itself validates the script without queueing it."""
    import subprocess

    script = render(recipe_from_dict({"run": {"name": "check"}, "slurm": {
        "nodes": 1, "gpus_per_node": 0, "cpus_per_task": 1, "time": 5, "exclusive": False}}),
        "/r.yaml", workdir=str(tmp_path))
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "to start at" in (out.stdout + out.stderr), out.stderr


def test_overrides_stand_anywhere_on_the_command_line(tmp_path, monkeypatch, capsys):
    """key=value after a sub-command's flags (argparse alone rejected them), and slurm.time=3 meaning three
    minutes as in sbatch (it was a type error)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text("run: {name: anywhere}\ntrain: {micro_batch_size: 4}\n")
    assert main(["submit", "r.yaml", "--dry-run", "slurm.time=3", "slurm.gpus_per_node=0"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --time=3\n" in script and "--gpus-per-node" not in script
    assert main(["recipe", "show", "r.yaml", "--world-size", "1", "train.max_steps=77"]) == 0
    assert "max_steps: 77" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="2"):
        main(["submit", "r.yaml", "--dry-run", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert main(["submit", "r.yaml", "--dry-run", "slurm.time=30:00"]) == 0  # MM:SS, not YAML's base-60 1800
    assert "#SBATCH --time=30:00\n" in capsys.readouterr().out
    assert main(["submit", "r.yaml", "--dry-run", "slurm.time=1:2:3:4"]) == 2
    assert "recipe error: slurm.time: expected a Slurm time" in capsys.readouterr().err
    assert main(["submit", "r.yaml", "--dry-run", "slurm.time=2", "slurm.signal_seconds=120"]) == 2
    assert "slurm.signal_seconds: 120 s is not shorter than slurm.time 2 (120 s)" in capsys.readouterr().err
    assert main(["submit", "r.yaml", "--dry-run", "slurm.gpus_per_node=4", "slurm.tasks_per_node=2"]) == 2
    assert "recipe error: slurm.tasks_per_node: is 2 but a GPU job runs one rank per GPU" in capsys.readouterr().err
