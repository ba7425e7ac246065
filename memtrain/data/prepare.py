"""``memtrain prepare``: turn raw documents into tokenized, packed MDS shards in ``data_dir``.

Layout of a prepared data folder::

    <data_dir>/meta.json            settings, counts, tokenizer, fingerprint, the size and xxh64 of the
                                    tokenizer and tree files, the tokenizer's behaviour fingerprint
                                    (tokenizer.tokenizer_fingerprint; written last)
    <data_dir>/prepare_report.json  document / sequence counts, cluster balance, throughput
    <data_dir>/tokenizer.model      the SentencePiece model, when memtrain trained it
    <data_dir>/train/               MDS shards + index.json, column "tokens" of seq_len + 1 ids
    <data_dir>/val/                 the same for the validation documents (absent if there are none)

With ``data.clustering.enabled`` the splits instead hold one MDS stream per level-1 subtree
(``train/subtree-<i>/``), every sample carries its leaf cluster id in front (``seq_len + 2`` values),
and ``tree.safetensors`` holds the cluster tree (:mod:`memtrain.data.clustered`).

Everything is built in a temporary sibling folder and moved into place with ``os.replace`` at the
end, so a failure or a kill never leaves a half-written data folder. The settings that determine the
data are hashed into a fingerprint: preparing again with the same settings is a no-op ("already
prepared"); different settings need ``force=True`` (``--force``) or another ``data.dir``.

Distributed preparation. Started by torchrun, srun or the deepspeed launcher with W > 1 processes
(:func:`memtrain.parallel.dist.discover`), ``prepare`` starts a gloo process group and shares the
work: every rank reads the documents and computes the same seeded split; rank ``r`` takes the
documents ``idx[r::W]`` of each split. Rank 0 trains (or loads) the tokenizer on all training
documents, as a single process does, and the other ranks load it. Each rank tokenizes, embeds,
assigns, packs and writes its documents (clustering: :mod:`memtrain.data.clustered`); each stream
folder then holds one MDS part per rank that wrote samples, and rank 0 merges their indexes::

    <data_dir>/train/index.json, train/part-00000/ .. part-<W-1>/      without clustering
    <data_dir>/train/subtree-<i>/index.json, subtree-<i>/part-<r>/     with clustering

Every rank drops (plain) or pads (clustered, per leaf) its own last partial sample, so the counts of
samples and dropped or padded tokens depend on W; the documents' tokens, the tokenizer and (when the
tree's window cap does not bite and the window embeddings agree, see :mod:`memtrain.data.clustered`)
the tree and every document's cluster do not. Rank 0 sums the counts, writes meta.json and
prepare_report.json (which records ``world_size``) and moves the build into place; every rank
returns the same report. The build folder is a sibling of ``data.dir`` named by rank 0, so on several
nodes ``data.dir``'s parent must be on a filesystem all of them share (checked). A failure on any
rank makes every rank raise, and rank 0 deletes the build folder. The fingerprint does not depend on
W: data prepared by any number of ranks counts as prepared. W == 1 is the single-process path.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import random
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from memtrain.config import Recipe
from memtrain.errors import CollectiveError, DataError, MemtrainError

FORMAT_VERSION = 1
META = "meta.json"
REPORT = "prepare_report.json"
TOKENIZER_FILE = "tokenizer.model"
# meta.json: {name: {"bytes": size, "xxh64": digest}} of the tokenizer and cluster tree in the folder
# (named_files), checked by `memtrain prepare --verify`, the trainer's start and every reader of the file.
CHECKSUMS = "checksums"
# meta.json: the tokenizer's vocabulary size, end-of-text id and behaviour digest (tokenizer_fingerprint), checked by
# the commands that read text with it, also for a tokenizer of the user's own outside the folder
TOKENIZER_FINGERPRINT = "tokenizer_fingerprint"
# meta.json: {path: {"bytes", "mtime_ns", "xxh64"}} of every source file as it was before it was read, so that
# preparing again after a source changed (edited, or a new file matching a glob) is not "already prepared"
SOURCE_FILES = "source_files"
_ENCODE_BATCH = 256
# Distributed preparation: how long a rank waits in one collective (rank 0 training the tokenizer or
# the tree, the slowest rank embedding) before giving up. A rank that dies closes its connections,
# which the others notice at once; this only bounds waiting on a live but stuck rank.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)
_GATHER_BYTES = 1 << 26  # rows are gathered to rank 0 in pieces of about this size


def data_settings(recipe: Recipe) -> dict[str, Any]:
    """The recipe settings that determine the prepared data; :func:`fingerprint` hashes them."""
    d, tok = recipe.data, recipe.data.tokenizer
    if tok.path:
        tokenizer: dict[str, Any] = {"path": str(Path(tok.path).expanduser().resolve())}
    else:
        tokenizer = {"vocab_size": tok.vocab_size, "model_type": tok.model_type,
                     "byte_fallback": tok.byte_fallback}
    settings: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "sources": list(d.sources), "text_field": d.text_field,
        "seq_len": d.seq_len, "val_fraction": d.val_fraction, "tokenizer": tokenizer, "seed": recipe.run.seed,
    }
    if d.clustering.enabled:
        # "assignment": how training documents are assigned to leaves (balanced since the final assignment
        # respects the balancing limit); data prepared by the greedy assignment then fingerprints differently.
        settings["clustering"] = {**dataclasses.asdict(d.clustering), "assignment": "balanced"}
    if "builtin" in d.sources:
        from memtrain.data.builtin import BUILTIN_VERSION

        settings["builtin_version"] = BUILTIN_VERSION
    if "builtin:longtail" in d.sources:
        from memtrain.data.longtail import LONGTAIL_VERSION

        settings["longtail_version"] = LONGTAIL_VERSION
    if "builtin:tasks" in d.sources:
        from memtrain.data.builtin import BUILTIN_VERSION
        from memtrain.data.tasks import TASKS_CORPUS_VERSION

        settings["builtin_version"] = BUILTIN_VERSION
        settings["tasks_version"] = TASKS_CORPUS_VERSION
    return settings


def fingerprint(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def split_documents(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded shuffle of document indices into (train, val); both lists are in shuffled order.

    At least one validation document when ``val_fraction > 0`` and ``n >= 2``; at least one training one.
    """
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = 0
    if val_fraction > 0 and n >= 2:
        n_val = min(max(1, round(n * val_fraction)), n - 1)
    return order[n_val:], order[:n_val]


