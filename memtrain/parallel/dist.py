"""Process-group discovery and set-up.

One command line runs as a single process with no launcher (a world of one), or as one of several
processes started by torchrun, the DeepSpeed launcher or Slurm's srun. :func:`discover` reads the
rank, local rank, world size, local world size and rendezvous address from whichever launcher is
present; :func:`init` exports them under the names DeepSpeed and mosaicml-streaming read (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and starts
the torch.distributed process group (NCCL on GPUs, gloo on CPU).

Launcher facts this module relies on:
- torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
- the DeepSpeed launcher sets the same except LOCAL_WORLD_SIZE: it sets LOCAL_SIZE instead, and
  passes ``--local_rank=N`` on the command line.
- srun sets SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_NUM_TASKS,
  SLURM_STEP_TASKS_PER_NODE (e.g. ``4(x2),3``) and SLURM_STEP_NODELIST (e.g. ``gpu[01-02]``). A
  batch script outside srun has SLURM_JOB_ID but no SLURM_STEP_NUM_TASKS and runs as one process.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

from memtrain.errors import LaunchError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "single", "torchrun", "deepspeed" or "slurm"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        raise LaunchError(f"environment variable {name}={environ.get(name)!r} is missing or not an "
                          "integer; start memtrain with torchrun, the deepspeed launcher, srun, or no launcher")


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from Slurm's compressed form, e.g. ``"4(x2),3"`` -> [4, 4, 3]."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"cannot parse SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise LaunchError(f"SLURM_NODEID={node_id} is outside SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node_id]


def first_host(nodelist: str) -> str:
    """The first host name of a Slurm node list (``gpu[03-05,9],cpu1`` -> ``gpu03``)."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=30, check=True).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise LaunchError(f"cannot read the first host of the Slurm node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def discover(environ: Optional[Mapping[str, str]] = None) -> DistEnv:
    """Work out this process's place in the job from the launcher's environment variables."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        if "LOCAL_WORLD_SIZE" in env:
            launcher, local_world = "torchrun", _int(env, "LOCAL_WORLD_SIZE")
        elif "LOCAL_SIZE" in env:
            launcher, local_world = "deepspeed", _int(env, "LOCAL_SIZE")
        else:
            raise LaunchError("RANK and WORLD_SIZE are set but neither LOCAL_WORLD_SIZE (torchrun) nor "
                              "LOCAL_SIZE (deepspeed launcher) is; set LOCAL_WORLD_SIZE to the number of "
                              "processes on this node")
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank % local_world
        addr = env.get("MASTER_ADDR", "127.0.0.1")
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500
    elif "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        launcher = "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS")
        local_rank = _int(env, "SLURM_LOCALID")
        local_world = tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(world)),
                                    _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0)
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST")
                                                    or env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        # One port per job, so two jobs sharing a head node do not collide.
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
    else:
        return DistEnv(0, 0, 1, 1, "127.0.0.1", _int(env, "MASTER_PORT") if "MASTER_PORT" in env else free_port(),
                       "single")
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise LaunchError(f"inconsistent launcher variables ({launcher}): rank {rank}, local rank {local_rank}, "
                          f"world size {world}, local world size {local_world}")
    return DistEnv(rank, local_rank, world, local_world, addr, port, launcher)


def export(dist_env: DistEnv) -> None:
    """Publish the process layout under the names DeepSpeed and mosaicml-streaming read."""
    os.environ.update({
        "RANK": str(dist_env.rank), "WORLD_SIZE": str(dist_env.world_size),
        "LOCAL_RANK": str(dist_env.local_rank), "LOCAL_WORLD_SIZE": str(dist_env.local_world_size),
        "MASTER_ADDR": dist_env.master_addr, "MASTER_PORT": str(dist_env.master_port),
    })


def resolve_device(requested: str, dist_env: DistEnv):
    """The torch device for this rank: ``cuda:<local_rank>`` on GPUs, else ``cpu``."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise LaunchError("run.device is 'cuda' but no GPU is visible; set run.device=cpu or auto")
    if requested in ("cuda", "auto") and torch.cuda.is_available():
        if dist_env.local_rank >= torch.cuda.device_count():
            raise LaunchError(f"local rank {dist_env.local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                              "start one process per GPU")
        return torch.device("cuda", dist_env.local_rank)
    return torch.device("cpu")


def cpu_threads(local_world_size: int, environ: Mapping[str, str] = os.environ) -> int:
    """Intra-op threads for each of a host's ``local_world_size`` CPU ranks: ``OMP_NUM_THREADS`` where it is set
    (its first level, for the comma-separated nested form; ``memtrain submit`` sets it to each rank's share of
    ``slurm.cpus_per_task``), otherwise the CPUs this process may run on (its affinity mask, which Slurm and
    ``taskset`` narrow; ``os.cpu_count()`` counts the whole host) split evenly over the ranks, at least one.

    Ranks sharing cores with other work want fewer threads than cores: a thread pool larger than the cores it
    gets spin-waits at every parallel region (a tiny CPU run beside one busy process: 14.5 s with 2 threads on 2
    cores, 8.4 s with 1, the same losses)."""
    value = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_world_size))


