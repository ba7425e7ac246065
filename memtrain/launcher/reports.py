"""Reports on run directories: ``memtrain status RUN_DIR`` and ``memtrain scaling RUN_DIR...``.

:func:`run_status` reads what a run directory holds without touching it: ``recipe.yaml`` (the resolved
recipe the trainer wrote), ``metrics.jsonl`` (one row per logged step, ``null`` for a non-finite value),
the checkpoints (:func:`memtrain.parallel.checkpoint_folder.list_checkpoints`), ``attempts.jsonl`` (one
``start`` object per start of the trainer and one ``end`` object per orderly end) and ``run.lock``.
:func:`format_status` turns it into a few aligned lines.

:func:`scaling_report` compares runs of one recipe on different numbers of ranks from their TensorBoard
scalars and writes ``scaling.md`` and ``scaling.png``. Conventions (the notes under the table repeat them):

- Warm-up: the first ``max(2, ceil(10%))`` logged steps of a run are left out, and the first logged step
  after each resume (``attempts.jsonl``; a resumed process warms up again: compilation, caches), but at
  least one logged step is kept; every number is the median over the remaining logged steps.
- World size: ``throughput/tokens_per_sec / throughput/device/tokens_per_sec`` of each logged step (the
  trainer logs the second as the first divided by the ranks), else the newest complete checkpoint's
  ``world_size``, else the last ``start`` of ``attempts.jsonl``. A run whose logged steps ran on several
  world sizes is reported over the steps of its last world size, with a note.
- Scaling efficiency: tokens/s per device of a run over tokens/s per device of the run with the fewest
  ranks (the first of them given, when several share that size).
- Step-time split: the median over steps of ``time/<part>_s / throughput/step_time_s``.
- Communication: ``comm/anchor_bytes_sent`` and ``comm/bank_bytes_sent`` are rank 0's bytes of one step.

Imports stay light: TensorBoard's reader and matplotlib are imported inside the functions that use them.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from memtrain.errors import MemtrainError
from memtrain.launcher.metrics import ATTEMPTS
from memtrain.parallel.checkpoint_folder import (
    MARKER, damaged_checkpoints, fallback, latest_checkpoint, list_checkpoints,
)
from memtrain.parallel.run_lock import LOCK, stale_reason

METRICS = "metrics.jsonl"
RECIPE = "recipe.yaml"
TENSORBOARD = "tensorboard"
THROUGHPUT_WINDOW = 5  # status: tokens/s is the mean over this many last logged steps
SPLIT_PARTS = ("forward", "backward", "optimizer", "data")  # time/<part>_s


class ReportError(MemtrainError):
    """A run directory that cannot be reported on (missing, empty, or without logged steps)."""


# --------------------------------------------------------------------------------------------------
# Reading a run directory


def _read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of ``path``, one a line; a torn or unparsable line (a kill mid-write) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _read_recipe(run_dir: Path) -> Optional[dict]:
    """``<run_dir>/recipe.yaml`` as plain data (``yaml.safe_load``), or None when absent or unreadable."""
    path = run_dir / RECIPE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _recipe_max_steps(recipe: Optional[dict]) -> Optional[int]:
    """``train.max_steps`` in steps (a token duration converted as the trainer does), or None."""
    if not recipe:
        return None
    from memtrain.config import RecipeError, recipe_from_dict

    try:
        return recipe_from_dict(recipe).max_steps
    except (RecipeError, TypeError, ValueError):
        raw = (recipe.get("train") or {}).get("max_steps")
        return raw if isinstance(raw, int) else None


def _check_run_dir(run_dir: Path) -> None:
    if not run_dir.exists():
        raise ReportError(f"run directory {run_dir} does not exist; pass the run.dir of a training run "
                          "(the recipe's run.dir, by default runs/<run.name>)")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; pass the run.dir of a training run (the recipe's "
                          "run.dir, by default runs/<run.name>)")
    if not any((run_dir / name).exists() for name in (METRICS, ATTEMPTS, RECIPE, TENSORBOARD, "checkpoints", LOCK)):
        raise ReportError(f"{run_dir} holds no training run (no {METRICS}, {ATTEMPTS}, {RECIPE}, {TENSORBOARD}/ or "
                          "checkpoints/); pass the run.dir that `memtrain train` wrote (the recipe's run.dir, by "
                          "default runs/<run.name>)")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _last_value(rows: list[dict], key: str) -> tuple[Optional[float], Optional[int]]:
    """(the last finite value of ``key`` in ``rows``, its step)."""
    for row in reversed(rows):
        if _finite(row.get(key)):
            return float(row[key]), row.get("step")
    return None, None


def _recent_mean(rows: list[dict], key: str, n: int = THROUGHPUT_WINDOW) -> Optional[float]:
    """Mean of the last ``n`` finite values of ``key``."""
    values = [float(r[key]) for r in rows if _finite(r.get(key))][-n:]
    return sum(values) / len(values) if values else None


def _lock_state(run_dir: Path) -> Optional[dict]:
    """``run.lock``'s holder and whether it runs: ``{"host", "pid", "alive"}`` where ``alive`` is True or
    False on this host and None on another (it cannot be checked from here); None without a lock."""
    path = run_dir / LOCK
    if not path.is_file():
        return None
    unreadable = {"host": None, "pid": None, "alive": None, "unreadable": True}
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return unreadable
    if not isinstance(holder, dict):
        return unreadable
    host = holder.get("host")
    here = socket.gethostname()
    alive = None
    if host == here and isinstance(holder.get("pid"), int):
        alive = stale_reason(holder, {"host": here, "slurm_job_id": None}) is None
    return {"host": host, "pid": holder.get("pid"), "alive": alive}


def _attempts(run_dir: Path) -> list[dict]:
    """The starts of ``attempts.jsonl``, each with its ``end`` (the next end event before the next start),
    or None when it has none. An end with no start of its own (its start line torn or lost) is an attempt
    too, marked ``"start_lost": True`` with no start fields: dropping it counted one restart too few and
    reported the previous attempt's end as the run's state."""
    out: list[dict] = []
    for event in _read_jsonl(run_dir / ATTEMPTS):
        kind = event.get("event")
        if kind == "start":
            out.append({**{k: v for k, v in event.items() if k != "event"}, "end": None})
        elif kind == "end":
            end = {k: v for k, v in event.items() if k != "event"}
            if out and out[-1]["end"] is None:
                out[-1]["end"] = end
            else:
                out.append({"start_lost": True, "end": end})
    return out


def _held(lock: dict) -> str:
    """Who holds a lock whose holder cannot be checked from here (another host, or a lock file that cannot be
    read: it used to say "held by pid None on None")."""
    if lock.get("unreadable"):
        return (f"{LOCK} exists but cannot be read (being written, or damaged: delete it if no trainer runs on "
                "this run.dir)")
    return f"{LOCK} is held by pid {lock['pid']} on {lock['host']} (another host: not checked)"


def _run_state(attempts: list[dict], lock: Optional[dict]) -> tuple[str, str]:
    """(state, detail). A live lock on this host means running; a start without an end is a crash,
    unless the lock is held on another host (then it may still be running)."""
    if lock is not None and lock["alive"]:
        return "running", f"pid {lock['pid']} on {lock['host']} holds {LOCK}"
    if not attempts:
        if lock is not None and lock["alive"] is None:
            return "unknown", _held(lock)
        return "unknown", f"no {ATTEMPTS} (written by newer trainers)"
    last = attempts[-1]
    if last["end"] is not None:
        end = last["end"]
        return str(end.get("state", "unknown")), f"at step {end.get('step')}"
    if lock is not None and lock["alive"] is None:
        return "running or crashed", f"the last start has no end; {_held(lock)}"
    return "crashed", f"the last start (pid {last.get('pid')} on {last.get('host')}) recorded no end"


def run_status(run_dir: str | Path) -> dict[str, Any]:
    """What ``run_dir`` holds, as a dict (see :func:`format_status` for the printed form). Keys: ``name``,
    ``run_dir``, ``max_steps``, ``last_step``, ``last_time`` (when that step was logged), ``tokens_seen``,
    ``loss_train`` / ``loss_train_step``, ``loss_val`` / ``loss_val_step``, ``nonfinite_steps``,
    ``tokens_per_sec`` / ``tokens_per_sec_device`` / ``mfu`` / ``step_time_s`` / ``data_wait_frac`` (means
    over the last :data:`THROUGHPUT_WINDOW` logged steps; None when not logged), ``checkpoints`` (complete:
    ``{"step", "permanent", "world_size", "path"}`` by step), ``incomplete_checkpoints`` (folder paths),
    ``damaged_checkpoints`` (``{"step", "path", "problem", "fix"}`` by step: a marker that exists but cannot be
    used; ``fix`` is the fallback a resume would name, or None for one older than the newest complete
    checkpoint), ``attempts`` (each start's fields with its ``end`` or None; ``start_lost`` for an end whose
    start line is torn), ``restarts`` (attempts minus one), ``state`` and ``state_detail``. Raises
    :class:`ReportError` for a missing or empty run directory."""
    run_dir = Path(run_dir)
    _check_run_dir(run_dir)
    recipe = _read_recipe(run_dir)
    rows = sorted(_read_jsonl(run_dir / METRICS), key=lambda r: r.get("step", 0) if _finite(r.get("step")) else 0)
    last = rows[-1] if rows else {}
    loss, loss_step = _last_value(rows, "loss/train")
    val, val_step = _last_value(rows, "loss/val")
    complete, incomplete = list_checkpoints(run_dir)
    damaged = damaged_checkpoints(run_dir)
    attempts = _attempts(run_dir)
    state, detail = _run_state(attempts, _lock_state(run_dir))
    name = ((recipe or {}).get("run") or {}).get("name") or run_dir.resolve().name
    return {
        "name": name,
        "run_dir": str(run_dir),
        "max_steps": _recipe_max_steps(recipe),
        "last_step": last.get("step"),
        "last_time": last.get("time"),
        "tokens_seen": int(last["progress/tokens_seen"]) if _finite(last.get("progress/tokens_seen")) else None,
        "loss_train": loss,
        "loss_train_step": loss_step,
        "loss_val": val,
        "loss_val_step": val_step,
        "nonfinite_steps": int(last["loss/nonfinite_steps"]) if _finite(last.get("loss/nonfinite_steps")) else 0,
        "tokens_per_sec": _recent_mean(rows, "throughput/tokens_per_sec"),
        "tokens_per_sec_device": _recent_mean(rows, "throughput/device/tokens_per_sec"),
        "mfu": _recent_mean(rows, "throughput/mfu"),
        "step_time_s": _recent_mean(rows, "throughput/step_time_s"),
        "data_wait_frac": _recent_mean(rows, "throughput/data_wait_frac"),
        "checkpoints": [{"step": c.step, "permanent": c.permanent, "world_size": c.world_size, "path": str(c.path)}
                        for c in complete],
        "incomplete_checkpoints": [str(p) for p in incomplete],
        # What a resume says of a damaged one newer than every complete one (it stops there); older ones are kept.
        "damaged_checkpoints": [{"step": d.step, "path": str(d.path), "problem": d.problem,
                                 "fix": fallback(d) if not complete or d.step > complete[-1].step else None}
                                for d in damaged],
        "attempts": attempts,
        "restarts": max(len(attempts) - 1, 0),
        "state": state,
        "state_detail": detail,
    }


# --------------------------------------------------------------------------------------------------
# Printing


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.1f}"


def _when(t: Any) -> str:
    if not _finite(t):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _ago(t: Any, now: float) -> str:
    if not _finite(t):
        return ""
    s = max(now - t, 0.0)
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= scale:
            return f"{s / scale:.1f} {unit} ago"
    return f"{s:.0f} s ago"


def _outcome(end: Optional[dict]) -> str:
    return f"{end.get('state', '?')} at step {end.get('step', '?')}" if end else "no end recorded"


def _attempt_line(i: int, a: dict) -> str:
    if a.get("start_lost"):
        end = a["end"]
        return f"#{i} {_when(end.get('time'))}  start not recorded (torn or missing line) -> {_outcome(end)}"
    where = f"{a.get('host', '?')} pid {a.get('pid', '?')}"
    if a.get("slurm_job_id"):
        where += f" job {a['slurm_job_id']}"
        if a.get("slurm_restart_count") is not None:
            where += f" restart {a['slurm_restart_count']}"
    start = "resumed at step {}".format(a["resumed_from_step"]) if a.get("resumed_from_step") is not None else "fresh"
    outcome = _outcome(a.get("end"))
    world = a.get("world_size", "?")
    return f"#{i} {_when(a.get('time'))}  {where}, {world} rank{'' if world == 1 else 's'}, {start} -> {outcome}"


def format_status(status: dict[str, Any], now: Optional[float] = None) -> str:
    """The status of :func:`run_status` as aligned ``label  value`` lines (``now``: the time ages are
    measured from, default the current time)."""
    now = time.time() if now is None else now
    s = status
    lines: list[tuple[str, str]] = [("run", f"{s['name']}  ({s['run_dir']})")]
    restarts = f"{len(s['attempts'])} start(s), {s['restarts']} restart(s)" if s["attempts"] else "no attempts recorded"
    lines.append(("state", f"{s['state']}: {s['state_detail']}; {restarts}"))
    if s["last_step"] is None:
        lines.append(("step", f"no step logged yet (of {s['max_steps'] if s['max_steps'] is not None else '?'})"))
    else:
        total = s["max_steps"] if s["max_steps"] is not None else "?"
        ago = _ago(s["last_time"], now)
        logged = f"logged {_when(s['last_time'])}" + (f" ({ago})" if ago else "")
        # A run stopped between logged steps (a signal, a crash after a save) got further than it logged.
        ends = [a["end"]["step"] for a in s["attempts"] if isinstance((a.get("end") or {}).get("step"), int)]
        reached = max([s["last_step"], *ends, *(c["step"] for c in s["checkpoints"])])
        pct = f" ({100 * reached / s['max_steps']:.0f}%)" if s["max_steps"] else ""
        if reached > s["last_step"]:
            lines.append(("step", f"{reached} / {total}{pct}; the last logged step {s['last_step']}, {logged}"))
        else:
            lines.append(("step", f"{reached} / {total}{pct}, {logged}"))
        if s["tokens_seen"] is not None:
            at = f", at step {s['last_step']}" if reached > s["last_step"] else ""
            lines.append(("tokens seen", f"{_si(s['tokens_seen'])} ({s['tokens_seen']}{at})"))
        loss = []
        if s["loss_train"] is not None:
            loss.append(f"train {s['loss_train']:.4f} (step {s['loss_train_step']})")
        if s["loss_val"] is not None:
            loss.append(f"val {s['loss_val']:.4f} (step {s['loss_val_step']})")
        if s["nonfinite_steps"]:
            loss.append(f"{s['nonfinite_steps']} non-finite step(s) skipped")
        lines.append(("loss", ", ".join(loss) or "none finite logged"))
        if s["tokens_per_sec"] is not None:
            tp = f"{_si(s['tokens_per_sec'])} tok/s"
            if s["tokens_per_sec_device"] is not None:
                tp += f", {_si(s['tokens_per_sec_device'])} tok/s per device"
            if s["mfu"] is not None:
                tp += f", MFU {100 * s['mfu']:.1f}%"
            if s["step_time_s"] is not None:
                tp += f", {s['step_time_s']:.3g} s/step"
            if s["data_wait_frac"] is not None:
                tp += f", data wait {100 * s['data_wait_frac']:.0f}%"
            lines.append(("throughput", tp + f" (mean of the last {THROUGHPUT_WINDOW} logged steps)"))
    if s["checkpoints"]:
        parts = [f"step {c['step']} ({c['world_size']} rank{'s' if c['world_size'] != 1 else ''}"
                 f"{', permanent' if c['permanent'] else ''})" for c in s["checkpoints"]]
        lines.append(("checkpoints", ", ".join(parts)))
    else:
        lines.append(("checkpoints", "none complete"))
    if s["incomplete_checkpoints"]:
        lines.append(("incomplete", ", ".join(Path(p).name for p in s["incomplete_checkpoints"])
                      + f" (no {MARKER}: never resumed from)"))
    for i, d in enumerate(s.get("damaged_checkpoints", [])):
        fix = d["fix"] or "older than the newest complete checkpoint: kept, never resumed from or pruned"
        lines.append(("damaged" if i == 0 else "", f"{Path(d['path']).name}: {d['problem']}; {fix}"))
    shown = s["attempts"][-5:]
    first = len(s["attempts"]) - len(shown) + 1
    for i, a in enumerate(shown):
        lines.append(("attempts" if i == 0 else "", _attempt_line(first + i, a)))
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in lines)


# --------------------------------------------------------------------------------------------------
# Scaling


def _read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag of ``<run_dir>/tensorboard`` as ``{tag: {step: value}}`` (the last value written
    for a step wins). Raises :class:`ReportError` when there are no event files."""
    tb = run_dir / TENSORBOARD
    if not tb.is_dir() or not any(tb.glob("events.out.tfevents.*")):
        raise ReportError(f"{run_dir} has no TensorBoard events ({tb}/events.out.tfevents.*); scaling reads them: "
                          "train with logging.tensorboard: true, or pass another run.dir")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # 0 keeps every scalar (the default samples 10,000); the other kinds are not read.
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0, "tensors": 1, "histograms": 1, "images": 1,
                                                   "audio": 1, "distributions": 1, "compressedHistograms": 1})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags().get("scalars", []):
        out[tag] = {int(e.step): float(e.value) for e in acc.Scalars(tag)}
    return out


