"""`memtrain submit`: render the sbatch template in ``slurm/`` from a recipe and submit it.

The resolved recipe (overrides applied) is frozen into ``<run.dir>/slurm/recipe-<time>.yaml`` and the
job trains from that copy, so editing the source recipe later does not change a queued job. Values
that reach a shell command are quoted with :func:`shlex.quote`; values that reach ``#SBATCH`` lines
are checked against a conservative character set, since sbatch directives are not shell-parsed.
"""

from __future__ import annotations

import re
import shlex
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from memtrain.config import Recipe, RecipeError
from memtrain.errors import LaunchError

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "memtrain.sbatch"
_SAFE = re.compile(r"[A-Za-z0-9_.,:+=@/%-]+")


def _directive_value(key: str, value: str) -> str:
    if not _SAFE.fullmatch(value):
        raise RecipeError(key, f"{value!r} has characters that are not allowed in an #SBATCH line")
    return value


def render(recipe: Recipe, recipe_path: str, workdir: Optional[str] = None, python: Optional[str] = None) -> str:
    """The sbatch script for ``recipe`` that trains from ``recipe_path``."""
    s = recipe.slurm
    if not TEMPLATE.is_file():
        raise LaunchError(f"sbatch template {TEMPLATE} is missing; reinstall memtrain from its repository "
                          "(pip install -e .)")
    workdir = workdir or str(Path.cwd())
    python = python or sys.executable
    directives = []
    for key in ("partition", "account", "qos"):
        value = getattr(s, key)
        if value:
            directives.append(f"#SBATCH --{key}={_directive_value(f'slurm.{key}', value)}")
    if s.exclusive:
        directives.append("#SBATCH --exclusive")
    for i, d in enumerate(s.directives):
        if not re.fullmatch(r"--[A-Za-z-]+(=[A-Za-z0-9_.,:+=@/%-]+)?", d):
            raise RecipeError(f"slurm.directives[{i}]", f"{d!r} is not an sbatch option of the form --name=value")
        directives.append(f"#SBATCH {d}")
    train = [python, "-m", "memtrain", "train", recipe_path]
    if s.launcher == "srun":
        ntasks = s.gpus_per_node
        launch = "srun --kill-on-bad-exit=1 " + shlex.join(train)
    else:
        ntasks = 1
        # One torchrun per node; the first node of the allocation hosts the rendezvous.
        launch = ('head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
                  "srun --kill-on-bad-exit=1 " + shlex.join([
                      python, "-m", "torch.distributed.run", "--nnodes", str(s.nodes),
                      "--nproc-per-node", str(s.gpus_per_node), "--rdzv-backend", "c10d",
                      "--rdzv-id", recipe.run.name]) + ' --rdzv-endpoint "$head:29500" ' +
                  shlex.join(["-m", "memtrain", "train", recipe_path]))
    values = {
        "job_name": _directive_value("slurm.job_name", s.job_name or recipe.run.name),
        "nodes": s.nodes, "ntasks_per_node": ntasks, "gpus_per_node": s.gpus_per_node,
        "cpus_per_task": s.cpus_per_task if s.launcher == "srun" else s.cpus_per_task * s.gpus_per_node,
        "time": _directive_value("slurm.time", s.time),
        "directives": "\n".join(directives),
        "workdir": shlex.quote(workdir),
        "setup": "\n".join(s.setup),
        "launch": launch,
    }
    return string.Template(TEMPLATE.read_text(encoding="utf-8")).substitute(values)


def submit(recipe: Recipe, source_path: str, overrides: list[str], dry_run: bool = False) -> str:
    """Write the frozen recipe and the script under ``<run.dir>/slurm/`` and call sbatch."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slurm_dir = (recipe.run_dir / "slurm").resolve()
    frozen = slurm_dir / f"recipe-{stamp}.yaml"
    script = render(recipe, str(frozen))
    if dry_run:
        return script
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise LaunchError("sbatch was not found on PATH; run `memtrain submit` on a Slurm login node, or use "
                          "--dry-run to print the script")
    slurm_dir.mkdir(parents=True, exist_ok=True)
    frozen.write_text(f"# frozen by memtrain submit from {source_path} {' '.join(overrides)}\n" + recipe.to_yaml(),
                      encoding="utf-8")
    script_path = slurm_dir / f"job-{stamp}.sbatch"
    script_path.write_text(script, encoding="utf-8")
    # The log path goes on sbatch's command line, not in an #SBATCH line, so it may contain spaces.
    result = subprocess.run([sbatch, "--parsable", f"--output={slurm_dir / '%x-%j.out'}", str(script_path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise LaunchError(f"sbatch rejected {script_path}: {result.stderr.strip()}")
    job = result.stdout.strip().split(";")[0]
    return f"submitted job {job}: {script_path} (logs in {slurm_dir})"