def init(dist_env: DistEnv, device, backend: str = "auto", timeout_minutes: Optional[float] = None) -> None:
    """Export the layout and start the default process group (idempotent). ``timeout_minutes``: how long a
    collective may wait for the other ranks (None: torch's default); see :func:`set_timeout`."""
    import torch
    import torch.distributed as dist

    export(dist_env)
    if device.type == "cpu":
        # DeepSpeed picks its accelerator once, at first use; without this it may choose CUDA just
        # because the installed torch is a CUDA build.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(cpu_threads(dist_env.local_world_size))
    else:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    import_group_capturers()
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise LaunchError("parallel.backend is 'nccl' but this rank runs on CPU; use gloo or auto")
    dist.init_process_group(backend=backend, init_method="env://", rank=dist_env.rank,
                            world_size=dist_env.world_size,
                            device_id=device if device.type == "cuda" else None,
                            timeout=timedelta(minutes=timeout_minutes) if timeout_minutes else None)


def import_group_capturers() -> None:
    """Import, before the default process group starts, the modules that capture it at import time.
    ``torch.distributed.nn.functional`` and DeepSpeed's ``TorchBackend`` (``barrier``, ``monitored_barrier``)
    bind ``group.WORLD`` as default arguments; first imported after ``init_process_group`` (by
    torch.distributed.checkpoint, which the bank checkpoint uses, and by the DeepSpeed engine), they hold the
    group for the life of the process, so ``destroy_process_group`` cannot free it. Gloo's worker threads then
    live on into interpreter shutdown, and one that drops its last collective's tensors there takes the GIL and
    aborts a rank that finished cleanly ("terminate called without an active exception", SIGABRT: seen in CI on
    a 3-rank bank checkpoint). Every process that starts a group calls this first; a fraction of a second.
    DeepSpeed is optional here (models and kernels run where only torch is installed)."""
    import torch.distributed.nn  # noqa: F401

    try:
        import deepspeed.comm.torch  # noqa: F401
    except ImportError:
        pass


def set_timeout(minutes: float) -> None:
    """Change how long the default process group's collectives wait for the other ranks (the hang guard:
    short while training steps, long around checkpoint writes and start-up, where one rank may
    legitimately work alone for minutes). A no-op without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    setter = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # torch < 2.12: private
    setter(timedelta(minutes=minutes))


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out or lost its peer (a hung or dead rank), as gloo and
    NCCL report them, rather than a bug."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in (
        "Timed out waiting", "timed out", "Connection reset by peer", "Connection closed by peer",
        "Socket Timeout", "NCCL communicator was aborted", "Watchdog caught collective operation timeout"))


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def gather_strings(items: list[str]) -> list[str]:
    """Every rank's ``items``, in rank order, on every rank (collective when a process group of more
    than one rank runs; ``items`` itself otherwise). Used to agree on problems found by one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return list(items)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(items))
    return [x for part in gathered for x in part]


def shutdown() -> None:
    """Destroy every process group, with DeepSpeed's references to them where its comm layer started (its
    ``destroy_process_group`` drops the groups it caches, such as its world group) and the unreachable objects
    that still refer to them, so that nothing keeps gloo's threads alive into interpreter shutdown (see
    :func:`import_group_capturers`)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    gc.collect()  # a finished DeepSpeed engine lives on in reference cycles, holding the groups
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None:
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
