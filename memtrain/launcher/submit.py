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
from memtrain.launcher.metrics import ATTEMPTS

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "memtrain.sbatch"
_SAFE = re.compile(r"[A-Za-z0-9_.,:+=@/%-]+")


def _directive_value(key: str, value: str) -> str:
    if not _SAFE.fullmatch(value):
        raise RecipeError(key, f"{value!r} has characters that are not allowed in an #SBATCH line")
    return value


def _ranks_per_node(s) -> int:
    """Ranks on each node of the job: one per GPU, or ``slurm.tasks_per_node`` for a CPU job (default 1)."""
    return s.tasks_per_node or s.gpus_per_node or 1


def render(recipe: Recipe, recipe_path: str, workdir: Optional[str] = None, python: Optional[str] = None) -> str:
    """The sbatch script for ``recipe`` that trains from ``recipe_path``.

    GPU jobs (``slurm.gpus_per_node`` > 0) request the GPUs and run one rank per GPU; CPU jobs
    (``gpus_per_node: 0``) request none and run ``slurm.tasks_per_node`` ranks (default 1) on gloo.
    ``OMP_NUM_THREADS`` is each rank's share: ``slurm.cpus_per_task``. With ``launcher: torchrun`` one
    task per node runs :mod:`memtrain.launcher.torchrun` (torchrun that survives the preemption signal),
    with a rendezvous id and port taken from the job id, so two jobs on one node never meet."""
    s = recipe.slurm
    if not TEMPLATE.is_file():
        raise LaunchError(f"sbatch template {TEMPLATE} is missing; reinstall memtrain from its repository "
                          "(pip install -e .)")
    workdir = workdir or str(Path.cwd())
    python = python or sys.executable
    ranks_per_node = _ranks_per_node(s)
    directives = []
    if s.gpus_per_node:
        directives.append(f"#SBATCH --gpus-per-node={s.gpus_per_node}")
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
        ntasks, cpus = ranks_per_node, s.cpus_per_task
        launch = "srun --kill-on-bad-exit=1 " + shlex.join(train)
    else:
        ntasks, cpus = 1, s.cpus_per_task * ranks_per_node
        # One torchrun per node; the first node of the allocation hosts the rendezvous, on a port and
        # under an id of this job's own.
        launch = ('head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
                  "port=$((20000 + SLURM_JOB_ID % 20000))\n"
                  "srun --kill-on-bad-exit=1 " + shlex.join([
                      python, "-m", "memtrain.launcher.torchrun", "--nnodes", str(s.nodes),
                      "--nproc-per-node", str(ranks_per_node), "--rdzv-backend", "c10d"])
                  + ' --rdzv-id "memtrain-$SLURM_JOB_ID" --rdzv-endpoint "$head:$port" '
                  + shlex.join(["-m", "memtrain", "train", recipe_path]))
    values = {
        "job_name": _directive_value("slurm.job_name", s.job_name or recipe.run.name),
        "nodes": s.nodes, "ntasks_per_node": ntasks, "cpus_per_task": cpus, "omp_threads": s.cpus_per_task,
        "time": _directive_value("slurm.time", str(s.time)),
        "signal_seconds": s.signal_seconds,
        "directives": "\n".join(directives),
        "workdir": shlex.quote(workdir),
        "setup": "\n".join(s.setup),
        "launch": launch,
        "attempts": shlex.quote(str(recipe.run_dir.resolve() / ATTEMPTS)),
    }
    return string.Template(TEMPLATE.read_text(encoding="utf-8")).substitute(values)


def submit(recipe: Recipe, source_path: str, overrides: list[str], dry_run: bool = False) -> str:
    """Write the frozen recipe and the script under ``<run.dir>/slurm/`` and call sbatch. A submission
    sbatch rejects leaves nothing behind (the two files, and the folders this call created)."""
    s = recipe.slurm
    # The job's ranks must split the global batch: one recipe error now, not a failure at the job's start after
    # it waited in the queue.
    recipe.grad_accum_steps(s.nodes * _ranks_per_node(s))
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
    created = [p for p in (slurm_dir.parent, slurm_dir) if not p.exists()]
    slurm_dir.mkdir(parents=True, exist_ok=True)
    frozen.write_text(f"# frozen by memtrain submit from {source_path} {' '.join(overrides)}\n" + recipe.to_yaml(),
                      encoding="utf-8")
    script_path = slurm_dir / f"job-{stamp}.sbatch"
    script_path.write_text(script, encoding="utf-8")
    # The log path goes on sbatch's command line, not in an #SBATCH line, so it may contain spaces.
    result = subprocess.run([sbatch, "--parsable", f"--output={slurm_dir / '%x-%j.out'}", str(script_path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        for path in (script_path, frozen):
            path.unlink(missing_ok=True)
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                pass
        raise LaunchError(f"sbatch rejected the job ({result.stderr.strip() or f'exit {result.returncode}'}); "
                          "nothing was written; check the recipe's slurm section (`memtrain submit RECIPE "
                          "--dry-run` prints the script)")
    job = result.stdout.strip().split(";")[0]
    return f"submitted job {job}: {script_path} (logs in {slurm_dir})"
