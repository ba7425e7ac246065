"""The data path: raw documents -> tokenizer -> packed MDS shards -> training batches.

Modules: :mod:`~memtrain.data.builtin` (the built-in fact corpus), :mod:`~memtrain.data.sources`
(reading documents), :mod:`~memtrain.data.tokenizer`, :mod:`~memtrain.data.shards` (packing and MDS
writing), :mod:`~memtrain.data.prepare` (``memtrain prepare``) and :mod:`~memtrain.data.loader`
(StreamingDataset loaders with resumable state).

Importing this package is cheap: the heavy libraries (streaming, datasets, sentencepiece,
transformers) are imported by the functions that use them. The names below load their module
on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "builtin_documents": "builtin",
    "read_documents": "sources",
    "load_tokenizer": "tokenizer",
    "SentencePieceTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "prepare": "prepare",
    "read_meta": "loader",
    "build_loader": "loader",
    "collate": "loader",
    "Collate": "loader",
    "LoaderIterator": "loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"memtrain.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'memtrain.data' has no attribute {name!r}")