def prepare(recipe: Recipe, force: bool = False, dist_env: Any = None,
            tree_windows: Optional[int] = None) -> dict[str, Any]:
    """Prepare ``recipe.data_dir``; returns meta.json's contents plus ``status`` and throughput figures.

    ``status`` is ``"prepared"`` or ``"already prepared"`` (same fingerprint: nothing is read or written).
    ``dist_env`` (a :class:`memtrain.parallel.dist.DistEnv`) defaults to what the launcher's
    environment says; with a world size above one the ranks share the work (module docstring) and all
    return the same report. ``tree_windows`` caps the training windows gathered on rank 0 for the
    cluster tree in distributed runs (default :data:`memtrain.data.clustered.TREE_WINDOWS`, or
    $MEMTRAIN_PREPARE_TREE_WINDOWS).
    """
    if dist_env is None:
        from memtrain.parallel.dist import discover

        dist_env = discover()
    if dist_env.world_size > 1:
        return _prepare_distributed(recipe, force, dist_env, tree_windows)
    data_dir = _through_link(recipe.data_dir)
    settings = data_settings(recipe)
    fp = fingerprint(settings)
    existing = _existing(data_dir, fp, force, recipe.data.sources)
    if existing is not None:
        return {**existing, "status": "already prepared"}

    tmp = _new_build_folder(data_dir)
    try:
        meta = _build(recipe, tmp, settings, fp)
        result = _finish(meta, tmp, data_dir, world_size=1)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return result


def _existing(data_dir: Path, fp: str, force: bool, sources: list[str]) -> Optional[dict[str, Any]]:
    """meta.json of a folder already prepared with these settings from ``sources`` as they are now, else None
    (build it); DataError when ``data_dir`` holds other data, or was prepared from sources that changed since."""
    meta_path = data_dir / META
    if meta_path.is_file() and not force:
        existing = _read_json(meta_path)
        if existing.get("fingerprint") == fp:
            missing = [name for name in named_files(existing) if not (data_dir / name).is_file()]
            if missing:
                raise DataError(f"{data_dir} was prepared with these settings but {' and '.join(missing)} is "
                                "missing from it; pass --force to prepare it again")
            changes = source_changes(existing.get(SOURCE_FILES), sources)
            if changes:
                more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
                raise DataError(f"{data_dir} was prepared with these settings, but data.sources changed since: "
                                f"{'; '.join(changes[:3])}{more}; pass --force to prepare it again (or keep "
                                "the sources as they were)")
            return existing
        raise DataError(f"{data_dir} already holds data prepared with different settings (sources, "
                        "text_field, seq_len, val_fraction, tokenizer or seed); pass --force to replace "
                        "it or choose another data.dir")
    if not meta_path.is_file() and data_dir.exists() and (not data_dir.is_dir() or any(data_dir.iterdir())):
        # Not ours (no meta.json): never delete it, even with --force.
        raise DataError(f"{data_dir} exists and is not a prepared memtrain data folder; remove it or "
                        "choose another data.dir")
    return None


