"""Training metrics: TensorBoard scalars, a readable log line, and ``metrics.jsonl``.

Only rank 0 writes. TensorBoard logs go to ``<run.dir>/tensorboard`` (one directory per run, reused on
resume); every logged step is also appended to ``<run.dir>/metrics.jsonl`` for scripts and tests, as
strict JSON (a non-finite value is written as ``null``).

A resumed run keeps one history: rows and events that a crashed or preempted run wrote after the
checkpoint it resumes from are removed from ``metrics.jsonl`` and from the TensorBoard event files
(rewritten atomically, so every reader sees one value per step and tag, not only those that honour
``purge_step``, which is set as well). A line torn by a kill mid-write is dropped too.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

# One JSON object per line in <run.dir>: a "start" event for every attempt at the run (who, where, resumed
# from which step) and an "end" event with how it ended (complete, preempted, diverged, failed). Written by
# the trainer (rank 0), read by `memtrain status` and by the Slurm batch script (requeue when preempted).
ATTEMPTS = "attempts.jsonl"


def append_jsonl(path: Path, row: dict) -> None:
    """Append ``row`` to ``path`` as one JSON line, on a line of its own: a file that does not end with a newline
    (a kill mid-write left half a line) gets one first, so the torn fragment stays one unparsable line, which
    readers skip as they skip torn ``metrics.jsonl`` rows (``memtrain status``), instead of swallowing the new row.
    One write in append mode, so the row itself is never interleaved."""
    data = (json.dumps(row) + "\n").encode("utf-8")
    with open(path, "a+b") as f:
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)  # append mode: at the end, wherever the read left the position


class MetricsWriter:
    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool, resume_step: Optional[int],
                 stream: TextIO = sys.stdout):
        self.enabled = enabled
        self.stream = stream
        self.tb = None
        self.jsonl = None
        if not enabled:
            return
        tb_dir = Path(run_dir) / "tensorboard"
        path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None:  # forget what was logged past the checkpoint we resume from
            truncate_jsonl(path, resume_step)
            truncate_events(tb_dir, resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(tb_dir), purge_step=None if resume_step is None else resume_step + 1)
        self.jsonl = open(path, "a", encoding="utf-8")

    @property
    def log_dir(self) -> Optional[str]:
        return self.tb.log_dir if self.tb is not None else None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, step)
        if self.jsonl is not None:
            # Strict JSON: a non-finite value (a skipped step's loss or norm) is written as null.
            row = {k: (v if math.isfinite(v) else None) for k, v in values.items()}
            self.jsonl.write(json.dumps({"step": step, "time": time.time(), **row}, allow_nan=False) + "\n")
            self.jsonl.flush()

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def flush(self) -> None:
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (a kill leaves the old or the new)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the rows of ``metrics.jsonl`` up to ``last_step``; a torn (unparsable) line is dropped."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # half a line written by a killed run
        if isinstance(row, dict) and row.get("step", 0) <= last_step:
            kept.append(line)
    _replace(path, "".join(line + "\n" for line in kept).encode("utf-8"))


def truncate_events(log_dir: Path, last_step: int) -> None:
    """Drop the events past ``last_step`` from every TensorBoard event file in ``log_dir`` (each file read
    record by record and rewritten only when it holds such events; a record torn by a kill ends it)."""
    if not log_dir.is_dir():
        return
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        records = list(RawEventFileLoader(str(path)).Load())
        kept = [r for r in records if Event.FromString(r).step <= last_step]
        if len(kept) == len(records) and path.stat().st_size == sum(len(r) + 16 for r in records):
            continue  # nothing past the step, nothing torn
        buf = io.BytesIO()
        writer = RecordWriter(buf)
        for record in kept:
            writer.write(record)
        _replace(path, buf.getvalue())


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.1f}"


def format_line(step: int, max_steps: int, values: dict[str, float]) -> str:
    parts = [f"step {step}/{max_steps}", f"loss {values['loss/train']:.4f}"]
    if "loss/val" in values:
        parts.append(f"val {values['loss/val']:.4f}")
    if "loss/val_generic" in values:
        parts.append(f"val generic {values['loss/val_generic']:.4f}")
    parts += [f"lr {values['optim/lr']:.2e}", f"grad {values['optim/grad_norm']:.3f}",
              f"{_si(values['throughput/tokens_per_sec'])} tok/s"]
    if "throughput/mfu" in values:
        parts.append(f"mfu {100 * values['throughput/mfu']:.1f}%")
    parts += [f"{values['throughput/step_time_s']:.2f} s/step", f"data {100 * values['throughput/data_wait_frac']:.0f}%",
              f"{_si(values['progress/tokens_seen'])} tokens"]
    if "memory_module/rows_touched_frac/all" in values:
        parts.append(f"bank rows {100 * values['memory_module/rows_touched_frac/all']:.1f}%")
    if "gpu_mem/max_allocated_gib" in values:
        parts.append(f"mem {values['gpu_mem/max_allocated_gib']:.1f} GiB")
    return " | ".join(parts)
