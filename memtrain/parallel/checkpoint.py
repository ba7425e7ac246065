"""Sharded checkpoints: DeepSpeed's engine state plus memtrain's trainer state, written into a temporary
folder, checksummed, and renamed into place.

Layout under ``<run.dir>/checkpoints/global_step<N>/``:

- DeepSpeed's files (model states, ZeRO-partitioned optimizer states, the LR scheduler);
- ``trainer_state.json`` (rank 0): step, tokens seen, data-loader position, the resolved recipe, whether the
  optimizer groups were cut for aligned flat buffers (``param_groups_aligned``);
- ``rank_state_<rank>.pt`` (every rank): that rank's torch / numpy / Python RNG states and its
  data-loader position (ranks differ under cluster-affine placement), loaded with ``weights_only=True``;
- ``memory_bank/`` (with memories, through ``save``'s ``write_extra``);
- ``COMPLETE.json``: the step, permanence, world size, and every other file's size and xxh64 checksum.

How a save proceeds (:func:`save`): every rank writes into ``.global_step<N>.partial`` (rank 0 first removes
leftovers of killed saves); after a barrier the ranks hash the files (file ``i`` by rank ``i % world``) and
rank 0 writes ``COMPLETE.json``, renames the folder to ``global_step<N>``, fsyncs ``checkpoints/``, writes
``checkpoints/latest`` (the tag, as DeepSpeed's ``save_latest``: DeepSpeed's ``zero_to_fp32.py`` then needs no
``-t``) and prunes. A crash at any point leaves either no ``global_step<N>`` or a complete one. A write the
storage fails (a full disk, a quota) is one :class:`memtrain.errors.StorageError` naming the space left and
the checkpoint to resume from: raised at once by the rank whose writes failed (the others may be inside a
collective of DeepSpeed's save), or by every rank alike when rank 0's marker or rename failed (the last
barrier carries it); the partial folder is removed by rank 0 when every rank is done with it, else at the
run's next start. Readers call :func:`verify` (the files against the checksums) and read inside
:func:`reading`, which keeps :func:`prune` of a concurrent training run off the folder.

Retention: the newest ``checkpoint.keep_last`` complete checkpoints are kept; every checkpoint at a
multiple of ``checkpoint.permanent_every_steps`` is permanent and never pruned.

This module composes a checkpoint from its parts: the folders, the marker, checksums, reading locks and
retention are :mod:`memtrain.parallel.checkpoint_folder`, the memory bank's rows
:mod:`memtrain.parallel.bank_checkpoint`; the engine, RNG and trainer state, DeepSpeed universal
conversion and the anchor weights are here.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from memtrain.config import Recipe, recipe_hash_defaults, recipe_hash_fields
from memtrain.errors import CheckpointError, StorageError
from memtrain.parallel.bank_checkpoint import FOLDER as BANK_FOLDER
from memtrain.parallel.bank_checkpoint import load_bank, read_bank_state, save_bank
from memtrain.parallel.checkpoint_folder import (
    LATEST, MARKER, TRAINER_STATE, CheckpointInfo, DamagedCheckpoint, checkpoint_files, checkpoint_root,
    damaged_checkpoints, fallback, free_bytes, hash_files, is_removed, latest_checkpoint, leftovers,
    list_checkpoints, mark_complete, partial_tag_for, previous_checkpoint, prune, publish, read_trainer_state,
    reading, removed, resolve, summarize, tag_for, verify, write_json_atomic, write_latest,
)
from memtrain.parallel.dist import barrier, gather_strings, is_collective_failure

# --------------------------------------------------------------------------------------------------
# Per-rank RNG state


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"key": np_state[0], "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached_gaussian": float(np_state[4]), "keys": torch.from_numpy(np_state[1].astype(np.int64))},
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["key"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------------------------------
# Save / load


def save(engine, recipe: Recipe, *, step: int, trainer_state: dict, rank: int, world_size: int,
         rank_extra: Optional[dict] = None, write_extra: Optional[Callable[[Path], None]] = None) -> Path:
    """Write checkpoint ``global_step<step>`` on every rank (collective); returns its final path.

    Every rank writes into the temporary folder ``.global_step<step>.partial`` (DeepSpeed's files, its
    rank file, ``write_extra(folder)``: e.g. the memory bank; rank 0 the trainer state); after a barrier
    the ranks hash the files, and rank 0 writes ``COMPLETE.json``, renames the folder into place (replacing
    an incomplete one of that name), writes ``checkpoints/latest`` and prunes."""
    import torch.distributed as dist

    collective = dist.is_available() and dist.is_initialized()
    root = checkpoint_root(recipe.run_dir)
    partial_tag = partial_tag_for(step)
    folder = root / partial_tag
    if rank == 0:  # partial folders of killed saves, this step's included
        for old in leftovers(recipe.run_dir):
            shutil.rmtree(old)
        root.mkdir(parents=True, exist_ok=True)
    if collective:
        dist.barrier()

    def write() -> None:
        engine.save_checkpoint(str(root), tag=partial_tag, client_state={"memtrain_step": step}, save_latest=False)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"rng": rng_state(), **(rank_extra or {})}, folder / f"rank_state_{rank:05d}.pt")
        if write_extra is not None:
            write_extra(folder)
        if rank == 0:
            write_json_atomic(folder / TRAINER_STATE, {**trainer_state, "recipe": recipe.to_dict()})

    # A rank whose writes fail raises at once: the others may be inside a collective of DeepSpeed's save or of
    # the bank's, so it cannot wait for them to agree; they stop when their next collective loses it.
    failure = _write_failure(write, root, rank)
    if failure is not None:
        raise _save_failed(recipe, step, folder, [failure], rank, removed=world_size == 1)
    if collective:
        dist.barrier()
    # Every rank hashes (and fsyncs) its share of the files rank 0 lists; rank 0 collects the records.
    names = [checkpoint_files(folder) if rank == 0 else None]
    if collective and world_size > 1:
        dist.broadcast_object_list(names, src=0)
    mine = hash_files(folder, names[0][rank::max(world_size, 1)], sync=True)
    records = [mine]
    if collective and world_size > 1:
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, mine)
    final = root / tag_for(step)
    if rank == 0:
        files = {name: rec for part in records for name, rec in part.items()}
        every = recipe.steps(recipe.checkpoint.permanent_every_steps)
        permanent = every > 0 and step % every == 0
        failure = _write_failure(lambda: (mark_complete(folder, step, permanent, world_size, files),
                                          publish(folder, final)), root, rank)
        if failure is None:
            write_latest(recipe.run_dir, final.name)
            prune(recipe.run_dir, recipe.checkpoint.keep_last)
    # The last barrier carries rank 0's outcome: every rank raises the same error if marking or renaming failed.
    failures = gather_strings([failure] if failure else [])
    if failures:
        raise _save_failed(recipe, step, folder, failures, rank, removed=True)
    return final


# A write that fails with a RuntimeError (torch.save's C++ writer reports a full disk as "unexpected pos ..." or
# "iostream error", without an errno) counts as a failed save when its file system has less than this left.
_FULL_BYTES = 16 << 20


def _write_failure(write: Callable[[], Any], root: Path, rank: int) -> Optional[str]:
    """Run ``write`` (this rank's part of a save); ``"rank R: <error>"`` when the storage failed it, else None.
    Storage failures are OSErrors (no space, quota, permissions, I/O) and RuntimeErrors raised while the file
    system is full; any other error is not the storage's and propagates with its traceback."""
    try:
        write()
    except OSError as e:
        return f"rank {rank}: {e}"
    except RuntimeError as e:
        if is_collective_failure(e) or free_bytes(root) >= _FULL_BYTES:
            raise
        text = str(e).strip().splitlines()
        return f"rank {rank}: {text[-1][:200] if text else type(e).__name__}"
    return None


def _save_failed(recipe: Recipe, step: int, folder: Path, failures: list[str], rank: int,
                 removed: bool) -> StorageError:
    """The one-line error of a save whose writes failed: the failure, the space left, what a checkpoint of the run
    takes, and the checkpoint the run resumes from. ``removed``: rank 0 deletes the partial folder now, giving its
    space back (the only writer, or every rank is done with it); otherwise the run's next start removes it."""
    root = folder.parent
    free = free_bytes(root)  # as the save left it: every rank measures before rank 0 removes the folder
    complete, _ = list_checkpoints(recipe.run_dir)
    last = complete[-1] if complete else None
    older = [c for c in complete[:-1] if not c.permanent]
    more = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
    space = f"{free / 2**20:,.1f} MiB free" if free != float("inf") else "unknown free space"
    size = ""
    if last is not None:
        taken = sum(f.stat().st_size for f in last.path.rglob("*") if f.is_file())
        size = (f"; a checkpoint of this run takes {taken / 2**20:,.1f} MiB, and checkpoint.keep_last "
                f"{recipe.checkpoint.keep_last} of them plus the one being written must fit")
    partial = "its partial save was removed" if removed else "the next start removes its partial save"
    resume = (f"running the same command resumes from {last.path} (step {last.step})" if last is not None else
              "running the same command starts again from step 0 (no checkpoint was written before)")
    room = f" (an older checkpoint, such as {older[0].path.name}, may go)" if older else ""
    if removed:
        barrier()  # no-op in a world of one
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return StorageError(f"saving checkpoint {tag_for(step)} failed: {failures[0]}{more}. The file system of {root} "
                        f"has {space}{size}. The run stopped at step {step}; {partial}, and {resume} once there is "
                        f"room: free space there{room}, lower checkpoint.keep_last, or move run.dir to a larger disk")


def _first_difference(now: Any, then: Any, default: Any, name: str) -> Optional[tuple[str, Any, Any]]:
    """``(key, checkpoint value, recipe value)`` of the first difference between ``now`` and ``then``,
    nested sections key by key; a key the checkpoint lacks (newer than it) counts only when its value
    is not the default."""
    if isinstance(now, dict) and isinstance(then, dict):
        for key, value in now.items():
            key_default = default.get(key) if isinstance(default, dict) else None
            if key not in then and value == key_default:
                continue
            found = _first_difference(value, then.get(key), key_default, f"{name}.{key}")
            if found is not None:
                return found
        return None
    return None if now == then else (name, then, now)


# What a key that cannot change on resume offers instead (check_compatible's message).
_RESUME_HINTS = {
    "memory.crossattn.freeze_bank": (" (to freeze the bank partway through this run: memory.crossattn.freeze_bank_at; "
                                     "to start frozen from this checkpoint's weights: model.init_from in the new "
                                     "run.dir)"),
    "memory.crossattn.bank": " (model.init_from in the new run.dir starts from this checkpoint's weights)",
}


def check_compatible(info: CheckpointInfo, state: dict, recipe: Recipe, world_size: int) -> None:
    """Refuse to resume a checkpoint whose model or data layout differs from the recipe's."""
    saved = state.get("recipe") or {}
    then, now, defaults = recipe_hash_fields(saved), recipe_hash_fields(recipe), recipe_hash_defaults()
    for section in now:
        found = _first_difference(now[section], then.get(section), defaults.get(section), section)
        if found is not None:
            key, was, has = found
            raise CheckpointError(f"checkpoint {info.path} was written with {key}={was!r} but the recipe has "
                                  f"{has!r}; restore the recipe value, or train with it from the start in a new "
                                  f"run.dir{_RESUME_HINTS.get(key, '')}")
    if info.world_size != world_size and recipe.data.placement == "affine":
        raise CheckpointError(
            f"checkpoint {info.path} was written by {info.world_size} ranks with data.placement affine; each rank's "
            f"position in its own subtrees is only meaningful for that layout. Resume on {info.world_size} ranks.")
    saved_stage = (saved.get("parallel") or {}).get("zero_stage", 0)
    stage = recipe.parallel.zero_stage
    if (saved_stage == 0) != (stage == 0):
        raise CheckpointError(
            f"checkpoint {info.path} was written with parallel.zero_stage={saved_stage} but the recipe has {stage}; "
            "the optimizer state of ZeRO stage 0 (one torch optimizer per rank) and of ZeRO stages 1-3 "
            f"(partitioned) do not convert into each other. Set parallel.zero_stage={saved_stage}"
            + (" (or any stage 1-3)" if saved_stage > 0 else ""))


PRECISION_KEY = "precision"  # trainer_state.json: the precision the run trained in (since 2026-11-30)


def saved_precision(info: CheckpointInfo, state: dict) -> Optional[str]:
    """The precision a checkpoint was trained in: recorded in its trainer state, or for one written before the
    record under ZeRO 1-3 the names of DeepSpeed's optimizer files (``bf16_zero_pp_rank_*`` with bf16 on); None
    when neither tells."""
    if state.get(PRECISION_KEY) in ("fp32", "bf16"):
        return state[PRECISION_KEY]
    if any(info.path.glob("bf16_zero_pp_rank_*_optim_states.pt")):
        return "bf16"
    if any(info.path.glob("zero_pp_rank_*_optim_states.pt")):
        return "fp32"
    return None


def check_precision(info: CheckpointInfo, state: dict, precision: str) -> None:
    """Refuse to resume a checkpoint in another precision than it was trained in (``parallel.precision``, or
    ``auto`` resolving to bf16 on a GPU and fp32 on a CPU): DeepSpeed's optimizer state of one does not load into
    the other (its bf16 optimizers keep fp32 masters and name their files apart), and the load used to fail
    with a missing file reported as a damaged checkpoint."""
    was = saved_precision(info, state)
    if was is None or was == precision:
        return
    where = "on a GPU (parallel.precision bf16 or auto)" if was == "bf16" else "with parallel.precision fp32"
    raise CheckpointError(f"checkpoint {info.path} was trained in {was} but this run is {precision}; resume it "
                          f"{where}, or start a new run.dir with model.init_from={info.path} to go on from its weights")


def data_identity(meta: dict) -> dict:
    """The prepared data a run trains on, as its ``meta.json`` names it: the settings' fingerprint and when it was
    prepared (a folder prepared again, from changed sources, has another time)."""
    return {"fingerprint": meta.get("fingerprint"), "created": meta.get("created")}


def check_same_data(info: CheckpointInfo, state: dict, meta: dict, data_dir: Path) -> None:
    """Refuse to resume a checkpoint on other prepared data than it trained on: its data-loader position (a sample
    index into the shards) would silently continue in other samples. Checkpoints written before the record: no check.
    Settings that differ are refused earlier (the recipe against the folder); this catches the same settings
    prepared again (``--force`` after the sources changed, a remote prepared again)."""
    then, now = state.get(DATA_KEY), data_identity(meta)
    if then is None or then == now:
        return
    raise CheckpointError(f"checkpoint {info.path} was trained on the data prepared at {then.get('created')}, but "
                          f"{data_dir} holds data prepared at {now.get('created')}; its data-loader position does not "
                          "apply to other data. Resume with the data it was trained on, or start a new run.dir with "
                          f"model.init_from={info.path} to continue from its weights")


def token_durations(recipe: Recipe) -> list[str]:
    """The recipe keys whose duration is given in tokens (``train.max_steps: 2B tokens``), dotted."""
    import dataclasses

    from memtrain.config import Duration

    found: list[str] = []

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, Duration) and value.unit == "tokens":
                found.append(prefix + f.name)
            elif dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")

    walk(recipe, "")
    return found