def named_files(meta: dict[str, Any]) -> list[str]:
    """The files of the folder besides the shards that meta.json names: the tokenizer and the cluster tree.
    Relative names are in the data folder; an absolute one (a tokenizer of the user's own) is not listed."""
    names = [meta.get("tokenizer"), (meta.get("clustering") or {}).get("tree")]
    return [n for n in names if isinstance(n, str) and n and not Path(n).is_absolute()]


def source_states(sources: list[str]) -> dict[str, dict[str, Any]]:
    """:data:`SOURCE_FILES`: the size, modification time and xxh64 of every file ``sources`` name (built-in corpora
    have none), taken before they are read: a change made while they are read shows as a change next time."""
    from memtrain.data.sources import BUILTINS, resolve_sources
    from memtrain.parallel.checkpoint_folder import HASH, hash_file

    out = {}
    for path in resolve_sources(sources):
        if path in BUILTINS:
            continue
        mtime = os.stat(path).st_mtime_ns
        size, digest = hash_file(Path(path))
        out[path] = {"bytes": size, "mtime_ns": mtime, HASH: digest}
    return out


def source_changes(recorded: Optional[dict[str, dict[str, Any]]], sources: list[str]) -> list[str]:
    """How the files ``sources`` name now differ from ``recorded`` (:func:`source_states` at preparation): a file
    of another size, or with other contents (hashed only when its size is the same and its time is not), or a
    new file a glob matches. A recorded file that is gone is no change: the prepared data stands without it (a
    job script may run ``prepare`` after the corpus was cleaned up). Folders prepared before this record: []."""
    from memtrain.data.sources import BUILTINS, resolve_sources
    from memtrain.parallel.checkpoint_folder import HASH, hash_file

    if recorded is None:
        return []
    changes = []
    for path in resolve_sources(sources, missing_ok=True):
        if path in BUILTINS:
            continue
        was = recorded.get(path)
        if was is None:
            changes.append(f"{path} is new")
            continue
        stat = os.stat(path)
        if stat.st_size != was["bytes"]:
            changes.append(f"{path} has {stat.st_size} bytes, not {was['bytes']}")
        elif stat.st_mtime_ns != was["mtime_ns"] and hash_file(Path(path))[1] != was[HASH]:
            changes.append(f"{path} has other contents")
    return changes