def _median(values: list[float]) -> Optional[float]:
    values = [v for v in values if math.isfinite(v)]
    return statistics.median(values) if values else None


def warmup_skip(n: int) -> int:
    """Logged steps left out at the start of a run: ``max(2, ceil(n / 10))``, keeping at least one."""
    return max(min(max(2, math.ceil(n / 10)), n - 1), 0)


def _model_fields(recipe: Optional[dict]) -> dict[str, Any]:
    """The recipe keys that must agree for runs to be compared: the model and memory sections,
    ``train.global_batch_tokens`` and ``data.seq_len`` (flattened to dotted keys)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    recipe = recipe or {}
    walk("model", recipe.get("model") or {})
    walk("memory", recipe.get("memory") or {})
    flat["train.global_batch_tokens"] = (recipe.get("train") or {}).get("global_batch_tokens")
    flat["data.seq_len"] = (recipe.get("data") or {}).get("seq_len")
    return flat


def _run_scaling(run_dir: Path, notes: list[str]) -> dict[str, Any]:
    """One run's row of the scaling table (medians after warm-up; see the module docstring)."""
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} does not exist; pass the run.dir of a training run "
                          "(the recipe's run.dir, by default runs/<run.name>)")
    recipe = _read_recipe(run_dir)
    name = run_dir.resolve().name  # runs of one recipe share run.name: their folders tell them apart
    scalars = _read_scalars(run_dir)
    total = scalars.get("throughput/tokens_per_sec", {})
    steps = sorted(s for s, v in total.items() if math.isfinite(v))
    if not steps:
        raise ReportError(f"{run_dir} has TensorBoard events but no logged step (no throughput/tokens_per_sec "
                          "scalar); let the run log at least one step (logging.every_steps), or pass another run.dir")
    device = scalars.get("throughput/device/tokens_per_sec", {})

    # World size of each logged step, from the two throughputs the trainer logs (total = device x world).
    world_of = {s: round(total[s] / device[s]) for s in steps if device.get(s) and math.isfinite(device[s])}
    source = "logged throughput ratio"
    if world_of:
        final_world = world_of[max(world_of)]
        sizes = sorted(set(world_of.values()))
        if len(sizes) > 1:
            notes.append(f"{name}: its logged steps ran on {', '.join(map(str, sizes))} ranks; reported over the "
                         f"steps on {final_world} ranks (its last world size)")
        steps = [s for s in steps if world_of.get(s) == final_world]
        world = final_world
    else:
        ckpt = latest_checkpoint(run_dir, strict=False)  # its world size only
        starts = [a for a in _attempts(run_dir) if isinstance(a.get("world_size"), int)]
        if ckpt is not None:
            world, source = ckpt.world_size, "newest checkpoint"
        elif starts:
            world, source = starts[-1]["world_size"], ATTEMPTS
        else:
            raise ReportError(f"{run_dir}: cannot tell its world size (no throughput/device/tokens_per_sec scalar, "
                              f"no complete checkpoint, no {ATTEMPTS}); pass runs written by `memtrain train`")

    skip = warmup_skip(len(steps))
    kept = steps[skip:]
    for attempt in _attempts(run_dir):  # a resumed attempt's first logged step warms up again
        resumed = attempt.get("resumed_from_step")
        first = min((s for s in steps if isinstance(resumed, int) and s > resumed), default=None)
        if first in kept and len(kept) > 1:
            kept.remove(first)

    def med(tag: str) -> Optional[float]:
        values = scalars.get(tag)
        if not values:
            return None
        return _median([values[s] for s in kept if s in values])

    step_time = scalars.get("throughput/step_time_s", {})
    split: dict[str, Optional[float]] = {}
    for part in SPLIT_PARTS:
        values = scalars.get(f"time/{part}_s")
        split[part] = None if not values else _median(
            [values[s] / step_time[s] for s in kept if s in values and step_time.get(s)])
    tokens_per_sec = med("throughput/tokens_per_sec")
    per_device = med("throughput/device/tokens_per_sec")
    if per_device is None and tokens_per_sec is not None:
        per_device = tokens_per_sec / world
    return {
        "name": name,
        "run_dir": str(run_dir),
        "world_size": world,
        "world_size_source": source,
        "steps_logged": len(steps),
        "steps_used": len(kept),
        "first_step_used": kept[0],
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_device": per_device,
        "mfu": med("throughput/mfu"),
        "step_time_s": med("throughput/step_time_s"),
        "data_wait_frac": med("throughput/data_wait_frac"),
        "split": split,
        "anchor_bytes_sent": med("comm/anchor_bytes_sent"),
        "bank_bytes_sent": med("comm/bank_bytes_sent"),
        "recipe_fields": _model_fields(recipe) if recipe is not None else None,
    }