def check_token_durations(info: CheckpointInfo, state: dict, recipe: Recipe) -> None:
    """Training's check before it resumes ``info`` (``state``: its trainer state). A duration in tokens becomes
    steps at the recipe's tokens per step. Resumed at another global batch, the checkpoint's steps were taken at
    the old one, so the run would stop early or late (81,920 tokens at 4,096 per step, resumed at 8,192 per step
    from step 10: "run already complete at step 10" after 40,960 tokens): refused, with the two ways on."""
    keys, saved = token_durations(recipe), state.get("recipe") or {}
    try:
        seq = int(saved["data"]["seq_len"])
        was = int(saved["train"]["global_batch_tokens"]) // seq * seq
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return
    if not keys or was == recipe.tokens_per_step:
        return
    given = ", ".join(keys)
    raise CheckpointError(
        f"checkpoint {info.path} was written at {was:,} tokens per step (train.global_batch_tokens) but the recipe has "
        f"{recipe.tokens_per_step:,}, and {given} {'is' if len(keys) == 1 else 'are'} given in tokens, which count in "
        f"steps of the recipe's batch from step 0; restore train.global_batch_tokens: "
        f"{saved['train']['global_batch_tokens']}, or give {given} in steps")


# Trainer-state key: whether the run cut its optimizer groups for aligned flat buffers
# (memtrain.parallel.engine.split_for_alignment). Absent in checkpoints written before memtrain did.
ALIGNED_KEY = "param_groups_aligned"
# trainer_state.json: which preparation of the data the run trained on (:func:`data_identity`)
DATA_KEY = "data"


