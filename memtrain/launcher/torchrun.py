"""``python -m memtrain.launcher.torchrun ARGS``: torchrun (``torch.distributed.run``, same arguments) for
Slurm jobs that are preempted.

torchrun's agent does not handle SIGUSR1, so the signal Slurm sends before the time limit (forwarded by
the batch script) killed the agent (exit 138) and left its workers to Slurm's kill timer. Here the agent
forwards SIGUSR1 to its workers (its child processes: they run in sessions of their own, so a signal to
the agent's process group misses them) and lives on; the workers finish their step, write a checkpoint
and exit 0, and so does torchrun. Whether the run stopped early is recorded by the trainer in
``run.dir/attempts.jsonl``, which the batch script reads to requeue the job.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (read from /proc; empty where there is none)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces: split after it
        if len(fields) > 1 and fields[1] == str(parent):
            out.append(int(entry))
    return out


def _forward(signum: int, frame: object) -> None:
    for pid in child_pids(os.getpid()):
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def main(argv: Optional[list[str]] = None) -> None:
    from torch.distributed.run import main as torchrun

    signal.signal(signal.SIGUSR1, _forward)
    torchrun(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
