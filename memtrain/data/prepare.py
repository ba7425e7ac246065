"""``memtrain prepare``: turn raw documents into tokenized, packed MDS shards in ``data_dir``.

Layout of a prepared data folder::

    <data_dir>/meta.json            settings, counts, tokenizer and fingerprint (written last)
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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from memtrain.config import Recipe
from memtrain.errors import DataError

FORMAT_VERSION = 1
META = "meta.json"
REPORT = "prepare_report.json"
TOKENIZER_FILE = "tokenizer.model"
_ENCODE_BATCH = 256


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
        settings["clustering"] = dataclasses.asdict(d.clustering)
    if "builtin" in d.sources:
        from memtrain.data.builtin import BUILTIN_VERSION

        settings["builtin_version"] = BUILTIN_VERSION
    if "builtin:longtail" in d.sources:
        from memtrain.data.longtail import LONGTAIL_VERSION

        settings["longtail_version"] = LONGTAIL_VERSION
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


def prepare(recipe: Recipe, force: bool = False) -> dict[str, Any]:
    """Prepare ``recipe.data_dir``; returns meta.json's contents plus ``status`` and throughput figures.

    ``status`` is ``"prepared"`` or ``"already prepared"`` (same fingerprint: nothing is read or written).
    """
    data_dir = recipe.data_dir
    settings = data_settings(recipe)
    fp = fingerprint(settings)
    meta_path = data_dir / META
    if meta_path.is_file() and not force:
        existing = _read_json(meta_path)
        if existing.get("fingerprint") == fp:
            return {**existing, "status": "already prepared"}
        raise DataError(f"{data_dir} already holds data prepared with different settings (sources, "
                        "text_field, seq_len, val_fraction, tokenizer or seed); pass --force to replace "
                        "it or choose another data.dir")
    if not meta_path.is_file() and data_dir.exists() and (not data_dir.is_dir() or any(data_dir.iterdir())):
        # Not ours (no meta.json): never delete it, even with --force.
        raise DataError(f"{data_dir} exists and is not a prepared memtrain data folder; remove it or "
                        "choose another data.dir")

    data_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(data_dir)
    tmp = data_dir.parent / f".{data_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        meta = _build(recipe, tmp, settings, fp)
        throughput = meta.pop("_throughput")
        report = {"documents": meta["counts"]["documents"],
                  "sequences": meta["counts"]["train_samples"] + meta["counts"]["val_samples"],
                  **meta.pop("report", {"branching": None, "depth": None}), "throughput": throughput}
        _write_json(tmp / REPORT, report)
        _write_json(tmp / META, meta)
        _swap_into_place(tmp, data_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
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
    docs = list(tqdm(read_documents(d.sources, d.text_field, read, cache_dir=out / ".cache"),
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
        if idx and sum(len(t) + 1 for t in tokens[split]) < sample_len:
            total = sum(len(t) + 1 for t in tokens[split])
            what = "training" if split == "train" else "validation"
            hint = ("set data.seq_len below that or add documents" if split == "train" else
                    "raise data.val_fraction, lower data.seq_len, or set data.val_fraction to 0")
            raise DataError(f"the {what} split has only {total} tokens ({len(idx)} documents), fewer than one "
                            f"sample of data.seq_len + 1 = {sample_len} tokens; {hint}")

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
        "dtype": dtype,
        "column": "tokens",
        "train_samples": train.samples,  # what the loaders serve; details in "counts"
        "val_samples": val.samples,
        "sources": list(d.sources),
        "files": list(read.files),
        "counts": {
            "documents": len(docs), "skipped_empty": read.skipped_empty,
            "train_documents": len(train_idx), "val_documents": len(val_idx),
            "train_samples": train.samples, "val_samples": val.samples,
            "train_tokens": train.tokens, "val_tokens": val.tokens, "tokens": total_tokens,
            "train_dropped_tokens": train.dropped_tokens, "val_dropped_tokens": val.dropped_tokens,
            "dropped_tokens": train.dropped_tokens + val.dropped_tokens,
        },
        **{key: clustered[key] for key in ("clustering", "streams", "report") if key in clustered},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "_throughput": {  # popped before meta.json is written
            "seconds": round(elapsed, 3),
            "documents_per_s": round(len(docs) / elapsed, 1),
            "tokens_per_s": round(total_tokens / max(time.perf_counter() - tok_start, 1e-9), 1),
        },
    }


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


__all__ = ["FORMAT_VERSION", "data_settings", "fingerprint", "prepare", "split_documents"]
