"""The memory bank's checkpoint: a torch.distributed.checkpoint (DCP) folder keyed by global row.

../shared/DESIGN.md, "The sharded memory bank": checkpoints store row shards with their global row
ranges, so a run resumes on a different number of ranks. Here every table is saved as one global
tensor indexed by global row (= cluster id), whichever bank wrote it, so a checkpoint written by W
ranks loads on any W' ranks, into either bank kind (:class:`~memtrain.parallel.bank.MemoryBank`,
replicated, or :class:`~memtrain.parallel.sharded_bank.ShardedMemoryBank`).

On disk, ``<checkpoint>/memory_bank/``:

- DCP files (``.metadata`` and ``__<rank>_0.distcp``, written by ``FileSystemWriter``) holding, for
  every active level ``l`` (0-based, ``r_l > 0``):

  - ``level{l}.rows`` ``[k^(l+1), s_l]`` in the bank's storage dtype;
  - ``level{l}.exp_avg``, ``level{l}.exp_avg_sq`` ``[k^(l+1), s_l]`` fp32, the AdamW moments (absent
    when the bank had no optimizer state);
  - ``level{l}.owner`` int32 ``[k^(l+1)]``: the owner map, the rank that held each row when saved
    (``-1`` for a replicated bank). Informational: a load places rows by the *loading* bank's
    :meth:`~memtrain.parallel.sharded_bank.ShardedMemoryBank.owner`, never by this map.

- ``bank.json`` (written last, by one process, after DCP has finished): format version, kind,
  ``step``, ``mode``, ``hparams``, ``levels``, ``branching``, ``block_sizes``, ``world_size`` at save
  and whether moments are present. Readable without a process group; a folder without it is an
  unfinished save and is refused.

The canonical layout. A sharded bank's rows sit on their owners (round robin or cluster-affine: an
arbitrary row set per rank). To save them as DCP shards each rank must hold a contiguous block, so
:func:`save` first redistributes every level by global row with ``all_to_all_single`` to the
canonical layout: rank ``r`` of ``W`` holds rows ``[r c, min((r + 1) c, n))``, ``c = ceil(n / W)``
(``torch.chunk`` semantics, the last ranks' blocks possibly empty: exactly DTensor's ``Shard(0)``
split), wraps each block as a ``DTensor`` ``Shard(0)`` on a 1-D CPU ``DeviceMesh`` over the bank's
process group (``from_local`` with the explicit global shape and stride, since blocks are uneven)
and calls ``dcp.save``. :func:`load` builds the same canonical DTensors for the *loading* world,
lets ``dcp.load`` read the overlapping parts of the saved blocks (DCP reshards), then sends each row
to its new owner (``all_to_all_single``) and calls ``bank.load_state_dict`` with the rows each rank
owns. A replicated bank is saved as plain full tensors by one process, and loaded as full tensors
(no collective), which also serves evaluation in a single process without a process group.

Transient memory (one rank): saving holds the bank's ``state_dict()`` copy of its rows and moments
plus the canonical block (about as large) plus one field's send buffer: ~2x the rank's shard.
Loading holds the canonical block, the rows routed to their owners and the copy
``load_state_dict`` makes: ~2-3x the shard; DCP reads a saved block whole before slicing it (one at
a time), so a rank may also briefly hold one block of the *saving* world (the whole table when the
checkpoint came from a replicated bank). Rows and moments travel bit-exactly (as bytes).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch

from memtrain.errors import CheckpointError
from memtrain.parallel.checkpoint_folder import MARKER

FOLDER = "memory_bank"
META = "bank.json"
FORMAT = "memtrain.bank.dcp/v1"
_FIELDS = ("rows", "exp_avg", "exp_avg_sq")
_READ_ERRORS = (RuntimeError, OSError, EOFError, KeyError, ValueError, AssertionError, pickle.UnpicklingError)


def _dist():
    d = torch.distributed
    return d if (d.is_available() and d.is_initialized()) else None


def _is_sharded(bank) -> bool:
    return hasattr(bank, "owner")


def _collective(bank) -> bool:
    """Sharded over more than one process: save and load are collectives over ``bank.group``."""
    return _is_sharded(bank) and _dist() is not None and bank.world > 1


def _active(layout) -> list[int]:
    return [l for l in range(layout.depth) if layout.levels[l] > 0]


def _layout_meta(layout) -> dict:
    return {"levels": list(layout.levels), "branching": layout.branching,
            "block_sizes": [layout.block_size(l) for l in range(layout.depth)]}


def _damaged(folder: Path, why: str) -> CheckpointError:
    return CheckpointError(f"the memory bank {folder} is damaged or incomplete ({why}); delete "
                           f"{folder.parent / MARKER} to fall back to the previous checkpoint, or start a new run.dir")


def _chunk(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of rank ``rank`` in the canonical layout (torch.chunk / DTensor Shard(0))."""
    c = math.ceil(n / world) if n else 0
    lo = min(rank * c, n)
    return lo, min(lo + c, n)


