"""The data path: raw documents -> tokenizer -> packed MDS shards -> training batches.

Modules: :mod:`~memtrain.data.builtin` (the built-in fact corpus), :mod:`~memtrain.data.longtail`
(the Zipf-frequency knowledge corpus and its probes), :mod:`~memtrain.data.sources`
(reading documents), :mod:`~memtrain.data.tokenizer`, :mod:`~memtrain.data.shards` (packing and MDS
writing), :mod:`~memtrain.data.prepare` (``memtrain prepare``), :mod:`~memtrain.data.loader`
(StreamingDataset loaders with resumable state) and :mod:`~memtrain.data.verify` (shard checksums,
the recipe against the prepared data); for hierarchical memories :mod:`~memtrain.data.embed`
(sentence embeddings), :mod:`~memtrain.data.cluster` (the balanced k-means tree) and
:mod:`~memtrain.data.clustered` (cluster-prefixed shards, one stream per level-1 subtree).

Importing this package is cheap: the heavy libraries (streaming, datasets, sentencepiece,
transformers) are imported by the functions that use them. The names below load their module
on first access. It also defers streaming's own dataset packages (text, vision, multimodal), which
memtrain never reads, until something uses them: :mod:`~memtrain.data.streaming_import`.
"""

from __future__ import annotations

import importlib
from typing import Any

from memtrain.data.streaming_import import defer_dataset_packages

defer_dataset_packages()

_EXPORTS = {
    "builtin_documents": "builtin",
    "longtail_documents": "longtail",
    "probes": "longtail",
    "write_probes": "longtail",
    "read_probes": "longtail",
    "read_documents": "sources",
    "load_tokenizer": "tokenizer",
    "SentencePieceTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "prepare": "prepare",
    "read_meta": "loader",
    "build_loader": "loader",
    "collate": "loader",
    "document_ids": "loader",
    "Collate": "loader",
    "LoaderIterator": "loader",
    "verify_shards": "verify",
    "check_recipe_data": "verify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"memtrain.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'memtrain.data' has no attribute {name!r}")
