"""`memtrain submit`: sbatch rendering, quoting, and submission through a stand-in sbatch."""

import os
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
    with pytest.raises(RecipeError) as err:
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