def _comm_device(group) -> torch.device:
    d = _dist()
    if d is not None and d.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange(t: torch.Tensor, send: list[int], recv: list[int], group, device: torch.device) -> torch.Tensor:
    """all_to_all_single along dim 0, bit-exact for every dtype (sent as bytes); returns a CPU tensor."""
    shape = tuple(t.shape[1:])
    width = math.prod(shape) * t.element_size()
    flat = t.contiguous().reshape(t.shape[0], math.prod(shape)).view(torch.uint8).reshape(t.shape[0], width)
    out = torch.empty(sum(recv), width, dtype=torch.uint8, device=device)
    torch.distributed.all_to_all_single(out, flat.to(device), recv, send, group=group)
    return out.cpu().view(t.dtype).reshape(sum(recv), *shape)


def _exchange_splits(send: list[int], group, device: torch.device) -> list[int]:
    t = torch.tensor(send, dtype=torch.int64, device=device)
    out = torch.empty_like(t)
    torch.distributed.all_to_all_single(out, t, group=group)
    return [int(v) for v in out.tolist()]


def _mesh(group):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group if group is not None else torch.distributed.group.WORLD, "cpu")


def _sharded(local: torch.Tensor, mesh, rows: int):
    """A canonical block as a DTensor Shard(0) of global shape ``[rows, *local.shape[1:]]``."""
    from torch.distributed.tensor import DTensor, Shard

    shape = torch.Size([rows, *local.shape[1:]])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


