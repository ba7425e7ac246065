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
    assert "#SBATCH --time=2-00:00:00" in script and "#SBATCH --signal=USR1@120" in script
    assert "cd '/work dir'" in script and "module load cuda" in script
    assert ("srun --kill-on-bad-exit=1 /venv/bin/python -m memtrain train '/shared/my runs/recipe $HOME.yaml'"
            in script)
    assert "${" not in script.replace('"$SLURM_JOB_NODELIST"', "")


def test_render_torchrun_script_runs_one_task_per_node():
    recipe = recipe_from_dict({"run": {"name": "exp2"}, "slurm": {"nodes": 3, "gpus_per_node": 8,
                                                                  "launcher": "torchrun"}})
    script = render(recipe, "/r.yaml", workdir="/w", python="python")
    assert "#SBATCH --ntasks-per-node=1" in script
    assert "-m torch.distributed.run --nnodes 3 --nproc-per-node 8" in script
    assert '--rdzv-endpoint "$head:29500" -m memtrain train /r.yaml' in script


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
        submit(recipe_from_dict({"run": {"name": "x"}}), "r.yaml", [])
    assert not (tmp_path / "runs").exists()


def test_submit_writes_frozen_recipe_and_script_and_calls_sbatch(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho "4242;cluster"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text("run: {name: sub}\ntrain: {max_steps: 10}\n")
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
    recipe_path.write_text("run: {name: dry}\n")
    assert main(["submit", str(recipe_path), "--dry-run"]) == 0
    assert "#SBATCH --job-name=dry" in capsys.readouterr().out
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
}


def _directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].partition("=")
            out[key] = value
    return out


@pytest.mark.parametrize("kind", sorted(RENDERED))
def test_rendered_scripts_pass_bash_n_and_run_the_exact_command(kind, tmp_path):
    """`bash -n` accepts every rendered script; run under bash with stand-ins for srun and scontrol, the
    script changes into the work directory and hands srun exactly the intended argv (quoting checked by
    the shell itself, paths with spaces, quotes and $ included)."""
    import json
    import subprocess

    recipe_dict, recipe_path = RENDERED[kind]
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

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    (bin_dir / "srun").write_text("#!/usr/bin/env python3\nimport json, os, sys\n"
                                  f"json.dump({{'argv': sys.argv[1:], 'cwd': os.getcwd()}}, open({str(record)!r}, 'w'))\n")
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\nnode-b\\nnode-c\\n'\n")
    (bin_dir / "module").write_text("#!/bin/sh\n")
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "HOME": "/home/someone", "SLURM_JOB_NODELIST": "node-[a-c]"}
    ran = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    got = json.loads(record.read_text())
    assert got["cwd"] == str(workdir)
    d = _directives(script)
    if kind == "srun":
        assert got["argv"] == ["--kill-on-bad-exit=1", "/venv/bin/python", "-m", "memtrain", "train", recipe_path]
        assert d == {"--job-name": "exp1", "--nodes": "2", "--ntasks-per-node": "4", "--gpus-per-node": "4",
                     "--cpus-per-task": "8", "--time": "2-00:00:00", "--signal": "USR1@120", "--requeue": "",
                     "--partition": "gpu", "--account": "proj-1", "--constraint": "h100", "--exclusive": ""}
    else:
        assert got["argv"] == ["--kill-on-bad-exit=1", "/venv/bin/python", "-m", "torch.distributed.run",
                               "--nnodes", "3", "--nproc-per-node", "8", "--rdzv-backend", "c10d", "--rdzv-id", "exp2",
                               "--rdzv-endpoint", "node-a:29500", "-m", "memtrain", "train", recipe_path]
        assert d == {"--job-name": "exp2", "--nodes": "3", "--ntasks-per-node": "1", "--gpus-per-node": "8",
                     "--cpus-per-task": "64", "--time": d["--time"], "--signal": "USR1@120", "--requeue": "",
                     "--exclusive": ""}


@pytest.mark.slurm
def test_rendered_script_passes_sbatch_test_only(tmp_path):
    """Where Slurm runs, sbatch itself validates the script without queueing it."""
    import subprocess

    script = render(recipe_from_dict({"run": {"name": "check"}, "slurm": {"nodes": 1, "gpus_per_node": 0}}),
                    "/r.yaml", workdir=str(tmp_path))
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "to start at" in (out.stdout + out.stderr), out.stderr
