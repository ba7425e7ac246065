"""Process-group discovery under each launcher, from their environment variables."""

import pytest

from memtrain.errors import LaunchError
from memtrain.parallel.dist import discover, first_host, tasks_on_node


def test_single_process_without_launcher():
    env = discover({})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launcher) == (0, 0, 1, 1, "single")
    assert env.master_port > 0


def test_torchrun():
    env = discover({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                    "MASTER_ADDR": "node0", "MASTER_PORT": "29400"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert (env.master_addr, env.master_port, env.launcher, env.num_nodes) == ("node0", 29400, "torchrun", 2)


def test_deepspeed_launcher_sets_local_size_not_local_world_size():
    env = discover({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "2",
                    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "CROSS_RANK": "1"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launcher) == (3, 1, 4, 2, "deepspeed")


def test_slurm_step():
    env = discover({"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_STEP_NUM_TASKS": "11",
                    "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_STEP_NODELIST": "gpu[07-09]",
                    "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[07-09]"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launcher) == (9, 1, 11, 3, "slurm")
    assert env.master_addr == "gpu07"
    assert env.master_port == 20000 + 123456 % 20000


def test_slurm_batch_script_outside_srun_is_a_single_process():
    assert discover({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).launcher == "single"


def test_launcher_variables_win_over_slurm():
    # torchrun started by srun: one task per node, torchrun's variables describe the processes.
    env = discover({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
                    "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert (env.rank, env.world_size, env.launcher) == (6, 16, "torchrun")


def test_slurm_helpers():
    assert tasks_on_node("8(x3)", 2) == 8
    assert tasks_on_node("2,4(x2)", 0) == 2 and tasks_on_node("2,4(x2)", 2) == 4
    assert first_host("node12") == "node12"
    assert first_host("a[3,5-7],b1") == "a3"
    with pytest.raises(LaunchError, match=r"SLURM_NODEID=5 is outside SLURM_STEP_TASKS_PER_NODE='4\(x2\)'"):
        tasks_on_node("4(x2)", 5)


@pytest.mark.parametrize("environ,message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "neither LOCAL_WORLD_SIZE .* nor LOCAL_SIZE"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"},  # rank outside world
     r"inconsistent launcher variables \(torchrun\): rank 2, local rank 0, world size 2"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "RANK='x' is missing or not an integer"),
])
def test_inconsistent_environment_is_a_launch_error(environ, message):
    with pytest.raises(LaunchError, match=message):
        discover(environ)


@pytest.mark.parametrize("outcome", ["returns", "one_line_error", "diverged"])
def test_cli_destroys_the_process_groups_a_command_started(outcome, monkeypatch, tmp_path):
    """`memtrain` destroys the process groups a command started before it returns, whatever the command's outcome,
    and keeps that outcome (exit code, one-line error). Left to interpreter finalisation, gloo's threads made a
    rank that had finished a 2-rank run cleanly abort with SIGABRT ("terminate called without an active
    exception"), so torchrun reported the run failed."""
    import torch.distributed as tdist

    from memtrain.errors import DivergenceError
    from memtrain.launcher import cli

    def run(argv):
        tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        tdist.new_group([0], backend="gloo")
        if outcome == "one_line_error":
            raise LaunchError("local rank 0 has no GPU")
        if outcome == "diverged":
            raise DivergenceError("the loss was not finite for 3 steps")
        return 0

    monkeypatch.setattr(cli, "run", run)
    code = cli.main(["train", "recipe.yaml"])
    assert code == {"returns": 0, "one_line_error": 2, "diverged": 3}[outcome]
    assert not tdist.is_initialized()


SHUTDOWN_SCRIPT = """
import os, sys
import torch
from memtrain.parallel import dist

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
env = dist.discover({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[1]})
dist.init(env, torch.device("cpu"), "gloo")
started = threads()
if sys.argv[2] == "checkpoint":  # as the bank checkpoint does, after the group started
    import torch.distributed.checkpoint
    torch.distributed.all_reduce(torch.ones(3))
else:  # a DeepSpeed engine, as training starts one
    from memtrain.config import recipe_from_dict
    from memtrain.model import build
    from memtrain.parallel import engine as eng
    recipe = recipe_from_dict({}, ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.ffn_dim=32",
                                   "model.vocab_size=64", "data.tokenizer.vocab_size=64", "model.max_seq_len=16",
                                   "data.seq_len=16", "train.global_batch_tokens=32", "train.micro_batch_size=2"])
    engine, *_ = eng.initialize(build(recipe.model), recipe, 1, "fp32")
    engine.backward(engine(torch.randint(0, 64, (2, 16))).logits.float().mean())
    engine.step()
    del engine, _
dist.shutdown()
print(before, started, threads())
"""


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("user", ["checkpoint", "deepspeed"])
def test_shutdown_frees_the_group_its_users_captured(user, tmp_path):
    """``dist.init`` imports the modules that capture the default group at import time before starting it, and
    ``dist.shutdown`` drops DeepSpeed's references, so the group is really freed (gloo's worker threads end)
    after torch.distributed.checkpoint or a DeepSpeed engine used it. Otherwise those threads lived into
    interpreter shutdown, and a rank that had finished cleanly could abort with SIGABRT (seen in CI on the
    3-rank bank checkpoint test). A fresh interpreter, since this process may have imported those modules."""
    import os
    import subprocess
    import sys

    from memtrain.parallel.dist import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SHUTDOWN_SCRIPT, str(free_port()), user], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    before, started, after = map(int, done.stdout.split()[-3:])
    assert started > before  # the group's threads ran
    assert after == before, (before, started, after)


def test_cpu_ranks_take_omp_num_threads_or_their_share_of_the_cpus_they_may_run_on(monkeypatch):
    """A CPU rank's intra-op threads: ``OMP_NUM_THREADS`` where set (``memtrain submit`` sets each rank's share;
    the first level of the nested form), otherwise the process's affinity mask split over the host's ranks."""
    import os

    from memtrain.parallel.dist import cpu_threads

    assert cpu_threads(4, {"OMP_NUM_THREADS": "3"}) == 3
    assert cpu_threads(1, {"OMP_NUM_THREADS": "2,1"}) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    assert cpu_threads(1, {}) == 6 and cpu_threads(2, {}) == 3 and cpu_threads(4, {}) == 1
    assert cpu_threads(8, {}) == 1  # at least one
    for unusable in ("", "0", "-2", "many"):
        assert cpu_threads(2, {"OMP_NUM_THREADS": unusable}) == 3