def _cell(value: Optional[float], fmt: str, scale: float = 1.0) -> str:
    return "" if value is None else format(value * scale, fmt)


COLUMNS = ("run", "ranks", "tokens/s", "tokens/s per device", "scaling efficiency (%)", "MFU (%)",
           "step time (s)", "data wait (%)", "forward (% of step)", "backward (% of step)",
           "optimizer (% of step)", "data (% of step)", "anchor sent per step (MB, rank 0)",
           "bank sent per step (MB, rank 0)", "steps used")


def _row_cells(r: dict[str, Any]) -> list[str]:
    return [
        r["name"], str(r["world_size"]), _cell(r["tokens_per_sec"], ".1f"), _cell(r["tokens_per_sec_device"], ".1f"),
        _cell(r["efficiency"], ".1f", 100), _cell(r["mfu"], ".1f", 100), _cell(r["step_time_s"], ".4f"),
        _cell(r["data_wait_frac"], ".1f", 100),
        *(_cell(r["split"][p], ".1f", 100) for p in SPLIT_PARTS),
        _cell(r["anchor_bytes_sent"], ".3f", 1e-6), _cell(r["bank_bytes_sent"], ".3f", 1e-6),
        f"{r['steps_used']} of {r['steps_logged']}",
    ]


def _recipe_notes(runs: list[dict], base: dict) -> list[str]:
    notes = []
    if base["recipe_fields"] is None:
        notes.append(f"{base['name']} has no {RECIPE}: recipes were not compared")
        return notes
    for r in runs:
        if r is base:
            continue
        if r["recipe_fields"] is None:
            notes.append(f"{r['name']} has no {RECIPE}: its model and batch were not compared with {base['name']}")
            continue
        keys = sorted(k for k in set(base["recipe_fields"]) | set(r["recipe_fields"])
                      if base["recipe_fields"].get(k) != r["recipe_fields"].get(k))
        if keys:
            shown = ", ".join(f"{k} {r['recipe_fields'].get(k)!r} instead of {base['recipe_fields'].get(k)!r}"
                              for k in keys[:4])
            more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
            notes.append(f"recipes differ: {r['name']} has {shown}{more} (vs {base['name']}); its efficiency "
                         "may compare different work per step")
    return notes


