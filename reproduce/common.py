"""What the reproduction scripts (``reproduce/hmem.py``, ``reproduce/titans.py``) share: running the
``memtrain`` CLI as a user would, reading its evaluation reports, and writing the results as JSON, a
Markdown table and a PNG plot.

Every training and evaluation goes through the real commands (``memtrain prepare / train / eval``) in a
subprocess, so a reproduction exercises exactly what a user runs; this module only orchestrates and
reports. Imports the standard library at module level; matplotlib only in :func:`save_plot`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent


class ReproError(RuntimeError):
    """A step of a reproduction failed; the message names the command and its last output lines."""


def memtrain(*args: str, log: Path, cwd: Path = ROOT, env: Optional[dict] = None) -> float:
    """Run ``python -m memtrain ARGS`` in ``cwd``, appending its output to ``log``; returns the seconds it
    took. ReproError with the last 20 output lines when it fails."""
    cmd = [sys.executable, "-m", "memtrain", *map(str, args)]
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ memtrain {' '.join(map(str, args))}\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **(env or {})})
        f.write(proc.stdout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-20:])
        raise ReproError(f"`memtrain {' '.join(map(str, args))}` failed (exit {proc.returncode}); "
                         f"full output in {log}:\n{tail}")
    return time.perf_counter() - start


def newest_eval(run_dir: Path) -> dict[str, Any]:
    """The newest ``<run_dir>/eval/global_stepN.json`` written by ``memtrain eval``."""
    files = sorted((run_dir / "eval").glob("global_step*.json"),
                   key=lambda p: int(p.stem.removeprefix("global_step")))
    if not files:
        raise ReproError(f"{run_dir}/eval holds no report; run `memtrain eval` on the run first")
    try:
        return json.loads(files[-1].read_text())
    except ValueError as e:
        raise ReproError(f"{files[-1]} is not valid JSON ({e}); delete it and run the script again, which "
                         "evaluates the arm anew") from None


def pct(x: Optional[float]) -> str:
    """``0.123`` -> ``"12.3%"``; ``None`` -> ``"–"``."""
    return "–" if x is None else f"{100 * x:.1f}%"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells are written with ``str``."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def write_results(out_dir: Path, stem: str, payload: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write ``<out_dir>/<stem>.json`` and ``<out_dir>/<stem>.md``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    js.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    md.write_text(markdown.rstrip() + "\n")
    return js, md


def save_plot(path: Path, series: dict[str, tuple[Sequence[float], Sequence[Optional[float]]]], *, xlabel: str,
              ylabel: str, title: str, xticks: Optional[Sequence[float]] = None,
              xticklabels: Optional[Sequence[str]] = None, logx: bool = False,
              ylim: Optional[tuple[float, float]] = None) -> Path:
    """A line plot of ``{label: (xs, ys)}`` (``None`` values are skipped) written as PNG; ``ylim`` fixes
    the y range (accuracies: the whole 0-1 or 0-100 scale, so that noise is not drawn as an effect)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for label, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if xticks is not None:
        ax.set_xticks(list(xticks))
        if xticklabels is not None:
            ax.set_xticklabels(list(xticklabels))
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def argv_overrides(overrides: dict[str, Any]) -> list[str]:
    """``{"train.max_steps": 10, "memory.levels": [4, 2]}`` -> ``["train.max_steps=10", "memory.levels=[4,2]"]``."""
    out = []
    for k, v in overrides.items():
        if isinstance(v, (list, tuple)):
            v = "[" + ",".join(map(str, v)) + "]"
        elif v is None:
            v = "null"
        elif isinstance(v, bool):
            v = "true" if v else "false"
        out.append(f"{k}={v}")
    return out


def run_script(main: Callable[[], Any], name: str) -> None:
    """Run a reproduction's ``main``; a failed step is one line on stderr (with the command's last output
    lines) and exit status 2."""
    try:
        main()
    except ReproError as e:
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(2)