def param_groups_aligned(state: dict) -> bool:
    """Whether a checkpoint's optimizer state was written with the parameter groups cut for alignment; a run
    resumed from it builds its groups the same way, since DeepSpeed's ZeRO and bf16 states are per-group flat
    buffers that load only into the same groups. False for checkpoints that predate the key."""
    return bool(state.get(ALIGNED_KEY, False))


def needs_universal(info: CheckpointInfo, state: dict, recipe: Recipe, world_size: int) -> bool:
    """Whether resuming ``info`` needs DeepSpeed's universal checkpoint: its ZeRO-partitioned optimizer
    state was written for another data-parallel size or another ZeRO stage (1-3)."""
    saved_stage = ((state.get("recipe") or {}).get("parallel") or {}).get("zero_stage", 0)
    if saved_stage == 0:
        return False  # ZeRO 0: every rank's model-states file holds the whole optimizer state
    return info.world_size != world_size or saved_stage != recipe.parallel.zero_stage


UNIVERSAL = "universal"


def ensure_universal(info: CheckpointInfo, rank: int) -> Path:
    """Convert checkpoint ``info`` into a DeepSpeed universal checkpoint at ``<info.path>/universal``
    (once: rank 0 runs DeepSpeed's ``ds_to_universal`` into a temporary folder and renames it when it
    succeeds; every rank waits at a barrier). Returns the folder. A later resume on the new size loads
    the new checkpoints written by this run, not this folder."""
    import subprocess
    import sys

    import torch.distributed as dist

    out = info.path / UNIVERSAL
    if rank == 0 and not (out / "zero").is_dir():
        tmp = info.path / (UNIVERSAL + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(info.path),
               "--output_folder", str(tmp), "--inject_missing_state", "--num_extract_workers", "2",
               "--num_merge_workers", "2"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            failure = f"converting {info.path} to a universal checkpoint failed: {tail[0][:300]}"
        else:
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
            failure = ""
    else:
        failure = ""
    if dist.is_initialized():
        flag = [failure]
        dist.broadcast_object_list(flag, src=0)
        failure = flag[0]
    if failure:
        if is_removed(info):
            raise removed(info)
        raise CheckpointError(failure + f"; resume on {info.world_size} ranks with the checkpoint's ZeRO stage, or, "
                              f"if a file is damaged, {fallback(info)}")
    return out


def load(engine, info: CheckpointInfo, rank: int, universal: bool = False) -> tuple[dict, dict]:
    """Load engine and RNG state for this rank from ``info``; returns (trainer state, this rank's
    extra state such as its data-loader position). ``universal``: load the engine from the universal
    checkpoint made by :func:`ensure_universal` (the engine must be built with ``load_universal``).
    A rank the checkpoint had no rank file for (more ranks than before) keeps its fresh RNG state."""
    state = read_trainer_state(info)
    load_dir, tag = (str(info.path), UNIVERSAL) if universal else (str(info.path.parent), info.tag)
    groups = _base_optimizer(engine).param_groups if universal else []
    settings = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in groups]
    scheduler = getattr(engine, "lr_scheduler", None)
    peaks = list(scheduler.base_lrs) if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) else None
    try:
        load_path, _ = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, pickle.UnpicklingError) as e:
        # A truncated or overwritten shard; DeepSpeed's own error names the file deep inside torch.load.
        raise _damaged(info, f"cannot load {info.path} ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if load_path is None:
        raise _damaged(info, f"DeepSpeed found no checkpoint in {info.path}")
    if universal:
        _repair_universal_load(engine, settings)
    if peaks is not None:
        _follow_recipe_schedule(engine, scheduler, peaks)
    rank_file = info.path / f"rank_state_{rank:05d}.pt"
    extra: dict = {}
    if rank_file.is_file():
        try:
            extra = torch.load(rank_file, weights_only=True)
            set_rng_state(extra.pop("rng"))
        except (RuntimeError, OSError, EOFError, KeyError, pickle.UnpicklingError) as e:
            raise _damaged(info, f"cannot load {rank_file} ({type(e).__name__})")
    return state, extra


def _damaged(info: CheckpointInfo, what: str) -> CheckpointError:
    """A read failure of ``info``: removed by another process, or damaged (with the fallback)."""
    if is_removed(info):
        return removed(info)
    return CheckpointError(f"{what}; the folder is damaged: {fallback(info)}")


def _base_optimizer(engine):
    """The torch optimizer inside DeepSpeed's ZeRO wrapper (or the engine's optimizer itself)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _follow_recipe_schedule(engine, scheduler, peaks: list[float]) -> None:
    """Make the restored LR scheduler follow the recipe's schedule at the restored step: ``peaks`` are the peak
    learning rates it was built with (:func:`memtrain.parallel.engine.build_scheduler`, from the recipe). torch's
    LambdaLR saves its ``base_lrs``, and DeepSpeed restores them with every group's ``initial_lr`` and ``lr``, so a
    learning rate changed for the resumed run (train.optimizer.lr lowered after a divergence, as its advice says;
    memory.optimizer.lr, memory.crossattn.bank_lr) was silently the checkpoint's while ``optim/lr`` logged the new
    one (1e-3 lowered to 1e-4: 8.5e-4 applied, 9.6e-5 logged). Unchanged rates give the same values as before."""
    lrs = [peak * schedule(scheduler.last_epoch) for peak, schedule in zip(peaks, scheduler.lr_lambdas)]
    for group, peak, lr in zip(_base_optimizer(engine).param_groups, peaks, lrs):
        group["initial_lr"], group["lr"] = peak, lr
    scheduler.base_lrs = list(peaks)
    scheduler._last_lr = lrs


def _repair_universal_load(engine, settings: list[dict]) -> None:
    """Undo two things DeepSpeed 0.19's ZeRO-3 universal load
    (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) does to the torch optimizer:

    - it copies the saved *first* parameter group's hyperparameters into every group ("generally the
      same"), so the no-decay group gets weight decay and the memory group the anchor's settings:
      every group gets back its own (``settings``, read before loading: the recipe's, as built by
      :func:`memtrain.parallel.engine.param_groups`), and its lr from the restored LR scheduler;
    - it assigns one ``step`` tensor object to every group's AdamW state, which torch increments in
      place, so each step would count once per group: each state gets its own counter.

    Measured on a tiny model saved by 2 ZeRO-3 ranks: without these the resumed losses drift by 4e-4
    (shared counter) and 2e-5 (weight decay on norms) within three steps; with them they match the
    uninterrupted run as ZeRO-2's do. Harmless for the ZeRO-1/2 path, which restores both correctly."""
    base = _base_optimizer(engine)
    for group, own in zip(base.param_groups, settings):
        group.update(own)
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and hasattr(scheduler, "get_last_lr"):
        for group, lr in zip(base.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    seen: set[int] = set()
    for state in getattr(base, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(state["step"]))


# --------------------------------------------------------------------------------------------------
# Anchor weights


def load_module_state(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The model's full state dict from a DeepSpeed checkpoint (ZeRO 0-2: the rank-0 model states;
    ZeRO-3: consolidated from the partitions by DeepSpeed's zero_to_fp32)."""
    file = info.path / "mp_rank_00_model_states.pt"
    try:
        # ZeRO-3 writes zero_pp_rank_<r>_mp_rank_00_model_states.pt instead, whose "module" holds only the
        # rank's empty partitioned placeholders: its weights are the fp32 partitions of the optimizer files.
        if file.is_file() or not any(info.path.glob("zero_pp_rank_*_mp_rank_00_model_states.pt")):
            state = torch.load(file, weights_only=True, map_location="cpu")
            module = state.get("module")
            if module:
                return module
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(info.path.parent), tag=info.tag)
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, pickle.UnpicklingError) as e:
        if is_removed(info):
            raise removed(info) from None
        raise CheckpointError(f"cannot read the model weights of {info.path} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]}); the folder is damaged: use another checkpoint "
                              f"(checkpoint=PATH), or {fallback(info)}") from None


# The cross-attention memory's state-dict keys (``DecoderLM.crossattn``, crossattn-memory-banks paper).
CROSSATTN_PREFIX = "crossattn."


def load_anchor(model: torch.nn.Module, path: str | Path, rank: int = 0, world: int = 1,
                log: Optional[Callable[[str], None]] = None) -> CheckpointInfo:
    """Load ``model.init_from``: every anchor weight must be present with its shape; memory parameters
    missing from an anchor-only checkpoint keep their initial values: the generic memory's, and the whole
    cross-attention memory when the checkpoint holds none of it (banks, memory layers, routers; ``W_O``
    starts at zero, eq. 21 of the crossattn-memory-banks paper, so the model starts as the anchor; ``log``
    gets one line saying so). A checkpoint holding part of a cross-attention memory does not fit; a sharded
    chapter bank's rows are read from the checkpoint's bank folder. The files are verified against their
    checksums first (collective over ``world`` ranks when given, else each caller checks all), and the folder
    is held against pruning while it is read."""
    info = resolve(path)
    with reading(info):
        verify(info, rank, world)
        state = load_module_state(info)
        saved = (read_trainer_state(info).get("recipe") or {}) if (info.path / BANK_FOLDER).is_dir() else {}
        saved_c = (saved.get("memory") or {}).get("crossattn") or {}
        if saved_c.get("bank") == "sharded":
            # A sharded chapter bank is saved in the checkpoint's DCP bank folder, not in DeepSpeed's module
            # state (as memtrain eval's load_model merges it).
            from memtrain.parallel.chapter_bank import latent_bank_state

            width = saved_c.get("dim") or (saved.get("model") or {}).get("d_model")
            state = {**state, **latent_bank_state(info.path, width=int(width))}
    own = model.state_dict()
    mismatched = [k for k, v in state.items() if k in own and tuple(own[k].shape) != tuple(v.shape)]
    if mismatched:
        k = mismatched[0]
        raise CheckpointError(f"model.init_from {info.path}: {k} has shape {tuple(state[k].shape)} there but "
                              f"{tuple(own[k].shape)} in this recipe's model; the anchor settings differ")
    memory_less = not any(k.startswith(CROSSATTN_PREFIX) for k in state)
    fresh = [k for k in own if k.startswith(CROSSATTN_PREFIX)] if memory_less else []
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys
               if not k.startswith("generic_memory.") and k != "lm_head.weight" and k not in fresh]
    unexpected = [k for k in result.unexpected_keys if not k.startswith("generic_memory.")]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(f"model.init_from {info.path}: the checkpoint's weights do not fit this model ({what}); "
                              "the anchor settings differ")
    if fresh and log is not None:
        numel = sum(own[k].numel() for k in fresh)
        log(f"model.init_from: {info.path} holds no cross-attention memory: the memory's {len(fresh)} tensors "
            f"({numel:,} parameters: banks, memory layers, routers) keep their fresh initialisation (W_O = 0: the "
            "model starts as the anchor)")
    return info


# The checkpoint API of the trainer and of evaluation: this module's own functions plus the folder
# helpers (:mod:`.checkpoint_folder`) and the bank's (:mod:`.bank_checkpoint`) it composes.
__all__ = [
    "LATEST", "MARKER", "TRAINER_STATE", "UNIVERSAL", "CheckpointInfo", "DamagedCheckpoint", "check_compatible",
    "check_token_durations", "checkpoint_root", "damaged_checkpoints", "ensure_universal", "latest_checkpoint",
    "leftovers", "list_checkpoints", "load", "load_anchor", "load_bank", "load_module_state", "needs_universal",
    "partial_tag_for", "previous_checkpoint", "prune", "read_bank_state", "read_trainer_state", "reading",
    "resolve", "rng_state", "save", "save_bank", "set_rng_state", "summarize", "tag_for", "token_durations",
    "verify", "write_latest",
]
