"""Checkpoint integrity and the run-directory lock.

A 2-rank ZeRO-3 save on CPU with gloo (tiny model, a sharded memory bank as the extra files) is written
into a temporary folder and renamed into place, with every file's size and xxh64 in COMPLETE.json and
``checkpoints/latest`` naming it: DeepSpeed's zero_to_fp32 consolidates it without a tag (library call
and the copied script) into exactly the run's gathered weights. Damaged files (overwritten bytes, a
truncation) fail :func:`verify` with one line naming the file and the fallback, on every rank alike;
a folder being read (:func:`reading`, in another process) is not pruned; :class:`RunLock` refuses a live
holder and takes over stale ones, exactly one winner when several race for the same stale lock."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from memtrain.errors import CheckpointError, LaunchError, StorageError
from memtrain.parallel import checkpoint as ckpt
from memtrain.parallel import checkpoint_folder
from memtrain.parallel.run_lock import LOCK, RunLock, process_start_time

REPO = Path(__file__).resolve().parents[1]
W = 2
RECIPE = {
    "run": {"name": "integrity", "seed": 3},
    "model": {"vocab_size": 97, "d_model": 32, "n_layers": 2, "n_heads": 4, "ffn_dim": 48, "max_seq_len": 16,
              "tie_embeddings": False},
    "data": {"seq_len": 16, "tokenizer": {"vocab_size": 97}},
    "train": {"max_steps": 4, "micro_batch_size": 2, "global_batch_tokens": 64, "optimizer": {"lr": 1e-2}},
    "parallel": {"zero_stage": 3},
    "checkpoint": {"every_steps": 1, "keep_last": 3},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_", "WORLD_SIZE", "MASTER_", "SLURM_", "TORCHELASTIC"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


# --------------------------------------------------------------------------------------------------
# One 2-rank ZeRO-3 run: two steps, a checkpoint after each


def _worker(rank: int, port: int, root: str):
    import logging

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(W),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from memtrain.parallel.dist import import_group_capturers
    import_group_capturers()  # before the group starts, so that destroy_process_group frees it
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W)
    import deepspeed

    from memtrain.config import MemoryConfig, recipe_from_dict
    from memtrain.model import build
    from memtrain.parallel import engine as eng
    from memtrain.parallel.sharded_bank import ShardedMemoryBank

    deepspeed.utils.logger.setLevel(logging.WARNING)
    root = Path(root)
    run = root / "run"
    recipe = recipe_from_dict({**RECIPE, "run": {**RECIPE["run"], "dir": str(run)}})
    torch.manual_seed(0)
    engine, *_ = eng.initialize(build(recipe.model), recipe, W, "fp32")
    bank = ShardedMemoryBank(build(recipe.model, MemoryConfig(type="ffn", levels=[2, 3]), branching=3).memory_layout,
                             seed=5)  # memory_bank/: DCP files written by both ranks
    out: dict = {}
    for step in (1, 2):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randint(0, 97, (2, 16), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).logits.reshape(-1, 97), x.reshape(-1))
        engine.backward(loss)
        engine.step()
        path = ckpt.save(engine, recipe, step=step, rank=rank, world_size=W,
                         trainer_state={"step": step, "tokens_seen": 64 * step, "loader": {}}, rank_extra={"loader": {}},
                         write_extra=lambda p: ckpt.save_bank(bank, p, rank))
        out[f"path{step}"] = str(path)
        if step == 1 and rank == 0:  # what killed saves leave behind: this run's next step, and a later one
            for leftover in (ckpt.partial_tag_for(2), ckpt.partial_tag_for(7)):
                (ckpt.checkpoint_root(run) / leftover).mkdir()
                (ckpt.checkpoint_root(run) / leftover / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
            complete, incomplete = ckpt.list_checkpoints(run)
            out["listed_with_leftovers"] = ([c.step for c in complete], [p.name for p in incomplete])
        torch.distributed.barrier()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        if rank == 0:
            out["weights"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    # verify is collective: each rank checks its share; damage in rank 1's share is raised on both ranks.
    info = ckpt.latest_checkpoint(run)
    ckpt.verify(info, rank, W)
    damaged_run = root / "damaged"
    if rank == 0:
        shutil.copytree(run, damaged_run)
        names = sorted(json.loads((info.path / ckpt.MARKER).read_text())["files"])
        target = damaged_run / "checkpoints" / info.tag / names[3]  # file 3: rank 1's share
        data = bytearray(target.read_bytes())
        data[-8:] = bytes(255 - b for b in data[-8:])
        target.write_bytes(bytes(data))
        out["damaged_file"] = names[3]
    torch.distributed.barrier()
    try:
        ckpt.verify(ckpt.latest_checkpoint(damaged_run), rank, W)
        message = ""
    except CheckpointError as e:
        message = str(e)
    messages: list = [None] * W
    torch.distributed.all_gather_object(messages, message)
    if rank == 0:
        out["verify_messages"] = messages

    # A save whose completion marker cannot be written on rank 0 (its disk filled after every rank's files): every
    # rank raises the same one-line error at once (the last barrier carries rank 0's outcome; before, the other
    # ranks returned as if saved) and rank 0 removes the partial folder.
    real_mark = ckpt.mark_complete

    def full_disk(folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / ckpt.MARKER))

    ckpt.mark_complete = full_disk
    started = time.monotonic()
    try:
        ckpt.save(engine, recipe, step=3, rank=rank, world_size=W,
                  trainer_state={"step": 3, "tokens_seen": 192, "loader": {}}, rank_extra={"loader": {}},
                  write_extra=lambda p: ckpt.save_bank(bank, p, rank))
        message = ""
    except StorageError as e:
        message = str(e)
    finally:
        ckpt.mark_complete = real_mark
    failed: list = [None] * W
    torch.distributed.all_gather_object(failed, (message, time.monotonic() - started))
    if rank == 0:
        out["failed_save"] = failed
        torch.save(out, root / "out.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("integrity")
    mp.spawn(_worker, args=(_free_port(), str(root)), nprocs=W, join=True)
    return {"root": root, "run": root / "run", **torch.load(root / "out.pt", weights_only=False)}


def _copy(saved, tmp_path) -> Path:
    """A copy of the run to damage."""
    shutil.copytree(saved["run"], tmp_path / "run")
    return tmp_path / "run"


def _overwrite_64_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(255 - b for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------------------------------
# Saving


def test_save_renames_into_place_with_checksums_and_latest(saved):
    root = ckpt.checkpoint_root(saved["run"])
    assert sorted(p.name for p in root.iterdir()) == ["global_step1", "global_step2", "latest", "zero_to_fp32.py",
                                                      "zero_to_torch.py"]  # no partial folder left
    assert (root / "latest").read_text() == "global_step2"
    assert saved["path2"] == str(root / "global_step2")
    for tag in ("global_step1", "global_step2"):
        folder = root / tag
        marker = json.loads((folder / ckpt.MARKER).read_text())
        assert marker["algorithm"] == "xxh64" and marker["world_size"] == W
        on_disk = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        assert sorted(marker["files"]) == [n for n in on_disk if n != ckpt.MARKER]
        assert {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "rank_state_00001.pt", "trainer_state.json",
                "memory_bank/__1_0.distcp", "memory_bank/bank.json"} <= set(marker["files"])
        for name, record in marker["files"].items():
            import xxhash

            data = (folder / name).read_bytes()
            assert record == {"size": len(data), "xxh64": xxhash.xxh64(data).hexdigest()}, name
            assert b".partial" not in data, name  # nothing records the temporary folder's name
        ckpt.verify(ckpt.resolve(folder))
    # the renamed folders load: the bank's DCP files and the weights
    assert ckpt.read_bank_state(root / "global_step2")["step"] == 0


def test_a_save_rank_0_cannot_complete_fails_on_every_rank_with_one_line(saved):
    """Rank 0 could not write COMPLETE.json (an injected ENOSPC): both ranks raised the same error within seconds,
    naming rank 0, the space left and the checkpoint the run resumes from; the partial folder is gone and the
    newest checkpoint is still step 2 (the other tests of this module see the run as it was). A failure in a rank's
    own writes raises on that rank at once (tests/test_train.py; the others may be inside a collective of
    DeepSpeed's save, and stop when it loses the rank)."""
    (first, took0), (second, took1) = saved["failed_save"]
    root = ckpt.checkpoint_root(saved["run"])
    assert first == second and max(took0, took1) < 60
    assert first.startswith(f"saving checkpoint global_step3 failed: rank 0: [Errno 28] No space left on device: "
                            f"'{root / '.global_step3.partial' / ckpt.MARKER}'. The file system of {root} has ")
    assert "\n" not in first and "a checkpoint of this run takes " in first
    assert "checkpoint.keep_last 3 of them" in first
    assert first.endswith(f"The run stopped at step 3; its partial save was removed, and running the same command "
                          f"resumes from {root / 'global_step2'} (step 2) once there is room: free space there (an "
                          "older checkpoint, such as global_step1, may go), lower checkpoint.keep_last, or move run.dir "
                          "to a larger disk")
    assert not ckpt.leftovers(saved["run"]) and ckpt.latest_checkpoint(saved["run"]).step == 2


def test_a_storage_failure_is_told_from_a_bug(tmp_path, monkeypatch):
    """torch.save's C++ writer reports a full disk as a RuntimeError without an errno ("unexpected pos ..."): it
    counts as a failed save only while the file system is full; otherwise, like any other error, it keeps its
    traceback. A collective that timed out stays the hang guard's."""
    def raise_(e):
        def write():
            raise e
        return write

    full = raise_(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 10001024 vs 10000916"))
    assert ckpt._write_failure(raise_(OSError(errno.EDQUOT, "Disk quota exceeded")), tmp_path, 3) == (
        "rank 3: [Errno 122] Disk quota exceeded")
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 4096)
    assert ckpt._write_failure(full, tmp_path, 0) == (
        "rank 0: [enforce fail at inline_container.cc:672] . unexpected pos 10001024 vs 10000916")
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        ckpt._write_failure(raise_(RuntimeError("Timed out waiting 1800000ms for recv")), tmp_path, 0)
    with pytest.raises(ValueError):
        ckpt._write_failure(raise_(ValueError("a bug")), tmp_path, 0)
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 10 << 30)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        ckpt._write_failure(full, tmp_path, 0)
    assert ckpt._write_failure(lambda: None, tmp_path, 0) is None


