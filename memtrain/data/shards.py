"""Packing token streams into fixed-length samples and writing them as MDS shards.

Each document's tokens are followed by one end-of-text token; the documents are concatenated in the
given order and cut into samples of ``sample_len = seq_len + 1`` tokens (a model reads the first
``seq_len`` and predicts the last ``seq_len``). The final partial sample is dropped and counted.
Samples are stored in one MDS column, ``tokens``, as ``uint16`` (or ``uint32`` for vocabularies
of more than 65,536 ids). Every shard file's xxh64 checksum is recorded in ``index.json``
(``raw_data.hashes``, Streaming's own field; :data:`HASHES`), which :mod:`memtrain.data.verify` checks.

Distributed preparation writes one MDS dataset per rank into ``<stream>/part-<rank:05d>/`` and then
merges their ``index.json`` files into ``<stream>/index.json`` (:func:`merge_parts`, with
mosaicml-streaming's own ``merge_index``), so ``StreamingDataset(local=<stream>)`` reads every part.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

COLUMN = "tokens"
PART_PREFIX = "part-"
# Checksums Streaming records for every shard file it writes (index.json, raw_data.hashes). Streaming
# checks them only when it downloads a shard, never for local shards: memtrain.data.verify does.
HASHES = ["xxh64"]


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype holding every id below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass
class PackStats:
    documents: int = 0
    tokens: int = 0  # including one end-of-text token per document
    samples: int = 0
    dropped_tokens: int = 0  # the final partial sample (pad_last=False)
    padded_tokens: int = 0  # end-of-text tokens appended to fill the final sample (pad_last=True)


def pack(docs: Iterable[Sequence[int] | np.ndarray], eot_id: int, sample_len: int, dtype: str = "uint32",
         stats: Optional[PackStats] = None, pad_last: bool = False) -> Iterator[np.ndarray]:
    """Yield ``sample_len``-token arrays cut from ``doc0 EOT doc1 EOT ...``; ``stats`` is filled in.

    The final partial sample is dropped, or with ``pad_last`` filled up with end-of-text tokens (the
    loader masks the loss of EOT -> EOT transitions, which real text never has since empty documents
    are skipped), so that no document is lost: cluster-packed data has one such tail per cluster, and
    the rare clusters are the ones that matter.
    """
    stats = stats if stats is not None else PackStats()
    buf = np.empty(0, dtype=dtype)
    pending: list[np.ndarray] = []
    pending_len = 0
    eot = np.array([eot_id], dtype=dtype)
    for doc in docs:
        arr = np.asarray(doc, dtype=dtype)
        stats.documents += 1
        stats.tokens += len(arr) + 1
        pending += [arr, eot]
        pending_len += len(arr) + 1
        if len(buf) + pending_len < sample_len:
            continue
        # concatenate only when at least one sample is complete, so long runs of short documents stay cheap
        buf = np.concatenate([buf] + pending)
        pending, pending_len = [], 0
        n = len(buf) // sample_len
        for i in range(n):
            stats.samples += 1
            yield buf[i * sample_len:(i + 1) * sample_len]
        buf = buf[n * sample_len:].copy()
    rest = np.concatenate([buf] + pending) if pending else buf
    if pad_last and len(rest):
        stats.samples += 1
        stats.padded_tokens = sample_len - len(rest)
        yield np.concatenate([rest, np.full(sample_len - len(rest), eot_id, dtype=dtype)])
    else:
        stats.dropped_tokens = len(rest)


def write_mds(out: str | Path, samples: Iterable[np.ndarray], dtype: str, size_limit: int,
              progress: Optional[object] = None) -> int:
    """Write ``samples`` into the MDS dataset folder ``out``; returns the number written.

    ``progress`` is an optional tqdm bar advanced once per sample.
    """
    from streaming import MDSWriter

    count = 0
    with MDSWriter(out=str(out), columns={COLUMN: f"ndarray:{dtype}"}, size_limit=size_limit,
                   hashes=HASHES) as writer:
        for sample in samples:
            writer.write({COLUMN: sample})
            count += 1
            if progress is not None:
                progress.update(1)
    return count


def part_name(rank: int) -> str:
    """The folder of one rank's MDS part inside a stream folder: ``part-00003``."""
    return f"{PART_PREFIX}{rank:05d}"


def merge_parts(folder: str | Path) -> int:
    """Merge the ``index.json`` of every ``part-*`` folder of ``folder`` into ``folder/index.json``.

    Uses ``streaming.base.util.merge_index``, which prefixes every shard's file names with its part
    folder (``part-00001/shard.00000.mds``); ``StreamingDataset(local=folder)`` then reads all parts,
    in part (rank) order. The shards' checksums (``raw_data.hashes``) are kept as the parts recorded them.
    Returns the number of samples the merged index lists.
    """
    from streaming.base.util import merge_index

    folder = Path(folder)
    indexes = sorted(folder.glob(f"{PART_PREFIX}*/index.json"))
    if not indexes:
        raise FileNotFoundError(f"no {PART_PREFIX}*/index.json in {folder}")
    if (folder / "index.json").exists():
        raise FileExistsError(f"{folder / 'index.json'} exists already")
    # merge_index announces its temporary folder with logging.warning on the root logger: hush it
    manager = logging.root.manager
    previous = manager.disable
    logging.disable(max(previous, logging.WARNING))
    try:
        merge_index([str(p) for p in indexes], str(folder), keep_local=True)
    finally:
        logging.disable(previous)
    merged = json.loads((folder / "index.json").read_text(encoding="utf-8"))
    return sum(int(shard["samples"]) for shard in merged["shards"])


__all__ = ["COLUMN", "HASHES", "PART_PREFIX", "PackStats", "merge_parts", "pack", "part_name", "token_dtype",
           "write_mds"]
