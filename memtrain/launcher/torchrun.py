"""``python -m memtrain.launcher.torchrun ARGS``: torchrun (``torch.distributed.run``, same arguments) for
Slurm jobs that are preempted.

The two signals that ask a run to checkpoint and stop (SIGUSR1, which Slurm sends before the time limit, and
SIGTERM, which it sends on preemption and ``scancel``; the batch script forwards both) are the agent's to pass
on here, not to act on. Plain torchrun's agent did not handle SIGUSR1, so that signal killed it (exit 138) and
left its workers to Slurm's kill timer; SIGTERM made it terminate its workers (SIGTERM, then SIGKILL after its
shutdown timeout, 30 s by default, even in the middle of writing a checkpoint) and exit 1 with a traceback, so
the batch script did not requeue a run that had stopped at a checkpoint. Here the agent forwards either signal
to its workers (its child processes: they run in sessions of their own, so a signal to the agent's process group
misses them) and lives on; the workers finish their step, write a checkpoint and exit 0, and so does torchrun.
Whether the run stopped early is recorded by the trainer in ``run.dir/attempts.jsonl``, which the batch script
reads to requeue the job. SIGINT (Ctrl-C), SIGHUP and SIGQUIT stay torchrun's: they stop the workers at once.
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


FORWARDED = (signal.SIGUSR1, signal.SIGTERM)
# The signals torchrun's agent handles itself (raise in the agent, terminate the workers): its default list
# (``--signals-to-handle``, torch 2.9 and later) less the forwarded ones.
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def torchrun_argv(argv: list[str]) -> list[str]:
    """``argv`` for torchrun, telling it to leave SIGTERM to this wrapper where it can be told: it installs its
    handlers when it starts the workers, over this wrapper's. First in ``argv``, so that a
    ``--signals-to-handle`` of the caller's own (torchrun keeps the last) still wins. Before torch 2.9,
    whose agent handles SIGTERM unconditionally, ``argv`` unchanged: SIGUSR1 alone is forwarded there."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    if "signals_to_handle" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return list(argv)
    return [f"--signals-to-handle={AGENT_SIGNALS}", *argv]


def main(argv: Optional[list[str]] = None) -> None:
    from torch.distributed.run import main as torchrun

    for sig in FORWARDED:
        signal.signal(sig, _forward)
    torchrun(torchrun_argv(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    main()