def _checksums(folder: Path, meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """meta.json's :data:`CHECKSUMS` entry: the size and xxh64 of every :func:`named_files` file of the build
    ``folder`` (the shards' checksums are in their index.json files)."""
    from memtrain.parallel.checkpoint_folder import HASH, hash_file

    out = {}
    for name in named_files(meta):
        size, digest = hash_file(folder / name)
        out[name] = {"bytes": size, HASH: digest}
    return out


def _new_build_folder(data_dir: Path) -> Path:
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(data_dir)
    tmp = data_dir.parent / f".{data_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _finish(meta: dict[str, Any], tmp: Path, data_dir: Path, world_size: int) -> dict[str, Any]:
    """Write prepare_report.json and meta.json into the build and move it into place."""
    throughput = meta.pop("_throughput")
    report = {"documents": meta["counts"]["documents"],
              "sequences": meta["counts"]["train_samples"] + meta["counts"]["val_samples"],
              **meta.pop("report", {"branching": None, "depth": None}), "throughput": throughput,
              "world_size": world_size}
    meta[CHECKSUMS] = _checksums(tmp, meta)
    _write_json(tmp / REPORT, report)
    _write_json(tmp / META, meta)
    _swap_into_place(tmp, data_dir)
    return meta | {"status": "prepared"} | throughput


def _build(recipe: Recipe, out: Path, settings: dict, fp: str) -> dict[str, Any]:
    # streaming imports torch and transformers (seconds): import it here, outside the timed part
    import streaming  # noqa: F401
    from tqdm.auto import tqdm

    from memtrain.data.shards import PackStats, pack, token_dtype, write_mds
    from memtrain.data.sources import ReadStats, read_documents
    from memtrain.data.tokenizer import SentencePieceTokenizer, load_tokenizer

    d = recipe.data
    start = time.perf_counter()
    tokenizer = load_tokenizer(d.tokenizer.path) if d.tokenizer.path else None
    if tokenizer is not None:
        _check_vocab(tokenizer.vocab_size, recipe)

    read = ReadStats()
    source_files = source_states(d.sources)
    docs = list(tqdm(read_documents(d.sources, d.text_field, read, cache_dir=out / ".cache", seq_len=d.seq_len),
                     desc="reading", unit=" docs", disable=None))
    shutil.rmtree(out / ".cache", ignore_errors=True)
    if not docs:
        raise DataError(f"data.sources {d.sources} hold no non-empty documents ({read.skipped_empty} empty "
                        "ones skipped); add text to them")
    train_idx, val_idx = split_documents(len(docs), d.val_fraction, recipe.run.seed)

    if tokenizer is None:
        tokenizer = SentencePieceTokenizer.train(
            (docs[i] for i in train_idx), out / TOKENIZER_FILE, d.tokenizer.vocab_size,
            d.tokenizer.model_type, seed=recipe.run.seed, byte_fallback=d.tokenizer.byte_fallback)
        tokenizer_ref = TOKENIZER_FILE
        _check_vocab(tokenizer.vocab_size, recipe)
    else:
        tokenizer_ref = str(Path(d.tokenizer.path).expanduser().resolve())
    dtype = token_dtype(tokenizer.vocab_size)
    sample_len = d.seq_len + 1

    tok_start = time.perf_counter()
    split_idx = {"train": train_idx, "val": val_idx}
    tokens: dict[str, list[np.ndarray]] = {}
    for split, idx in split_idx.items():
        with tqdm(total=len(idx), desc=f"tokenizing {split}", unit=" docs", disable=None) as bar:
            tokens[split] = []
            for b in range(0, len(idx), _ENCODE_BATCH):
                batch = [docs[i] for i in idx[b:b + _ENCODE_BATCH]]
                tokens[split] += [np.asarray(t, dtype=np.int64) for t in tokenizer.encode_batch(batch)]
                bar.update(len(batch))
        if idx:
            _check_split_tokens(split, sum(len(t) + 1 for t in tokens[split]), len(idx), sample_len)

    clustered: dict[str, Any] = {}
    splits: dict[str, PackStats] = {}
    if d.clustering.enabled:
        from memtrain.data.clustered import build_clustered

        clustered = build_clustered(recipe, out, docs, split_idx, tokens, tokenizer)
        dtype = clustered["dtype"]
        for split, c in clustered.pop("split_counts").items():
            splits[split] = PackStats(documents=c["documents"], tokens=c["tokens"], samples=c["samples"],
                                      padded_tokens=c["padded_tokens"])
    else:
        for split, idx in split_idx.items():
            if not idx:
                continue
            stats = PackStats()
            n_samples = sum(len(t) + 1 for t in tokens[split]) // sample_len
            with tqdm(total=n_samples, desc=f"writing {split}", unit=" samples", disable=None) as bar:
                write_mds(out / split, pack(tokens[split], tokenizer.eot_id, sample_len, dtype, stats), dtype,
                          d.shard_size_limit, progress=bar)
            splits[split] = stats
    return _meta(recipe, settings, fp, tokenizer, tokenizer_ref, dtype, read, source_files, len(docs),
                 {split: len(idx) for split, idx in split_idx.items()}, splits, clustered, start, tok_start)


def _meta(recipe: Recipe, settings: dict, fp: str, tokenizer, tokenizer_ref: str, dtype: str, read,
          source_files: dict[str, dict[str, Any]], n_docs: int, sizes: dict[str, int], splits: dict,
          clustered: dict, start: float, tok_start: float) -> dict[str, Any]:
    """meta.json's contents (plus the "_throughput" and "report" entries :func:`_finish` pops)."""
    from memtrain.data.shards import PackStats
    from memtrain.data.tokenizer import tokenizer_fingerprint

    d = recipe.data
    sample_len = d.seq_len + 1
    elapsed = time.perf_counter() - start
    total_tokens = sum(s.tokens for s in splits.values())

    empty = PackStats()
    train, val = splits.get("train", empty), splits.get("val", empty)
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fp,
        "settings": settings,
        "seq_len": d.seq_len,
        "sample_len": sample_len,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "tokenizer": tokenizer_ref,  # relative paths are relative to the data folder
        TOKENIZER_FINGERPRINT: tokenizer_fingerprint(tokenizer),
        "dtype": dtype,
        "column": "tokens",
        "train_samples": train.samples,  # what the loaders serve; details in "counts"
        "val_samples": val.samples,
        "sources": list(d.sources),
        "files": list(read.files),
        SOURCE_FILES: source_files,
        "counts": {
            "documents": n_docs, "skipped_empty": read.skipped_empty,
            "train_documents": sizes["train"], "val_documents": sizes["val"],
            "train_samples": train.samples, "val_samples": val.samples,
            "train_tokens": train.tokens, "val_tokens": val.tokens, "tokens": total_tokens,
            "train_dropped_tokens": train.dropped_tokens, "val_dropped_tokens": val.dropped_tokens,
            "dropped_tokens": train.dropped_tokens + val.dropped_tokens,
        },
        **{key: clustered[key] for key in ("clustering", "streams", "report") if key in clustered},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "_throughput": {  # popped before meta.json is written
            "seconds": round(elapsed, 3),
            "documents_per_s": round(n_docs / elapsed, 1),
            "tokens_per_s": round(total_tokens / max(time.perf_counter() - tok_start, 1e-9), 1),
        },
    }