@contextlib.contextmanager
def _quiet():
    """DCP warns on every single-process call; that mode is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_save(state: dict, folder: Path, group, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):
        """Records no path in ``.metadata``: the checkpoint is written into a temporary folder and renamed
        (:func:`memtrain.parallel.checkpoint.save`). Loading never used it (files are relative to the reader's
        folder); leaving it out keeps a stale path out of the checkpoint."""

        def storage_meta(self):
            meta = super().storage_meta()
            if meta is not None:
                meta.checkpoint_id = None
            return meta

    with _quiet():
        dcp.save(state, storage_writer=Writer(str(folder)), process_group=group, no_dist=no_dist)


def _dcp_load(state: dict, folder: Path, group, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), process_group=group, no_dist=no_dist)
    except CheckpointException as e:  # a BaseException: every rank's failure, raised on every rank
        errors = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]  # (exception, stack)
        first = errors[0] if errors else e
        text = (str(first).strip().splitlines() or [""])[0][:200]
        raise _damaged(folder, f"{type(first).__name__}: {text}" if text else type(first).__name__) from None
    except Exception as e:  # planning errors (a missing key, a size mismatch) are raised as they are
        text = (str(e).strip().splitlines() or [""])[0][:200]
        raise _damaged(folder, f"{type(e).__name__}: {text}" if text else type(e).__name__) from None


# --------------------------------------------------------------------------------------------------
# Save


def _meta(kind: str, step: int, mode: str, hparams: Optional[dict], moments: bool) -> dict:
    if hparams is not None:
        hparams = {**hparams, "betas": list(hparams["betas"])}
    return {"kind": kind, "step": int(step), "mode": mode, "hparams": hparams, "moments": bool(moments)}


def _replicated_state(bank) -> tuple[dict, dict]:
    """MemoryBank -> (full tensors, metadata); the torch AdamW state gives the moments and the step."""
    state = bank.state_dict()
    opt = state.get("optimizer") or {}
    per_param = opt.get("state") or {}
    active = _active(bank.layout)
    moments = bool(active) and all("exp_avg" in per_param.get(i, {}) for i in range(len(active)))
    tensors, step = {}, 0
    for i, l in enumerate(active):
        rows = state["tables"][str(l)].detach().cpu()
        tensors[f"level{l}.rows"] = rows
        tensors[f"level{l}.owner"] = torch.full((rows.shape[0],), -1, dtype=torch.int32)
        if moments:
            st = per_param[i]
            tensors[f"level{l}.exp_avg"] = st["exp_avg"].detach().cpu().float()
            tensors[f"level{l}.exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().float()
            step = int(float(st["step"]))
    hparams = None
    if opt.get("param_groups"):
        g = opt["param_groups"][0]
        hparams = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")}
    return tensors, _meta("replicated", step, "dense", hparams, moments)


def _local_sharded_state(bank) -> tuple[dict, dict]:
    """A one-process ShardedMemoryBank (it owns every row) -> (full tensors, metadata)."""
    state = bank.state_dict()
    moments = all(e.get("exp_avg") is not None for e in state["levels_state"].values())
    tensors = {}
    for key, entry in state["levels_state"].items():
        order = torch.argsort(entry["ids"].cpu())
        if len(order) != bank.layout.rows(int(key)):
            raise RuntimeError(f"a one-process sharded bank must own every row of level {int(key) + 1}")
        tensors[f"level{key}.owner"] = torch.full((len(order),), bank.rank, dtype=torch.int32)
        for name in _FIELDS if moments else _FIELDS[:1]:
            t = entry.pop(name).cpu().index_select(0, order)
            tensors[f"level{key}.{name}"] = t if name == "rows" else t.float()
    return tensors, _meta("sharded", state.get("step", 0), state.get("mode", "dense"), state.get("hparams"), moments)


def _canonical_state(bank) -> tuple[dict, dict]:
    """ShardedMemoryBank on several ranks -> (this rank's canonical blocks as DTensors, metadata);
    collective over ``bank.group``. Per level and field: one all-to-all of the rows by global row."""
    group, world, rank = bank.group, bank.world, bank.rank
    device = _comm_device(group)
    mesh = _mesh(group)
    state = bank.state_dict()
    levels_state = state.pop("levels_state")
    moments = all(e.get("exp_avg") is not None for e in levels_state.values())
    tensors = {}
    for key in sorted(levels_state, key=int):
        entry = levels_state.pop(key)  # freed level by level
        l, n = int(key), bank.layout.rows(int(key))
        lo, hi = _chunk(n, world, rank)
        ids = entry["ids"].to(torch.int64).cpu()
        dest = ids // math.ceil(n / world)  # the canonical block each row belongs to
        order = torch.sort(dest, stable=True).indices
        send = torch.bincount(dest, minlength=world).tolist() if ids.numel() else [0] * world
        recv = _exchange_splits(send, group, device)
        pos = _exchange(ids[order], send, recv, group, device) - lo
        if len(pos) != hi - lo or (len(pos) and not torch.equal(torch.sort(pos).values, torch.arange(hi - lo))):
            raise RuntimeError(f"level-{l + 1} rows do not partition [0, {n}) across the ranks (rank {rank} got "
                               f"{len(pos)} rows for its block [{lo}, {hi}))")
        owner = torch.empty(hi - lo, dtype=torch.int32)  # the sender of each row: its owner
        owner[pos] = torch.repeat_interleave(torch.arange(world, dtype=torch.int32), torch.tensor(recv))
        tensors[f"level{l}.owner"] = _sharded(owner, mesh, n)
        for name in _FIELDS if moments else _FIELDS[:1]:
            values = entry.pop(name)
            got = _exchange(values.index_select(0, order.to(values.device)), send, recv, group, device)
            del values
            local = torch.empty_like(got)
            local[pos] = got
            tensors[f"level{l}.{name}"] = _sharded(local if name == "rows" else local.float(), mesh, n)
    return tensors, _meta("sharded", state.get("step", 0), state.get("mode", "dense"), state.get("hparams"), moments)


def save(bank, folder: Path) -> None:
    """Write ``bank`` to the DCP folder ``folder`` (replaced if present; see the module docstring).

    ShardedMemoryBank on several processes: a collective over ``bank.group`` (every rank of it calls
    it). MemoryBank (replicated) or a one-process bank: call it on one process only; no collective.
    ``bank.json`` is written last (by group rank 0, after DCP's own metadata), so a folder without it
    never loads; the caller's completion marker comes after."""
    folder = Path(folder)
    collective = _collective(bank)
    lead = bank.rank == 0 if collective else True
    if lead and folder.exists():  # a rerun saving the same step: no stale shard or metadata survives
        shutil.rmtree(folder)
    if collective:
        torch.distributed.barrier(group=bank.group)
        tensors, meta = _canonical_state(bank)
    elif _is_sharded(bank):
        tensors, meta = _local_sharded_state(bank)
    else:
        tensors, meta = _replicated_state(bank)
    _dcp_save(tensors, folder, bank.group if collective else None, no_dist=not collective)
    if lead:
        rows_dtype = next((t.dtype for k, t in tensors.items() if k.endswith(".rows")), torch.float32)
        meta = {"format": FORMAT, **meta, **_layout_meta(bank.layout),
                "world_size": bank.world if _is_sharded(bank) else 1, "rows_dtype": str(rows_dtype)}
        tmp = folder / (META + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / META)


# --------------------------------------------------------------------------------------------------
# Read


def read_meta(folder: Path) -> dict:
    """``bank.json`` of a DCP bank folder; CheckpointError when the folder is missing or unfinished."""
    folder = Path(folder)
    if not folder.is_dir():
        raise _damaged(folder, "the folder is missing")
    for name in (META, ".metadata"):
        if not (folder / name).is_file():
            raise _damaged(folder, f"no {name}: the save did not finish")
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise _damaged(folder, f"{META} cannot be read: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"the memory bank {folder} has format {meta.get('format')!r}; this memtrain reads "
                              f"{FORMAT!r}. Use the memtrain version that wrote it")
    return meta


def _dcp_metadata(folder: Path):
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(str(folder)).read_metadata()
    except _READ_ERRORS as e:
        raise _damaged(folder, f".metadata cannot be read: {type(e).__name__}") from None


def check_layout(bank_layout, meta: dict, folder: Path) -> None:
    """CheckpointError (one line) when the saved levels, branching or block sizes differ from the bank's."""
    want = _layout_meta(bank_layout)
    active = _active(bank_layout)
    saved_blocks = meta.get("block_sizes") or []
    checks = (("levels", meta.get("levels"), want["levels"], "memory.levels"),
              ("branching", meta.get("branching"), want["branching"], "data.clustering.branching"),
              ("block sizes", [saved_blocks[l] if l < len(saved_blocks) else None for l in active],
               [want["block_sizes"][l] for l in active], "memory.type and the model's dimensions"))
    for what, got, now, fix in checks:
        if got != now:
            raise CheckpointError(f"the memory bank {folder} was saved with {what} {got} but this run's bank has "
                                  f"{now}; set {fix} as in the run that wrote it, or start a new run.dir")


def _plan(folder: Path, meta: dict, layout, moments: bool) -> tuple[list[int], dict, bool]:
    """Active levels, DCP tensor metadata, and whether moments will be read (validated)."""
    md = _dcp_metadata(folder).state_dict_metadata
    active = _active(layout)
    moments = moments and bool(meta.get("moments"))
    for l in active:
        shape = (layout.rows(l), layout.block_size(l))
        for name in ("rows", "owner") + (_FIELDS[1:] if moments else ()):
            key = f"level{l}.{name}"
            entry = md.get(key)
            if entry is None or not hasattr(entry, "size"):
                raise _damaged(folder, f"{key} is missing")
            expect = shape[:1] if name == "owner" else shape
            if tuple(entry.size) != expect:
                raise _damaged(folder, f"{key} has shape {tuple(entry.size)}, expected {expect}")
    return active, md, moments


def read_full_state(folder: Path, moments: bool = True, layout=None) -> dict:
    """The whole bank in one process (no collective, no process group needed), in the merged format of
    :func:`memtrain.parallel.sharded_bank.merge_states`: ``levels_state`` (every row id), ``tables`` /
    ``exp_avg`` / ``exp_avg_sq`` (``{str(level): [k^(l+1), s_l]}``, moments None when absent or not
    asked for), ``owner`` (the saved owner map), ``step``, ``mode``, ``hparams``, the layout's shape,
    ``world_size`` and ``kind`` at save."""
    folder = Path(folder)
    meta = read_meta(folder)
    if layout is not None:  # loading into a bank: its shape must match, tensor by tensor
        check_layout(layout, meta, folder)
        _plan(folder, meta, layout, moments)
    md = _dcp_metadata(folder).state_dict_metadata
    levels = [l for l, r in enumerate(meta["levels"]) if r > 0]
    want = bool(moments and meta.get("moments"))
    state: dict = {}
    for l in levels:
        for name in ("rows", "owner") + (_FIELDS[1:] if want else ()):
            key = f"level{l}.{name}"
            entry = md.get(key)
            if entry is None or not hasattr(entry, "size"):
                raise _damaged(folder, f"{key} is missing")
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    _dcp_load(state, folder, None, no_dist=True)
    out_levels, tables, exp_avg, exp_avg_sq, owner = {}, {}, {}, {}, {}
    for l in levels:
        key = str(l)
        rows = state[f"level{l}.rows"]
        tables[key], owner[key] = rows, state[f"level{l}.owner"]
        exp_avg[key] = state.get(f"level{l}.exp_avg")
        exp_avg_sq[key] = state.get(f"level{l}.exp_avg_sq")
        out_levels[key] = {"ids": torch.arange(rows.shape[0], dtype=torch.int64), "rows": rows,
                           "exp_avg": exp_avg[key], "exp_avg_sq": exp_avg_sq[key]}
    return {"format": "sharded_bank/v1", "levels_state": out_levels, "tables": tables, "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq, "owner": owner, "step": int(meta.get("step", 0)),
            "mode": meta.get("mode", "dense"), "hparams": meta.get("hparams"), "levels": list(meta["levels"]),
            "branching": meta["branching"], "block_sizes": list(meta["block_sizes"]),
            "world_size": meta.get("world_size"), "kind": meta.get("kind")}


def adamw_state(bank, state: dict) -> Optional[dict]:
    """A merged state's moments (``step``, ``exp_avg`` / ``exp_avg_sq`` per level) as the replicated
    bank's torch AdamW state: one entry per active table, keyed by its position among the active
    levels (None when the bank has no optimizer, as in evaluation, or the state carries no moments)."""
    if bank.optimizer is None or any(v is None for v in state["exp_avg"].values()):
        return None
    opt = bank.optimizer.state_dict()
    active = [l for l, t in enumerate(bank.tables) if t is not None]
    opt["state"] = {i: {"step": torch.tensor(float(state["step"])), "exp_avg": state["exp_avg"][str(l)],
                        "exp_avg_sq": state["exp_avg_sq"][str(l)]} for i, l in enumerate(active)}
    return opt


# --------------------------------------------------------------------------------------------------
# Load


def _load_canonical(bank, folder: Path, meta: dict) -> None:
    """Collective load into a ShardedMemoryBank on several ranks: canonical blocks via DCP, then
    all-to-all to the owners."""
    group, world, rank = bank.group, bank.world, bank.rank
    active, md, moments = _plan(folder, meta, bank.layout, True)
    mesh = _mesh(group)
    names = _FIELDS if moments else _FIELDS[:1]
    blocks, state = {}, {}
    for l in active:
        n, s = bank.layout.rows(l), bank.layout.block_size(l)
        lo, hi = _chunk(n, world, rank)
        for name in names:
            local = torch.empty(hi - lo, s, dtype=md[f"level{l}.{name}"].properties.dtype)
            blocks[(l, name)] = local
            state[f"level{l}.{name}"] = _sharded(local, mesh, n)
    _dcp_load(state, folder, group, no_dist=False)
    del state
    device = _comm_device(group)
    levels = {}
    for l in active:
        lo, hi = _chunk(bank.layout.rows(l), world, rank)
        ids = torch.arange(lo, hi, dtype=torch.int64)
        dest = torch.as_tensor(bank.owner(l, ids.to(bank.device))).cpu().to(torch.int64)
        order = torch.sort(dest, stable=True).indices
        send = torch.bincount(dest, minlength=world).tolist() if ids.numel() else [0] * world
        recv = _exchange_splits(send, group, device)
        entry = {"ids": _exchange(ids[order], send, recv, group, device), "exp_avg": None, "exp_avg_sq": None}
        for name in names:
            entry[name] = _exchange(blocks.pop((l, name)).index_select(0, order), send, recv, group, device)
        levels[str(l)] = entry
    bank.load_state_dict({"format": "sharded_bank/v1", "levels_state": levels, "step": int(meta.get("step", 0)),
                          "mode": meta.get("mode", "dense"), "hparams": meta.get("hparams"),
                          **_layout_meta(bank.layout)})


def load(bank, folder: Path) -> None:
    """Load the DCP bank folder into ``bank``, whatever bank kind and world size wrote it.

    ShardedMemoryBank on several processes: a collective over ``bank.group``. Otherwise (a one-process
    sharded bank, or a MemoryBank on any rank, with or without a process group) each process reads the
    full tables alone. A MemoryBank without an optimizer (evaluation) reads rows only; with one, its
    torch AdamW state (step and moments per table) is rebuilt."""
    folder = Path(folder)
    if _collective(bank):
        meta = read_meta(folder)
        check_layout(bank.layout, meta, folder)
        _load_canonical(bank, folder, meta)
        return
    if _is_sharded(bank):
        bank.load_state_dict(read_full_state(folder, moments=True, layout=bank.layout))
        return
    state = read_full_state(folder, moments=bank.optimizer is not None, layout=bank.layout)
    bank.load_state_dict({"tables": state["tables"], "optimizer": adamw_state(bank, state),
                          **_layout_meta(bank.layout)})


# --------------------------------------------------------------------------------------------------
# The bank inside a checkpoint folder (what memtrain.parallel.checkpoint calls), legacy files included

BANK_FILE = "memory_bank.pt"  # legacy (read only): a replicated bank's torch.save
BANK_SHARD = "memory_bank_rank{rank:05d}.pt"  # legacy (read only): one sharded-bank state_dict per rank


def save_bank(bank, path: Path, rank: int) -> None:
    """The bank's rows and optimizer state as a torch.distributed.checkpoint folder ``path/memory_bank``
    keyed by global row, with the owner map (:func:`save`): the run resumes
    on any number of ranks, as either bank kind. Call on every rank: a sharded bank saves collectively
    over its group; a replicated bank is written by rank 0 alone. Runs before the caller's barrier and
    ``COMPLETE.json``; a same-step rerun replaces the folder."""
    if not hasattr(bank, "owner") and rank != 0:
        return
    save(bank, Path(path) / FOLDER)


def _legacy_bank_files(path: Path) -> list[Path]:
    return [path / BANK_FILE] if (path / BANK_FILE).is_file() else sorted(path.glob("memory_bank_rank*.pt"))


def read_bank_state(path: Path) -> dict:
    """The whole bank state of checkpoint ``path`` in one process (no process group needed), whichever
    form wrote it: the DCP folder ``memory_bank/`` (the merged format of
    :func:`memtrain.parallel.sharded_bank.merge_states` plus the owner map), or the legacy
    ``memory_bank.pt`` / ``memory_bank_rank*.pt`` files (shard files are merged)."""
    path = Path(path)
    damaged = (f"; delete {path / MARKER} to resume from the checkpoint before it, or start a new run.dir")
    if (path / FOLDER).exists():
        return read_full_state(path / FOLDER)
    files = _legacy_bank_files(path)
    if not files:
        raise CheckpointError(f"checkpoint {path} has no memory bank ({FOLDER}/, or the older {BANK_FILE} or "
                              "memory_bank_rank*.pt) although the recipe trains memories" + damaged)
    try:
        states = [torch.load(f, weights_only=True, map_location="cpu") for f in files]
    except (RuntimeError, OSError, EOFError, KeyError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"cannot load the memory bank of {path} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]})" + damaged) from None
    if "levels_state" in states[0]:
        from memtrain.parallel.sharded_bank import merge_states

        return merge_states(states)
    return states[0]


def load_bank(bank, path: Path) -> None:
    """Load the bank of checkpoint ``path`` into ``bank`` (replicated or sharded, any world size, from
    either bank kind). A sharded bank on several ranks loads collectively (every rank calls it); a
    replicated bank reads alone (no process group needed)."""
    path = Path(path)
    if (path / FOLDER).exists():
        try:
            load(bank, path / FOLDER)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}; the recipe's memory settings differ from the checkpoint's") from None
        return
    state = read_bank_state(path)  # legacy files
    try:
        if "levels_state" in state and not hasattr(bank, "owner"):
            state = {**state, "optimizer": adamw_state(bank, state)}  # sharded -> replicated
        bank.load_state_dict(state)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}; the recipe's memory settings differ from the checkpoint's") from None


__all__ = ["FOLDER", "FORMAT", "META", "adamw_state", "check_layout", "load", "load_bank", "read_bank_state",
           "read_full_state", "read_meta", "save", "save_bank"]
