"""Sharded checkpoints: DeepSpeed's engine state plus memtrain's trainer state, with completion markers.

Layout under ``<run.dir>/checkpoints/global_step<N>/``:

- DeepSpeed's files (model states, ZeRO-partitioned optimizer states, the LR scheduler);
- ``trainer_state.json`` (rank 0): step, tokens seen, data-loader position, the resolved recipe;
- ``rank_state_<rank>.pt`` (every rank): that rank's torch / numpy / Python RNG states and its
  data-loader position (ranks differ under cluster-affine placement), loaded with ``weights_only=True``;
- ``COMPLETE.json``: written by rank 0 after a global barrier once every rank has finished writing.
  A tag without it is incomplete (a run killed mid-save) and is never resumed from; DeepSpeed's own
  ``latest`` file is not written, since it can point at an unfinished tag.

Retention: the newest ``checkpoint.keep_last`` complete checkpoints are kept; every checkpoint at a
multiple of ``checkpoint.permanent_every_steps`` is permanent and never pruned.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from memtrain.config import Recipe, recipe_hash_fields
from memtrain.errors import CheckpointError

MARKER = "COMPLETE.json"
TRAINER_STATE = "trainer_state.json"
_TAG_RE = re.compile(r"^global_step(\d+)$")


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"global_step{step}"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    permanent: bool
    world_size: int

    @property
    def tag(self) -> str:
        return self.path.name


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_checkpoints(run_dir: Path) -> tuple[list[CheckpointInfo], list[Path]]:
    """(complete checkpoints sorted by step, incomplete tag folders)."""
    root = checkpoint_root(run_dir)
    complete, incomplete = [], []
    if not root.is_dir():
        return complete, incomplete
    for child in root.iterdir():
        m = _TAG_RE.match(child.name)
        if not m or not child.is_dir():
            continue
        marker = child / MARKER
        if not marker.is_file():
            incomplete.append(child)
            continue
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            incomplete.append(child)
            continue
        complete.append(CheckpointInfo(child, int(m.group(1)), bool(info.get("permanent", False)),
                                       int(info.get("world_size", 1))))
    complete.sort(key=lambda c: c.step)
    incomplete.sort(key=lambda p: p.name)
    return complete, incomplete


def latest_checkpoint(run_dir: Path) -> Optional[CheckpointInfo]:
    complete, _ = list_checkpoints(run_dir)
    return complete[-1] if complete else None


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
    """Write checkpoint ``global_step<step>`` on every rank; rank 0 marks it complete and prunes.
    ``write_extra(path)`` runs on every rank before the completion barrier (e.g. the memory bank)."""
    import torch.distributed as dist

    root = checkpoint_root(recipe.run_dir)
    tag = tag_for(step)
    path = root / tag
    if rank == 0 and path.exists():  # an incomplete leftover from a killed run at the same step
        shutil.rmtree(path)
    if dist.is_initialized():
        dist.barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state={"memtrain_step": step}, save_latest=False)
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"rng": rng_state(), **(rank_extra or {})}, path / f"rank_state_{rank:05d}.pt")
    if write_extra is not None:
        write_extra(path)
    if rank == 0:
        _write_json_atomic(path / TRAINER_STATE, {**trainer_state, "recipe": recipe.to_dict()})
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        every = recipe.steps(recipe.checkpoint.permanent_every_steps)
        permanent = every > 0 and step % every == 0
        _write_json_atomic(path / MARKER, {"step": step, "permanent": permanent, "world_size": world_size,
                                           "time": time.time()})
        prune(recipe.run_dir, recipe.checkpoint.keep_last)
    if dist.is_initialized():
        dist.barrier()
    return path


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete complete, non-permanent checkpoints beyond the newest ``keep_last``, and incomplete
    tags older than the newest complete checkpoint."""
    complete, incomplete = list_checkpoints(run_dir)
    removed = []
    regular = [c for c in complete if not c.permanent]
    for info in regular[:-keep_last] if keep_last > 0 else regular:
        shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info.path)
    if complete:
        newest = complete[-1].step
        for p in incomplete:
            m = _TAG_RE.match(p.name)
            if m and int(m.group(1)) < newest:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def read_trainer_state(info: CheckpointInfo) -> dict:
    try:
        return json.loads((info.path / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {info.path} is marked complete but its {TRAINER_STATE} cannot be "
                              f"read ({e}); delete {info.path / MARKER} to fall back to an older checkpoint")


def check_compatible(info: CheckpointInfo, state: dict, recipe: Recipe, world_size: int) -> None:
    """Refuse to resume a checkpoint whose model or data layout differs from the recipe's."""
    saved = state.get("recipe") or {}
    saved_fields = {"model": saved.get("model"), "memory": saved.get("memory"),
                    "data.seq_len": (saved.get("data") or {}).get("seq_len")}
    current = recipe_hash_fields(recipe)
    defaults = recipe_hash_fields(Recipe())
    for section, now in current.items():
        then = saved_fields.get(section)
        if isinstance(now, dict) and isinstance(then, dict):
            for key in now:
                if key not in then and now[key] == defaults[section].get(key):
                    continue  # a key newer than the checkpoint, left at its default
                if now[key] != then.get(key):
                    raise CheckpointError(
                        f"checkpoint {info.path} was written with {section}.{key}={then.get(key)!r} but the recipe "
                        f"has {now[key]!r}; restore the recipe value or choose a new run.dir")
        elif now != then:
            raise CheckpointError(f"checkpoint {info.path} was written with {section}={then!r} but the recipe "
                                  f"has {now!r}; restore the recipe value or choose a new run.dir")
    if info.world_size != world_size and recipe.data.placement == "affine":
        raise CheckpointError(
            f"checkpoint {info.path} was written by {info.world_size} ranks with data.placement affine; each rank's "
            f"position in its own subtrees is only meaningful for that layout. Resume on {info.world_size} ranks.")
    stage = (saved.get("parallel") or {}).get("zero_stage", 0)
    if info.world_size != world_size and stage > 0:
        raise CheckpointError(
            f"checkpoint {info.path} was written by {info.world_size} ranks with ZeRO stage {stage}; its optimizer "
            f"state is partitioned for that many ranks. Resume on {info.world_size} ranks (this run has "
            f"{world_size}).")


def load(engine, info: CheckpointInfo, rank: int) -> tuple[dict, dict]:
    """Load engine and RNG state for this rank from ``info``; returns (trainer state, this rank's
    extra state such as its data-loader position)."""
    state = read_trainer_state(info)
    damaged = (f"; the folder is damaged. Delete {info.path / MARKER} to resume from the checkpoint before it, "
               "or start a new run.dir")
    try:
        load_path, _ = engine.load_checkpoint(str(info.path.parent), tag=info.tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, pickle.UnpicklingError) as e:
        # A truncated or overwritten shard; DeepSpeed's own error names the file deep inside torch.load.
        raise CheckpointError(f"cannot load {info.path} ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                              + damaged) from None
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {info.path}" + damaged)
    rank_file = info.path / f"rank_state_{rank:05d}.pt"
    extra: dict = {}
    if rank_file.is_file():
        try:
            extra = torch.load(rank_file, weights_only=True)
            set_rng_state(extra.pop("rng"))
        except (RuntimeError, OSError, EOFError, KeyError, pickle.UnpicklingError) as e:
            raise CheckpointError(f"cannot load {rank_file} ({type(e).__name__})" + damaged) from None
    return state, extra


# --------------------------------------------------------------------------------------------------
# Memory bank and anchor weights

BANK_FILE = "memory_bank.pt"
BANK_SHARD = "memory_bank_rank{rank:05d}.pt"


def save_bank(bank, path: Path, rank: int) -> None:
    """The bank's rows and optimizer state: a replicated bank once (rank 0, ``memory_bank.pt``), a
    sharded bank one file per rank (``memory_bank_rank<r>.pt``, rows keyed by global row id, so the
    run can resume on any number of ranks)."""
    sharded = hasattr(bank, "owner")
    if not sharded and rank != 0:
        return
    name = BANK_SHARD.format(rank=rank) if sharded else BANK_FILE
    tmp = path / (name + ".tmp")
    torch.save(bank.state_dict(), tmp)
    os.replace(tmp, path / name)


def read_bank_state(path: Path) -> dict:
    """The bank state of checkpoint ``path``, whichever form wrote it (shard files are merged)."""
    damaged = (f"; delete {path / MARKER} to resume from the checkpoint before it, or start a new run.dir")
    files = [path / BANK_FILE] if (path / BANK_FILE).is_file() else sorted(path.glob("memory_bank_rank*.pt"))
    if not files:
        raise CheckpointError(f"checkpoint {path} has no {BANK_FILE} or memory_bank_rank*.pt although the recipe "
                              "trains memories" + damaged)
    try:
        states = [torch.load(f, weights_only=True, map_location="cpu") for f in files]
    except (RuntimeError, OSError, EOFError, KeyError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"cannot load the memory bank of {path} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]})" + damaged) from None
    if "levels_state" in states[0]:
        from memtrain.parallel.sharded_bank import merge_states

        return merge_states(states)
    return states[0]


def _adamw_state(bank, state: dict) -> Optional[dict]:
    """A merged sharded state's moments as the replicated bank's torch AdamW state (None when the bank
    has no optimizer, as in evaluation, or the shards carry no moments)."""
    if bank.optimizer is None or any(v is None for v in state["exp_avg"].values()):
        return None
    opt = bank.optimizer.state_dict()
    active = [l for l, t in enumerate(bank.tables) if t is not None]
    opt["state"] = {i: {"step": torch.tensor(float(state["step"])), "exp_avg": state["exp_avg"][str(l)],
                        "exp_avg_sq": state["exp_avg_sq"][str(l)]} for i, l in enumerate(active)}
    return opt


def load_bank(bank, path: Path) -> None:
    """Load the bank of checkpoint ``path`` into ``bank`` (replicated or sharded, any world size)."""
    state = read_bank_state(path)
    try:
        if "levels_state" in state and not hasattr(bank, "owner"):
            state = {**state, "optimizer": _adamw_state(bank, state)}  # sharded -> replicated
        bank.load_state_dict(state)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}; the recipe's memory settings differ from the checkpoint's") from None


def resolve(path: str | Path) -> CheckpointInfo:
    """A complete checkpoint from a ``global_stepN`` folder or a run directory (its newest one)."""
    p = Path(path)
    if (p / MARKER).is_file() and _TAG_RE.match(p.name):
        found = [c for c in list_checkpoints(p.parent.parent)[0] if c.path == p]
        if found:
            return found[0]
    if p.is_dir():
        info = latest_checkpoint(p)
        if info is not None:
            return info
    raise CheckpointError(f"{path} is neither a complete checkpoint folder (global_stepN with {MARKER}) nor a run "
                          "directory holding one; point to a run.dir or one of its checkpoints/global_stepN")


def load_module_state(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The model's full state dict from a DeepSpeed checkpoint (ZeRO 0-2: the rank-0 model states;
    ZeRO-3: consolidated from the partitions by DeepSpeed's zero_to_fp32)."""
    file = info.path / "mp_rank_00_model_states.pt"
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
        module = state.get("module")
        if module:
            return module
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(info.path.parent), tag=info.tag)
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"cannot read the model weights of {info.path} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]})") from None


def load_anchor(model: torch.nn.Module, path: str | Path) -> CheckpointInfo:
    """Load ``model.init_from``: every anchor weight must be present with its shape; memory parameters
    (the generic memory) missing from an anchor-only checkpoint keep their initial values."""
    info = resolve(path)
    state = load_module_state(info)
    own = model.state_dict()
    mismatched = [k for k, v in state.items() if k in own and tuple(own[k].shape) != tuple(v.shape)]
    if mismatched:
        k = mismatched[0]
        raise CheckpointError(f"model.init_from {info.path}: {k} has shape {tuple(state[k].shape)} there but "
                              f"{tuple(own[k].shape)} in this recipe's model; the anchor settings differ")
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith("generic_memory.") and k != "lm_head.weight"]
    unexpected = [k for k in result.unexpected_keys if not k.startswith("generic_memory.")]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(f"model.init_from {info.path}: the checkpoint's weights do not fit this model ({what}); "
                              "the anchor settings differ")
    return info


def summarize(info: CheckpointInfo) -> dict[str, Any]:
    return {"path": str(info.path), "step": info.step, "permanent": info.permanent, "world_size": info.world_size}