def _check_split_tokens(split: str, total: int, n_docs: int, sample_len: int) -> None:
    if total < sample_len:
        what = "training" if split == "train" else "validation"
        hint = ("set data.seq_len below that or add documents" if split == "train" else
                "raise data.val_fraction, lower data.seq_len, or set data.val_fraction to 0")
        raise DataError(f"the {what} split has only {total} tokens ({n_docs} documents), fewer than one "
                        f"sample of data.seq_len + 1 = {sample_len} tokens; {hint}")


# --------------------------------------------------------------------------------------------------
# distributed preparation


class _Comm:
    """Collectives of one distributed ``prepare`` over a gloo group of its own (with a long timeout).

    :meth:`run` is the failure protocol: every step that can fail runs locally inside it and the ranks
    then exchange their outcome, so when one rank fails all of them raise at the same point and none is
    left waiting in a later collective.
    """

    def __init__(self, rank: int, world: int):
        import torch.distributed as tdist

        self.rank, self.world = rank, world
        self.group = tdist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        self.failed_together = False  # set when run() raised: every rank is alive at the same point

    def wait_for(self, seconds: float = 300.0) -> None:
        """Best-effort barrier after a failure agreed by :meth:`run` (never raises): the other ranks
        wait until rank 0 has cleaned up, so a launcher that kills the job once a rank exits cannot
        cut rank 0's cleanup short."""
        import torch.distributed as tdist

        try:
            tdist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=seconds))
        except Exception:
            pass

    def close(self) -> None:
        import torch.distributed as tdist

        if tdist.is_initialized():
            tdist.destroy_process_group(self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as tdist

        out: list[Any] = [None] * self.world
        tdist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        import torch.distributed as tdist

        box = [obj]
        tdist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def sum(self, values: list[int]) -> list[int]:
        import torch
        import torch.distributed as tdist

        t = torch.tensor(values, dtype=torch.int64)
        tdist.all_reduce(t, group=self.group)
        return [int(v) for v in t.tolist()]

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on this rank, then agree: raises on every rank if it raised on any."""
        try:
            result, failure = fn(), None
        except Exception as e:  # re-raised below, after the other ranks have heard of it
            result, failure = None, e
        status = None if failure is None else (isinstance(failure, MemtrainError), str(failure),
                                               type(failure).__name__)
        statuses = self.all_gather(status)
        failing = [r for r, st in enumerate(statuses) if st is not None]
        self.failed_together = bool(failing)
        # One line per failure, not one per rank: a rank whose error a lower rank also raised leaves it to that
        # rank (ranks that agreed on totals raise the same error), and of the ranks that did not fail, rank 0
        # alone repeats the first failing rank's error (where the launcher's log may not show the other ranks').
        # The others still exit with the error's code.
        if failure is not None:
            if isinstance(failure, MemtrainError) and any(statuses[r] == status for r in failing if r < self.rank):
                failure.printed_by_another_rank = True
            raise failure
        if failing:
            r = failing[0]
            user, message, kind = statuses[r]
            error: MemtrainError = (DataError(f"{message} (on rank {r})") if user else CollectiveError(
                f"memtrain prepare failed on rank {r} with {kind}: {message}; see that rank's output"))
            error.printed_by_another_rank = self.rank != 0
            raise error
        return result

    def on_root(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0 only; every rank returns its result (or raises with it)."""
        return self.broadcast(self.run(fn if self.rank == 0 else lambda: None))

    def gather_rows(self, rows: np.ndarray) -> Optional[np.ndarray]:
        """Concatenate every rank's ``rows [n_r, c]`` on rank 0, in rank order (None elsewhere), in
        pieces of about 64 MB."""
        import torch
        import torch.distributed as tdist

        shapes = self.all_gather((rows.shape, rows.dtype.str))
        if len({(shape[1:], dt) for shape, dt in shapes}) != 1:
            raise RuntimeError(f"ranks gather rows of different shapes or types: {shapes}")
        counts = [shape[0] for shape, _ in shapes]
        width = rows.shape[1]
        step = max(1, _GATHER_BYTES // max(1, width * rows.itemsize))
        parts: list[list[np.ndarray]] = [[] for _ in range(self.world)]
        for start in range(0, max(counts), step):
            piece = np.zeros((step, width), rows.dtype)
            mine = rows[start:start + step]
            piece[:len(mine)] = mine
            tensor = torch.from_numpy(piece)
            into = [torch.empty_like(tensor) for _ in range(self.world)] if self.rank == 0 else None
            tdist.gather(tensor, gather_list=into, dst=0, group=self.group)
            if into is not None:
                for r, got in enumerate(into):
                    take = min(step, max(0, counts[r] - start))
                    if take:
                        parts[r].append(got[:take].numpy().copy())
        if self.rank != 0:
            return None
        flat = [a for rank_parts in parts for a in rank_parts]
        return np.concatenate(flat) if flat else np.zeros((0, width), rows.dtype)


def _prepare_distributed(recipe: Recipe, force: bool, dist_env: Any, tree_windows: Optional[int]) -> dict[str, Any]:
    import torch
    import torch.distributed as tdist

    from memtrain.parallel import dist

    started = not tdist.is_initialized()
    dist.init(dist_env, torch.device("cpu"), "gloo")
    comm = _Comm(dist_env.rank, dist_env.world_size)
    try:
        return _run_distributed(recipe, force, comm, dist_env, tree_windows)
    finally:
        comm.close()
        if started:
            dist.shutdown()


def _run_distributed(recipe: Recipe, force: bool, comm: _Comm, dist_env: Any,
                     tree_windows: Optional[int]) -> dict[str, Any]:
    from memtrain.data.clustered import tree_windows_cap

    data_dir = _through_link(recipe.data_dir)
    settings = data_settings(recipe)
    fp = fingerprint(settings)
    cap = comm.run(lambda: tree_windows_cap(tree_windows))

    def decide() -> tuple[str, Any]:
        existing = _existing(data_dir, fp, force, recipe.data.sources)
        if existing is not None:
            return "already prepared", existing
        return "build", str(_new_build_folder(data_dir).resolve())

    status, value = comm.on_root(decide)
    if status == "already prepared":
        return {**value, "status": status}
    tmp = Path(value)
    try:
        def shared() -> None:
            if not tmp.is_dir():
                raise DataError(f"rank {comm.rank} on {socket.gethostname()} does not see the build folder {tmp} "
                                "that rank 0 created; with several nodes the parent of data.dir must be on a "
                                "filesystem they all share")

        comm.run(shared)
        meta = _build_distributed(recipe, tmp, settings, fp, comm, dist_env, cap)
        return comm.on_root(lambda: _finish(meta, tmp, data_dir, world_size=comm.world))
    except BaseException:
        # After a failure agreed through comm.run every rank has stopped writing; rank 0 deletes the
        # build, and the others wait for that before they exit.
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if comm.failed_together:
            comm.wait_for()
        raise
    finally:
        if comm.rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _build_distributed(recipe: Recipe, out: Path, settings: dict, fp: str, comm: _Comm, dist_env: Any,
                       cap: int) -> dict[str, Any]:
    """:func:`_build` for one rank of W (module docstring)."""
    import streaming  # noqa: F401
    from tqdm.auto import tqdm

    from memtrain.data.shards import PackStats, merge_parts, pack, part_name, token_dtype, write_mds
    from memtrain.data.sources import ReadStats, read_documents
    from memtrain.data.tokenizer import SentencePieceTokenizer, load_tokenizer

    d = recipe.data
    rank, world = comm.rank, comm.world
    quiet = None if rank == 0 else True  # tqdm: progress on rank 0 only
    start = time.perf_counter()

    def given_tokenizer():
        if not d.tokenizer.path:
            return None
        tokenizer = load_tokenizer(d.tokenizer.path)
        _check_vocab(tokenizer.vocab_size, recipe)
        return tokenizer

    tokenizer = comm.run(given_tokenizer)

    def read_all() -> tuple[list[str], Any]:
        read = ReadStats()
        cache = out / f".cache-{part_name(rank)}"
        docs = list(tqdm(read_documents(d.sources, d.text_field, read, cache_dir=cache, seq_len=d.seq_len),
                         desc="reading", unit=" docs", disable=quiet))
        shutil.rmtree(cache, ignore_errors=True)
        if not docs:
            raise DataError(f"data.sources {d.sources} hold no non-empty documents ({read.skipped_empty} empty "
                            "ones skipped); add text to them")
        return docs, read

    source_files = comm.on_root(lambda: source_states(d.sources))  # before any rank reads
    docs, read = comm.run(read_all)
    seen = comm.all_gather((len(docs), read.skipped_empty, list(read.files)))

    def same_corpus() -> None:
        if any(s != seen[0] for s in seen):
            raise DataError("the ranks read different corpora (documents and empty documents per rank: "
                            f"{[s[:2] for s in seen]}); data.sources must name the same files, with the same "
                            "contents, on every node")

    comm.run(same_corpus)
    n_docs = len(docs)
    train_idx, val_idx = split_documents(n_docs, d.val_fraction, recipe.run.seed)
    sizes = {"train": len(train_idx), "val": len(val_idx)}

    def tokenizer_on_rank0() -> None:
        if rank == 0 and tokenizer is None:
            trained = SentencePieceTokenizer.train(
                (docs[i] for i in train_idx), out / TOKENIZER_FILE, d.tokenizer.vocab_size,
                d.tokenizer.model_type, seed=recipe.run.seed, byte_fallback=d.tokenizer.byte_fallback)
            _check_vocab(trained.vocab_size, recipe)

    comm.run(tokenizer_on_rank0)
    if tokenizer is None:
        tokenizer = comm.run(lambda: load_tokenizer(out / TOKENIZER_FILE))
        tokenizer_ref = TOKENIZER_FILE
    else:
        tokenizer_ref = str(Path(d.tokenizer.path).expanduser().resolve())
    dtype = token_dtype(tokenizer.vocab_size)
    sample_len = d.seq_len + 1

    # This rank's documents: idx[r::W] of each split, in split order; the rest of the corpus is let go.
    mine = {split: idx[rank::world] for split, idx in (("train", train_idx), ("val", val_idx))}
    local_docs = [docs[i] for idx in mine.values() for i in idx]
    n_train = len(mine["train"])
    local_split = {"train": list(range(n_train)), "val": list(range(n_train, len(local_docs)))}
    del docs

    tok_start = time.perf_counter()

    def tokenize() -> dict[str, list[np.ndarray]]:
        tokens: dict[str, list[np.ndarray]] = {}
        for split, idx in local_split.items():
            tokens[split] = []
            with tqdm(total=len(idx), desc=f"tokenizing {split}", unit=" docs", disable=quiet) as bar:
                for b in range(0, len(idx), _ENCODE_BATCH):
                    batch = [local_docs[i] for i in idx[b:b + _ENCODE_BATCH]]
                    tokens[split] += [np.asarray(t, dtype=np.int64) for t in tokenizer.encode_batch(batch)]
                    bar.update(len(batch))
        return tokens

    tokens = comm.run(tokenize)
    totals = comm.sum([sum(len(t) + 1 for t in tokens[split]) for split in ("train", "val")])

    def enough_tokens() -> None:
        for split, total in zip(("train", "val"), totals):
            if sizes[split]:
                _check_split_tokens(split, total, sizes[split], sample_len)

    comm.run(enough_tokens)

    clustered: dict[str, Any] = {}
    splits: dict[str, PackStats] = {}
    if d.clustering.enabled:
        from memtrain.data.clustered import DistPart, build_clustered

        device = None
        if _cuda_available():
            import torch

            device = f"cuda:{dist_env.local_rank % torch.cuda.device_count()}"
        clustered = build_clustered(recipe, out, local_docs, local_split, tokens, tokenizer, progress=rank == 0,
                                    dist=DistPart(comm=comm, sizes=sizes, tree_windows=cap, device=device))
        dtype = clustered["dtype"]
        for split, c in clustered.pop("split_counts").items():
            splits[split] = PackStats(documents=c["documents"], tokens=c["tokens"], samples=c["samples"],
                                      padded_tokens=c["padded_tokens"])
    else:
        def write_part() -> dict[str, dict]:
            written: dict[str, dict] = {}
            for split, idx in local_split.items():
                if not sizes[split]:
                    continue
                stats = PackStats()
                n_samples = sum(len(t) + 1 for t in tokens[split]) // sample_len
                samples = pack(tokens[split], tokenizer.eot_id, sample_len, dtype, stats)
                if n_samples:
                    with tqdm(total=n_samples, desc=f"writing {split}", unit=" samples", disable=quiet) as bar:
                        write_mds(out / split / part_name(rank), samples, dtype, d.shard_size_limit, progress=bar)
                else:
                    for _ in samples:  # counts the dropped tokens
                        pass
                written[split] = dataclasses.asdict(stats)
            return written

        everyone = comm.all_gather(comm.run(write_part))
        for split, n in sizes.items():
            if n:
                stats = PackStats()
                for part in everyone:
                    for key, value in part[split].items():
                        setattr(stats, key, getattr(stats, key) + value)
                splits[split] = stats

        def merge_on_rank0() -> None:
            if rank != 0:
                return
            for split, stats in splits.items():
                if stats.samples:
                    merged = merge_parts(out / split)
                    if merged != stats.samples:
                        raise DataError(f"{out / split} lists {merged} samples in its parts but the ranks wrote "
                                        f"{stats.samples}; is the parent of data.dir on a filesystem shared by all "
                                        "nodes?")

        comm.run(merge_on_rank0)
    for split, stats in splits.items():  # the same on every rank (gathered), so every rank raises
        if sizes[split] and not stats.samples:
            # enough_tokens counted the split's tokens over all ranks, but each rank packs its own documents and
            # drops its partial last sample: a split smaller than about one sample per rank packs into none,
            # where one process gives samples (it used to finish with exit 0 and an empty split)
            what = "training" if split == "train" else "validation"
            error = DataError(f"the {what} split ({sizes[split]} documents, {stats.tokens} "
                              f"tokens) packs into no sample of {sample_len} tokens on {comm.world} ranks: each rank "
                              f"packs its own share and drops its partial last sample; prepare it with fewer ranks "
                              f"(one process keeps more), a smaller data.seq_len, or more documents")
            error.printed_by_another_rank = comm.rank != 0  # the same on every rank: rank 0 says it
            raise error
    return _meta(recipe, settings, fp, tokenizer, tokenizer_ref, dtype, read, source_files, n_docs, sizes, splits,
                 clustered, start, tok_start)


def _through_link(data_dir: Path) -> Path:
    """``data.dir``, or the folder it links to: the folder is built beside its final place and renamed into it,
    so a symbolic link (say to a larger disk) would itself be replaced by a new folder, and the disk it points
    to left empty."""
    return Path(os.path.realpath(data_dir)) if data_dir.is_symlink() else data_dir


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _check_vocab(vocab_size: int, recipe: Recipe) -> None:
    if vocab_size > recipe.model.vocab_size:
        raise DataError(f"the tokenizer has {vocab_size} tokens but model.vocab_size is {recipe.model.vocab_size}; "
                        f"set model.vocab_size to at least {vocab_size} (a multiple of 64 is fastest)")


def _swap_into_place(tmp: Path, data_dir: Path) -> None:
    """``os.replace`` the finished build onto ``data_dir``; an old folder is moved aside, then deleted."""
    old = None
    if data_dir.exists():
        old = tmp.with_name(tmp.name.replace(".tmp-", ".old-", 1))
        os.replace(data_dir, old)
    os.replace(tmp, data_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale_builds(data_dir: Path) -> None:
    """Delete temporary builds of ``data_dir`` left by killed ``prepare`` runs on this host."""
    host = socket.gethostname()
    for kind in ("tmp", "old"):
        for path in data_dir.parent.glob(f".{data_dir.name}.{kind}-{host}-*"):
            try:
                pid = int(path.name[len(f".{data_dir.name}.{kind}-{host}-"):].split("-")[0])
            except ValueError:
                continue
            if not _pid_alive(pid):
                shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}); delete {path.parent} and run `memtrain prepare` again") from None


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


__all__ = ["CHECKSUMS", "FORMAT_VERSION", "TOKENIZER_FINGERPRINT", "data_settings", "fingerprint", "named_files",
           "prepare", "split_documents"]