def test_library_output_is_replayed_for_a_crash_not_for_a_one_line_error(capsys):
    from memtrain.launcher.console import library_output

    for error, replayed in ((RuntimeError("crash"), True), (CheckpointError("saving checkpoint failed"), False)):
        with pytest.raises(type(error)):
            with library_output(verbose=False):
                print("[Rank 0] Saving model checkpoint")
                raise error
        assert ("[Rank 0] Saving model checkpoint" in capsys.readouterr().err) == replayed


def test_partial_folders_are_ignored_and_removed_at_the_next_save(saved):
    assert saved["listed_with_leftovers"] == ([1], [])  # neither a checkpoint nor an incomplete tag
    assert not ckpt.leftovers(saved["run"])  # both removed by the save of step 2


def test_zero_to_fp32_needs_no_tag(saved, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    weights = saved["weights"]  # the full parameters, gathered in the run after step 2
    root = ckpt.checkpoint_root(saved["run"])
    for state in (get_fp32_state_dict_from_zero_checkpoint(str(root)),  # tag None: read from `latest`
                  ckpt.load_module_state(ckpt.latest_checkpoint(saved["run"]))):
        assert set(state) == set(weights)
        for name, tensor in weights.items():
            assert torch.equal(state[name], tensor), name
    out = subprocess.run([sys.executable, str(root / "zero_to_fp32.py"), str(root), str(tmp_path / "fp32"),
                          "--safe_serialization"], capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    state = load_file(tmp_path / "fp32" / "model.safetensors")
    assert set(state) == set(weights) and all(torch.equal(state[n], t) for n, t in weights.items())


# --------------------------------------------------------------------------------------------------
# Verification


def test_overwritten_bytes_name_the_file_and_the_previous_checkpoint(saved, tmp_path):
    run = _copy(saved, tmp_path)
    info = ckpt.latest_checkpoint(run)
    target = info.path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    size = target.stat().st_size
    _overwrite_64_bytes(target)
    assert target.stat().st_size == size
    previous = ckpt.checkpoint_root(run) / "global_step1"
    with pytest.raises(CheckpointError, match=rf"is damaged: zero_pp_rank_0_mp_rank_00_model_states.pt has xxh64 "
                                              rf"\w+ but \w+ was written \(checksum mismatch\); delete "
                                              rf"{info.path / ckpt.MARKER} to resume from {previous}$") as e:
        ckpt.verify(info)
    assert "\n" not in str(e.value)
    # The run's only checkpoint damaged: nothing to fall back to.
    shutil.rmtree(info.path)
    _overwrite_64_bytes(previous / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt has xxh64 .*; "
                                              r".*global_step1 is the run's only complete checkpoint: start a new "
                                              r"run.dir$"):
        ckpt.verify(ckpt.latest_checkpoint(run))


def test_truncated_or_missing_file_is_reported(saved, tmp_path):
    run = _copy(saved, tmp_path)
    info = ckpt.latest_checkpoint(run)
    bank_file = info.path / "memory_bank" / "__1_0.distcp"
    size = bank_file.stat().st_size
    bank_file.write_bytes(bank_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"memory_bank/__1_0.distcp has 100 bytes but {size} were written "
                                              r"\(size mismatch\); delete .*global_step2/COMPLETE.json"):
        ckpt.verify(info)
    (info.path / "rank_state_00001.pt").unlink()
    with pytest.raises(CheckpointError, match=r"damaged: memory_bank/__1_0.distcp has 100 bytes .* \(and 1 more\)"):
        ckpt.verify(info)


def test_collective_verify_raises_the_same_error_on_every_rank(saved):
    first, second = saved["verify_messages"]
    assert first == second and f"is damaged: {saved['damaged_file']} has xxh64" in first


def test_checkpoints_without_checksums_verify_and_vanished_ones_say_removed(saved, tmp_path):
    run = _copy(saved, tmp_path)
    info = ckpt.latest_checkpoint(run)
    marker = json.loads((info.path / ckpt.MARKER).read_text())
    (info.path / ckpt.MARKER).write_text(json.dumps({k: marker[k] for k in ("step", "permanent", "world_size")}))
    _overwrite_64_bytes(info.path / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    ckpt.verify(info)  # written before checksums existed: nothing recorded, nothing to check
    shutil.rmtree(info.path)  # pruned by the training run while an evaluation was about to read it
    for read in (ckpt.verify, ckpt.load_module_state, ckpt.read_trainer_state):
        with pytest.raises(CheckpointError, match=r"global_step2 was removed while it was being read \(pruned"):
            read(info)
    with pytest.raises(CheckpointError, match=r"was removed while it was being read"):
        with ckpt.reading(info):
            pass


def test_load_anchor_verifies_the_checkpoint(saved, tmp_path):
    from memtrain.config import recipe_from_dict
    from memtrain.model import build

    run = _copy(saved, tmp_path)
    model = build(recipe_from_dict(RECIPE).model)
    assert ckpt.load_anchor(model, run).step == 2
    assert all(torch.equal(p, saved["weights"][n]) for n, p in model.named_parameters())
    _overwrite_64_bytes(run / "checkpoints" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt has xxh64 .* "
                                              r"\(checksum mismatch\); delete .* to resume from .*global_step1"):
        ckpt.load_anchor(model, run)


# --------------------------------------------------------------------------------------------------
# Reading vs. pruning


def _fake(run_dir: Path, step: int) -> Path:
    path = ckpt.checkpoint_root(run_dir) / ckpt.tag_for(step)
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(b"w" * step)
    checkpoint_folder.mark_complete(path, step, False, 1, checkpoint_folder.hash_files(path, ["weights.bin"]))
    return path


def test_prune_skips_a_folder_being_read_in_another_process(tmp_path):
    for step in (1, 2, 3, 4):
        _fake(tmp_path, step)
    code = textwrap.dedent("""
        import sys
        from memtrain.parallel import checkpoint_folder as cf
        info = cf.resolve(sys.argv[1])
        with cf.reading(info):
            cf.verify(info)
            print("reading", flush=True)
            sys.stdin.read()
    """)
    reader = subprocess.Popen([sys.executable, "-c", code, str(ckpt.checkpoint_root(tmp_path) / "global_step1")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert reader.stdout.readline().strip() == "reading"
        removed = ckpt.prune(tmp_path, keep_last=2)
        assert [p.name for p in removed] == ["global_step2"]  # step 1 is being read: skipped
        assert [c.step for c in ckpt.list_checkpoints(tmp_path)[0]] == [1, 3, 4]
    finally:
        reader.communicate("", timeout=60)
    assert reader.returncode == 0
    assert [p.name for p in ckpt.prune(tmp_path, keep_last=2)] == ["global_step1"]  # at the next save
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)[0]] == [3, 4]
    assert sorted(p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()) == ["global_step3", "global_step4"]


# --------------------------------------------------------------------------------------------------
# The run lock


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(run_dir: Path, **holder) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": 1, "start_time": None, "slurm_job_id": None, "started": 0.0,
            "command": "memtrain train", "token": "theirs"}
    (run_dir / LOCK).write_text(json.dumps({**base, **holder}))


def _holder(run_dir: Path) -> dict:
    return json.loads((run_dir / LOCK).read_text())


def test_run_lock_refuses_a_live_holder_and_releases(tmp_path):
    code = ("import sys\nfrom memtrain.parallel.run_lock import RunLock\nlock = RunLock(sys.argv[1]).acquire()\n"
            "print('held', flush=True)\nsys.stdin.read()\nlock.release()\n")
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(LaunchError, match=rf"in use by another training run: host {socket.gethostname()}, pid "
                                              rf"{other.pid}, since .*; wait for it to finish or stop it; if it is gone "
                                              rf"\(another host that crashed\), delete {tmp_path / 'run' / LOCK}$"):
            RunLock(tmp_path / "run").acquire()
    finally:
        other.communicate("", timeout=60)
    assert not (tmp_path / "run" / LOCK).exists()  # released by its holder
    with RunLock(tmp_path / "run") as lock:
        holder = _holder(tmp_path / "run")
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and lock.replaced is None
        assert holder["start_time"] == process_start_time(os.getpid()) and holder["command"] == " ".join([sys.executable, *sys.argv])
    assert not (tmp_path / "run").joinpath(LOCK).exists()


def test_run_lock_takes_over_a_dead_or_reused_pid_on_this_host(tmp_path):
    run = tmp_path / "run"
    _write_lock(run, pid=_dead_pid())
    lock = RunLock(run).acquire()
    assert "is not running" in lock.replaced and _holder(run)["token"] == lock.holder["token"]
    lock.release()
    _write_lock(run, pid=os.getpid(), start_time=process_start_time(os.getpid()) + 1)  # our pid, another process
    lock = RunLock(run).acquire()
    assert "is another process now" in lock.replaced
    lock.release()


def test_run_lock_takes_over_its_own_slurm_job_and_refuses_other_hosts(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _write_lock(run, host="node-017", pid=os.getpid(), slurm_job_id="4242")  # the job's previous incarnation
    lock = RunLock(run).acquire()
    assert "Slurm job 4242 (requeued)" in lock.replaced
    lock.release()
    _write_lock(run, host="node-017", pid=os.getpid(), slurm_job_id="977", started=1.7e9)  # alive for all we know
    with pytest.raises(LaunchError, match=rf"host node-017, pid {os.getpid()}, since \d{{4}}-.*, Slurm job 977 "
                                          r"\(.*run.lock\); wait for it to finish or stop it; if it is gone"):
        RunLock(run).acquire()
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(LaunchError, match="host node-017"):
        RunLock(run).acquire()
    assert _holder(run)["token"] == "theirs"  # a refusal leaves the lock as it was


def test_run_lock_release_leaves_someone_elses_lock_alone(tmp_path):
    run = tmp_path / "run"
    lock = RunLock(run).acquire()
    _write_lock(run, host="node-017", token="theirs")  # taken over meanwhile (say, by a requeued job)
    lock.release()
    assert _holder(run)["token"] == "theirs"


def test_a_run_dir_this_user_may_not_create_is_one_line(tmp_path, monkeypatch):
    """run.dir in a folder this user may not write in: the lock's refusal (the same line on every rank, through
    the gathered refusal), not a PermissionError traceback from mkdir. Other OSErrors keep their traceback."""
    import errno
    import getpass

    from memtrain.errors import path_line
    from memtrain.launcher.train import _lock_run_dir

    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.mkdir

    def refuse(path, *args, **kwargs):
        if str(path).startswith(str(locked)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    fix = ("fix the permissions or choose a location this user may use (data.dir for prepare, run.dir for train, "
           "--out for eval, generate and scaling), and run the command again")
    user = getpass.getuser()
    with pytest.raises(LaunchError) as err:
        _lock_run_dir(locked / "run", 0, torch.device("cpu"))
    assert str(err.value) == (f"cannot create {locked / 'run'}: Permission denied (user {user} may not write in "
                              f"{locked}); {fix}")
    assert list(locked.iterdir()) == []
    existing = tmp_path / "file"
    existing.write_text("")
    assert path_line(PermissionError(errno.EPERM, "Operation not permitted", str(existing))) == (
        f"{existing}: Operation not permitted (user {user}); {fix}")

    def broken(path, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(os, "mkdir", broken)
    with pytest.raises(OSError, match="Input/output error"):
        _lock_run_dir(tmp_path / "run", 0, torch.device("cpu"))


def test_a_run_dir_through_a_file_is_one_line(tmp_path):
    """run.dir that runs into a file (a typo, /dev/null/x) or is one: the lock's one-line refusal naming the file
    in the way, where it used to be a NotADirectoryError / FileExistsError traceback (exit 1)."""
    from memtrain.launcher.train import _lock_run_dir

    file = tmp_path / "file"
    file.write_text("")
    again = ("choose another location (data.dir for prepare, run.dir for train, --out for eval, generate and "
             "scaling), and run the command again")
    with pytest.raises(LaunchError) as err:
        _lock_run_dir(file / "run", 0, torch.device("cpu"))
    assert str(err.value) == f"cannot use {file / 'run'}: {file} is a file, not a folder; {again}"
    with pytest.raises(LaunchError) as err:
        _lock_run_dir(file, 0, torch.device("cpu"))
    assert str(err.value) == f"cannot create the folder {file}: a file of that name is in the way; {again}"
    assert file.read_text() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def _race(run_dir: str, start, done, results) -> None:
    lock = RunLock(run_dir)
    try:
        start.wait(timeout=60)
        lock.acquire()
        results.put("won")
    except LaunchError as e:
        results.put(str(e))
    except Exception as e:  # anything else fails the test (and must not leave the others waiting)
        results.put(f"{type(e).__name__}: {e}")
    try:
        done.wait(timeout=60)  # a winner holds the lock until every racer has tried
    finally:
        lock.release()


def test_racing_for_a_stale_lock_exactly_one_wins(tmp_path):
    ctx = multiprocessing.get_context("fork")
    racers = 4
    for round_ in range(8):
        run = tmp_path / f"run{round_}"
        _write_lock(run, pid=_dead_pid())
        start, done, results = ctx.Barrier(racers), ctx.Barrier(racers), ctx.Queue()
        procs = [ctx.Process(target=_race, args=(str(run), start, done, results), daemon=True) for _ in range(racers)]
        for p in procs:
            p.start()
        try:
            outcomes = [results.get(timeout=60) for _ in range(racers)]
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        assert outcomes.count("won") == 1, outcomes
        assert all("in use by another training run" in o for o in outcomes if o != "won"), outcomes
        assert not (run / LOCK).exists()
