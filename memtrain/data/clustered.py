"""Cluster-prefixed shards: the data layout of hierarchical memories.

Hierarchical-memories paper, Section 2.1, Appendix A.2 and Appendix C. Given tokenized documents,
:func:`build_clustered`

1. embeds non-overlapping windows of ``data.seq_len`` tokens of every training document with the
   sentence embedding model (all-MiniLM-L6-v2, L2-normalised; :mod:`memtrain.data.embed`);
2. trains the hierarchical balanced k-means tree on the window embeddings, root to leaves
   (:mod:`memtrain.data.cluster`), and saves it as ``tree.safetensors``;
3. assigns every document (train and validation) its cluster ids (i_1..i_p) by greedy descent from
   its normalised mean window embedding;
4. packs the documents of each leaf cluster into samples of ``seq_len + 1`` tokens separated by EOT
   (the last sample of a cluster padded with EOT, so rare clusters lose nothing), and puts the leaf
   cluster id in front of every sample: a stored sample is ``[leaf, t_0 .. t_seq_len]``;
5. shuffles all samples globally (seeded) and writes them as MDS shards, one stream (folder) per
   level-1 subtree: ``<split>/subtree-<i_1>``. Shallower ids follow from the leaf id:
   ``id_l = leaf // k^(p - l)``.

It returns the ``clustering`` and ``streams`` entries of ``meta.json`` and the figures of
``prepare_report.json``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from memtrain.config import Recipe
from memtrain.data.shards import COLUMN, PackStats, pack

TREE_FILE = "tree.safetensors"


def stream_name(subtree: int, branching: int) -> str:
    return f"subtree-{subtree:0{len(str(branching - 1))}d}"


def prefixed_dtype(vocab_size: int, branching: int, depth: int) -> str:
    """A dtype holding every token id and every leaf cluster id."""
    return "uint16" if max(vocab_size, branching**depth) <= 1 << 16 else "uint32"


def pack_by_leaf(docs: list[np.ndarray], leaves: np.ndarray, eot_id: int, sample_len: int, dtype: str,
                 stats: PackStats | None = None) -> list[np.ndarray]:
    """Pack each leaf's documents (in their given order) into ``[leaf] + sample_len`` token samples.

    Samples come grouped by leaf, in increasing leaf order; each leaf's last sample is padded with EOT.
    """
    out: list[np.ndarray] = []
    for leaf in np.unique(leaves):
        prefix = np.array([leaf], dtype=dtype)
        members = np.flatnonzero(leaves == leaf)
        for sample in pack((docs[j] for j in members), eot_id, sample_len, dtype, stats, pad_last=True):
            out.append(np.concatenate([prefix, sample]))
    return out


def build_clustered(recipe: Recipe, out: Path, docs: list[str], splits: dict[str, list[int]],
                    tokens: dict[str, list[np.ndarray]], tokenizer, progress: bool = True) -> dict[str, Any]:
    """Embed, cluster, pack and write ``splits`` (name -> document indices, with ``tokens`` aligned)."""
    from streaming import MDSWriter
    from tqdm.auto import tqdm

    from memtrain.data.cluster import balance_report, check_enough, train_tree
    from memtrain.data.embed import embed_windows, load_embedder, mean_by_document

    cl, d = recipe.data.clustering, recipe.data
    k, p = cl.branching, cl.depth
    check_enough(len(splits["train"]), k)
    timings: dict[str, float] = {}

    t = time.perf_counter()
    model = load_embedder(cl.embedding_model)
    doc_emb: dict[str, np.ndarray] = {}
    train_windows = None
    for split, idx in splits.items():
        if not idx:
            continue
        win_emb, win_doc = embed_windows([docs[i] for i in idx], tokenizer, d.seq_len, model,
                                         cl.embedding_batch_size, progress=progress)
        doc_emb[split] = mean_by_document(win_emb, win_doc, len(idx))
        if split == "train":
            train_windows = win_emb
    timings["embedding"] = time.perf_counter() - t

    t = time.perf_counter()
    tree = train_tree(train_windows, k, p, steps=cl.kmeans_steps, samples=cl.kmeans_samples,
                      balance_factor=cl.balance_factor, seed=recipe.run.seed, progress=progress,
                      embedding_model=cl.embedding_model)
    tree.save(out / TREE_FILE)
    timings["tree"] = time.perf_counter() - t

    t = time.perf_counter()
    ids = {split: tree.assign(emb) for split, emb in doc_emb.items()}
    timings["assignment"] = time.perf_counter() - t

    t = time.perf_counter()
    dtype = prefixed_dtype(tokenizer.vocab_size, k, p)
    sample_len = d.seq_len + 1
    streams: dict[str, list[dict]] = {}
    counts: dict[str, dict] = {}
    rng = random.Random(recipe.run.seed)
    for split, idx in splits.items():
        if not idx:
            continue
        stats = PackStats()
        samples = pack_by_leaf(tokens[split], ids[split][:, -1], tokenizer.eot_id, sample_len, dtype, stats)
        rng.shuffle(samples)  # global shuffle, before routing to the subtree streams
        writers: dict[int, Any] = {}
        per_stream: dict[int, int] = {}
        try:
            for sample in tqdm(samples, desc=f"writing {split}", unit=" samples", disable=None if progress else True):
                subtree = int(sample[0]) // k ** (p - 1)
                if subtree not in writers:
                    writers[subtree] = MDSWriter(out=str(out / split / stream_name(subtree, k)),
                                                 columns={COLUMN: f"ndarray:{dtype}"}, size_limit=d.shard_size_limit)
                writers[subtree].write({COLUMN: sample})
                per_stream[subtree] = per_stream.get(subtree, 0) + 1
        finally:
            for writer in writers.values():
                writer.finish()
        streams[split] = [{"subtree": s, "dir": f"{split}/{stream_name(s, k)}", "samples": n}
                          for s, n in sorted(per_stream.items())]
        counts[split] = {"documents": len(idx), "samples": len(samples), "tokens": stats.tokens,
                         "padded_tokens": stats.padded_tokens}
    timings["packing_writing"] = time.perf_counter() - t

    report = balance_report(ids["train"], k)
    n_train = len(splits["train"])
    return {
        "dtype": dtype,
        "clustering": {"branching": k, "depth": p, "tree": TREE_FILE, "embedding_model": cl.embedding_model,
                       "prefix": True},
        "streams": streams,
        "split_counts": counts,
        "report": {
            "branching": k, "depth": p,
            "clusters_per_level": report["clusters_per_level"],
            "max_cluster_fraction": report["max_cluster_fraction"],
            "seconds": {key: round(v, 3) for key, v in timings.items()},
            "documents_per_s": {
                "embedding": round(sum(len(i) for i in splits.values()) / max(timings["embedding"], 1e-9), 1),
                "tree": round(n_train / max(timings["tree"], 1e-9), 1),
                "assignment": round(sum(len(i) for i in splits.values()) / max(timings["assignment"], 1e-9), 1),
                "packing_writing": round(sum(len(i) for i in splits.values())
                                         / max(timings["packing_writing"], 1e-9), 1),
            },
        },
    }


__all__ = ["TREE_FILE", "build_clustered", "pack_by_leaf", "prefixed_dtype", "stream_name"]