def _plot(runs: list[dict], base: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    worlds = [r["world_size"] for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        ideal_x = sorted(set(worlds))
        ax1.plot(ideal_x, [base["tokens_per_sec_device"] * w for w in ideal_x], "--", color="grey",
                 label=f"ideal (linear from {base['name']})")
        ax1.plot(worlds, [r["tokens_per_sec"] for r in runs], "o-", label="measured")
        for r in runs:
            ax1.annotate(r["name"], (r["world_size"], r["tokens_per_sec"]), fontsize=7,
                         textcoords="offset points", xytext=(4, 4))
        ax1.set_xlabel("world size (ranks)")
        ax1.set_ylabel("tokens/s (all ranks)")
        ax1.set_title("throughput")
        ax1.legend(fontsize=8)
        ax1.grid(alpha=0.3)
        ax2.axhline(100, linestyle="--", color="grey", label="ideal")
        ax2.plot(worlds, [100 * r["efficiency"] for r in runs], "o-", color="tab:orange", label="measured")
        ax2.set_xlabel("world size (ranks)")
        ax2.set_ylabel(f"scaling efficiency vs {base['world_size']} rank(s) (%)")
        ax2.set_ylim(bottom=0, top=max(110.0, *(100 * r["efficiency"] + 10 for r in runs)))
        ax2.set_title("tokens/s per device relative to the smallest run")
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3)
        for ax in (ax1, ax2):
            ax.set_xticks(ideal_x)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def scaling_report(run_dirs: list[str | Path], out_dir: str | Path) -> dict[str, Any]:
    """Compare ``run_dirs`` (runs of one recipe on different numbers of ranks) from their TensorBoard
    scalars; write ``<out_dir>/scaling.md`` (one row per run, sorted by world size) and
    ``<out_dir>/scaling.png`` (tokens/s against world size with the ideal line; efficiency). Returns
    ``{"runs": [row dicts, sorted], "baseline": name, "notes": [...], "markdown": path, "png": path}``;
    each row holds ``world_size``, ``tokens_per_sec``, ``tokens_per_sec_device``, ``efficiency``, ``mfu``,
    ``step_time_s``, ``data_wait_frac``, ``split`` (shares of the step time), ``anchor_bytes_sent``,
    ``bank_bytes_sent`` (None where not logged). Raises :class:`ReportError` naming the run at fault."""
    if not run_dirs:
        raise ReportError("scaling needs at least one run directory; pass the run.dirs of runs of one recipe "
                          "on different numbers of ranks")
    seen: dict[Path, str] = {}
    for d in run_dirs:  # the same run twice would count as two runs of one world size
        key = Path(d).resolve()
        if key in seen:
            also = f" (also as {seen[key]})" if seen[key] != str(d) else ""
            raise ReportError(f"{d} is given twice{also}; pass each run directory once")
        seen[key] = str(d)
    notes: list[str] = []
    runs = [_run_scaling(Path(d), notes) for d in run_dirs]
    if len({r["name"] for r in runs}) < len(runs):  # folders of the same name in different places
        for r in runs:
            r["name"] = r["run_dir"]
    runs.sort(key=lambda r: r["world_size"])  # stable: equal sizes keep the order given
    base = runs[0]
    for r in runs:
        ok = r["tokens_per_sec_device"] is not None and base["tokens_per_sec_device"]
        r["efficiency"] = r["tokens_per_sec_device"] / base["tokens_per_sec_device"] if ok else None
    notes = _recipe_notes(runs, base) + notes
    sources = sorted({r["world_size_source"] for r in runs})
    notes.append(f"scaling efficiency = tokens/s per device / that of {base['name']} ({base['world_size']} "
                 f"rank{'s' if base['world_size'] != 1 else ''}, the fewest)")
    notes.append("every number is the median over the logged steps after warm-up (the first max(2, 10%) logged "
                 "steps are left out, and the first after each resume); step-time shares are medians of "
                 "time/<part>_s / throughput/step_time_s; bytes are rank 0's per step (1 MB = 10^6 bytes)")
    notes.append(f"world size from: {', '.join(sources)}")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, png_path = out_dir / "scaling.md", out_dir / "scaling.png"
    lines = ["# Scaling", "", "| " + " | ".join(COLUMNS) + " |", "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    lines += ["| " + " | ".join(_row_cells(r)) + " |" for r in runs]
    lines += [""] + [f"- {n}" for n in notes] + [""]
    lines += ["Runs: " + ", ".join(f"{r['name']} = {r['run_dir']}" for r in runs), ""]
    tmp = md_path.with_name(f".{md_path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines), encoding="utf-8")
    os.replace(tmp, md_path)
    if base["tokens_per_sec_device"]:
        _plot(runs, base, png_path)
    return {"runs": runs, "baseline": base["name"], "notes": notes, "markdown": str(md_path),
            "png": str(png_path) if png_path.is_file() else None}


__all__ = ["ReportError", "run_status", "format_status", "scaling_report", "warmup_skip"]
