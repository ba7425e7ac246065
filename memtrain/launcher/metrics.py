"""Training metrics: TensorBoard scalars, a readable log line, and ``metrics.jsonl``.

Only rank 0 writes. ``metrics.jsonl`` is strict JSON: non-finite values are written as ``null``. TensorBoard logs go to ``<run.dir>/tensorboard`` (one directory per run, reused on
resume with ``purge_step`` so that events a crashed run wrote after its last checkpoint are
dropped). Every logged step is also appended to ``<run.dir>/metrics.jsonl`` for scripts and tests.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Optional, TextIO


class MetricsWriter:
    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool, resume_step: Optional[int],
                 stream: TextIO = sys.stdout):
        self.enabled = enabled
        self.stream = stream
        self.tb = None
        self.jsonl = None
        if not enabled:
            return
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"),
                                    purge_step=None if resume_step is None else resume_step + 1)
        path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and path.is_file():
            # Same reasoning as purge_step: forget records past the checkpoint we resume from.
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
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
