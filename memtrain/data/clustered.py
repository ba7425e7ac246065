"""Cluster-prefixed shards: the data layout of hierarchical memories.

Hierarchical-memories paper, Section 2.1, Appendix A.2 and Appendix C. Given tokenized documents,
:func:`build_clustered`

1. embeds non-overlapping windows of ``data.seq_len`` tokens of every training document with the
   sentence embedding model (all-MiniLM-L6-v2, L2-normalised; :mod:`memtrain.data.embed`);
2. trains the hierarchical balanced k-means tree on the window embeddings, root to leaves
   (:mod:`memtrain.data.cluster`), and saves it as ``tree.safetensors``;
3. assigns every document its cluster ids (i_1..i_p) from its normalised mean window embedding:
   training documents by the balanced descent (:meth:`ClusterTree.assign_balanced`: at every level no
   child holds more than ``balance_factor / k`` of its parent's documents, up to rounding in tiny
   nodes), validation documents by the plain greedy descent (:meth:`ClusterTree.assign`), the rule
   used for any text at evaluation time: they stand for unseen text, whose retrieval is greedy;
4. packs the documents of each leaf cluster into samples of ``seq_len + 1`` tokens separated by EOT
   (the last sample of a cluster padded with EOT, so rare clusters lose nothing), and puts the leaf
   cluster id in front of every sample: a stored sample is ``[leaf, t_0 .. t_seq_len]``;
5. shuffles all samples globally (seeded) and writes them as MDS shards, one stream (folder) per
   level-1 subtree: ``<split>/subtree-<i_1>``. Shallower ids follow from the leaf id:
   ``id_l = leaf // k^(p - l)``.

It returns the ``clustering`` and ``streams`` entries of ``meta.json`` and the figures of
``prepare_report.json``.

Distributed preparation (``memtrain prepare`` under torchrun, srun or the deepspeed launcher with W
processes; ``dist`` argument, see :class:`DistPart`). Rank ``r`` holds the documents ``idx[r::W]``
of each split (``idx`` in the seeded split order) and:

1. embeds its documents' windows;
2. sends its training windows' embeddings (each tagged with its document's position in the split,
   ``r + W * j`` for its ``j``-th document) to rank 0, at most ``ceil(tree_windows / W)`` of them,
   drawn uniformly without replacement (seeded by ``(run.seed, r)``) when it has more. Rank 0 sorts
   them back into document order (a stable sort on the tag: windows of one document keep their
   order) and trains the tree; so when no rank hits the cap, rank 0 trains on exactly the array the
   single process trains on, and the tree is identical whenever the window embeddings are. (They are
   when each window's embedding does not depend on which other windows share its batch: the encoder
   pads a batch to its longest window, which changes float rounding in the last bits, ~1e-7; with
   ``embedding_batch_size: 1``, same hardware and thread count, the trees are bit-identical, else
   equal to float tolerance.) The cap bounds rank 0's memory on very large corpora; the paper's EM
   visits only ``kmeans_steps * kmeans_samples`` examples per node anyway (Appendix C), so a few
   million windows suffice. When the cap bites, the tree depends on W.
3. every rank loads ``tree.safetensors`` (written by rank 0 into the shared build folder) and assigns
   its own documents: the balanced descent of the training documents sums its counts over the ranks
   and selects the closest proposers globally (``allreduce`` of :meth:`ClusterTree.assign_balanced`,
   with each document's position ``r + W * j`` in the split as the tie-break), so every document gets
   the ids the single process gives it and the limit holds over all ranks together, not per rank.
   Each rank then packs its documents per leaf (each rank pads its own last sample of a leaf), shuffles
   its samples with a seed derived from ``(run.seed, r)`` and writes one MDS part per subtree stream:
   ``<split>/subtree-<i>/part-<r:05d>/``. Rank 0 then merges each stream's parts into
   ``<split>/subtree-<i>/index.json`` (:func:`memtrain.data.shards.merge_parts`).

Counts are summed over ranks; the cluster balance report comes from the summed per-leaf counts.

The report (``prepare_report.json``, :func:`balance_figures` and :func:`affine_busiest_rank`) gives, for
the training documents: per level the largest child's share of its parent (``max_cluster_fraction``),
the same under plain greedy descent, the limit ``balance_factor / k`` and the nodes above it (only
nodes too small for the limit, see :func:`memtrain.data.cluster.capacity`); and, for cluster-affine
placement, the share of the training samples the busiest rank reads for world sizes
:data:`AFFINE_WORLD_SIZES` (the training world size is not known when preparing), next to 1/W.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from memtrain.config import Recipe
from memtrain.data.shards import COLUMN, HASHES, PackStats, merge_parts, pack, part_name
from memtrain.errors import DataError

TREE_FILE = "tree.safetensors"
# Distributed preparation: at most this many training windows (summed over ranks, each rank sending
# at most ceil(cap / W)) are gathered on rank 0 to train the tree; 4M x 384 float32 is 6 GB.
# MEMTRAIN_PREPARE_TREE_WINDOWS overrides it; so does prepare(..., tree_windows=N).
TREE_WINDOWS = 4_000_000
TREE_WINDOWS_ENV = "MEMTRAIN_PREPARE_TREE_WINDOWS"
# World sizes for which the report gives the busiest rank's share under cluster-affine placement: one
# node of 2-8 GPUs to 32 nodes of 8 (the paper trained on 64). Powers of two: a world size's groups are
# its largest divisor not above the number of level-1 subtrees, so other sizes repeat these patterns.
AFFINE_WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class DistPart:
    """This rank's share of a distributed preparation (see the module docstring).

    ``comm`` is the collective helper of :mod:`memtrain.data.prepare` (``rank``, ``world``, ``run``,
    ``all_gather``, ``gather_rows``); ``sizes`` the number of documents of each split over all ranks.
    """

    comm: Any
    sizes: dict[str, int]
    tree_windows: int = TREE_WINDOWS
    device: Optional[str] = None  # the embedding model's device; None: cuda when visible, else cpu


def rank_seed(seed: int, rank: int) -> int:
    """A seed derived from ``(run.seed, rank)`` for one rank's sampling and shuffling."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0])


def tree_windows_cap(requested: Optional[int] = None) -> int:
    """The tree's window cap: ``requested``, else $MEMTRAIN_PREPARE_TREE_WINDOWS, else TREE_WINDOWS."""
    if requested is None:
        raw = os.environ.get(TREE_WINDOWS_ENV)
        if raw is None:
            return TREE_WINDOWS
        try:
            requested = int(raw)
        except ValueError:
            requested = 0
        if requested < 1:
            raise DataError(f"{TREE_WINDOWS_ENV}={raw!r} must be a positive number of windows")
    if requested < 1:
        raise ValueError(f"tree_windows must be positive, got {requested}")
    return int(requested)


def sample_windows(n: int, cap: int, seed: int, rank: int) -> np.ndarray:
    """Indices (sorted) of the windows one rank sends to rank 0: all ``n``, or ``cap`` of them drawn
    uniformly without replacement with a generator seeded by ``(seed, rank)``."""
    if n <= cap:
        return np.arange(n)
    rng = np.random.default_rng([seed, rank, 0x74726565])  # "tree"
    return np.sort(rng.choice(n, size=cap, replace=False))


def balance_from_leaf_counts(leaf_counts: np.ndarray, branching: int, depth: int) -> dict[str, list]:
    """:func:`memtrain.data.cluster.balance_report` computed from the number of documents in every
    leaf (``[k^depth]``) instead of every document's ids; the figures are the same."""
    leaf_counts = np.asarray(leaf_counts, np.int64)
    n = int(leaf_counts.sum())
    fractions: list[float] = []
    nonempty: list[int] = []
    previous = None
    for level in range(depth):
        counts = leaf_counts.reshape(branching ** (level + 1), -1).sum(axis=1)
        parent = np.full_like(counts, n) if level == 0 else np.repeat(previous, branching)
        fractions.append(float(np.max(counts / np.maximum(parent, 1))) if n else 0.0)
        nonempty.append(int(np.count_nonzero(counts)))
        previous = counts
    return {"max_cluster_fraction": fractions, "clusters_per_level": nonempty}


def balance_figures(leaf_counts: np.ndarray, greedy_leaf_counts: np.ndarray, branching: int, depth: int,
                    balance_factor: float, moved: int) -> dict[str, Any]:
    """The ``balance`` entry of the report, from the training documents per leaf of the balanced
    assignment and of the plain greedy descent (``[k^depth]`` each) and the number of documents whose
    leaf the balancing changed.

    ``max_share_of_parent`` (per level; the report's ``max_cluster_fraction``) and
    ``max_share_of_parent_greedy``: the largest child's share of its parent's documents; ``limit``:
    ``balance_factor / k``; ``nodes_above_limit`` (per level): nodes whose largest child holds more than
    ``floor(balance_factor * n / k)`` of their ``n`` documents, which the balanced assignment allows
    only where that limit could not place every document (:func:`memtrain.data.cluster.capacity`)."""
    k = branching
    leaf_counts = np.asarray(leaf_counts, np.int64)
    above: list[int] = []
    for level in range(depth):
        counts = leaf_counts.reshape(k ** (level + 1), -1).sum(axis=1).reshape(-1, k)  # [parents, k]
        # the limit in whole documents, computed as memtrain.data.cluster.capacity does
        limit = np.floor(balance_factor * counts.sum(axis=1).astype(np.float64) / k).astype(np.int64)
        above.append(int(np.count_nonzero(counts.max(axis=1) > limit)))
    n = int(leaf_counts.sum())
    return {
        "balance_factor": balance_factor,
        "limit": balance_factor / k,
        "max_share_of_parent": balance_from_leaf_counts(leaf_counts, k, depth)["max_cluster_fraction"],
        "max_share_of_parent_greedy": balance_from_leaf_counts(greedy_leaf_counts, k, depth)["max_cluster_fraction"],
        "nodes_above_limit": above,
        "documents_moved": int(moved),
        "documents_moved_fraction": round(moved / n, 6) if n else 0.0,
    }


def affine_busiest_rank(samples_per_subtree: dict[int, int], branching: int, balance_factor: float,
                        world_sizes: tuple[int, ...] = AFFINE_WORLD_SIZES) -> list[dict[str, Any]]:
    """For cluster-affine placement on each of ``world_sizes``: the share of all training samples read
    by the busiest rank, with the groups :func:`affine_groups` forms (the train loader's), a group's
    ranks splitting its samples evenly (a rank reads its group's samples / ranks per
    group), next to the ideal ``1 / W``.

    ``limit`` is what the level-1 balance guarantees if every subtree holds at most ``balance_factor /
    k`` of the samples: with one subtree per group (as many groups as non-empty subtrees, e.g. every
    W that k divides), a group holds at most ``balance_factor / k`` and a rank
    ``balance_factor / k * groups / W`` (``balance_factor / W`` when the groups number k); with fewer
    groups, greedy bin packing (largest first, onto the lightest group) keeps a group under ``1 / G +
    (1 - 1/G) * balance_factor / k`` (list scheduling: the group was the lightest before its last
    subtree). The assignment balances documents; samples follow their tokens, so a subtree of longer
    than average documents can exceed its document share (``within_limit`` says whether it did)."""
    counts = {int(s): int(n) for s, n in samples_per_subtree.items() if n > 0}
    total = sum(counts.values())
    if not total:
        return []
    cap = balance_factor / branching
    out = []
    for world in world_sizes:
        groups, per_group = affine_groups(counts, world)
        g = len(groups)
        busiest = max(sum(counts[s] for s in group) for group in groups) / total / per_group
        group_limit = cap if g == len(counts) else 1 / g + (1 - 1 / g) * cap
        limit = min(1.0, group_limit) / per_group
        out.append({"world_size": world, "groups": g, "ranks_per_group": per_group,
                    "busiest_rank_share": round(busiest, 6), "ideal": round(1 / world, 6),
                    "ratio_to_ideal": round(busiest * world, 4), "limit": round(limit, 6),
                    "within_limit": bool(busiest <= limit + 1e-12)})
    return out


def affine_groups(samples_per_subtree: dict[int, int], world_size: int) -> tuple[list[list[int]], int]:
    """Level-1 subtrees bin-packed onto groups of ranks by sample count; returns (subtrees of each
    group, ranks per group).

    The number of groups is the largest divisor of the world size not above the number of subtrees,
    so every group has the same number of ranks and at least one subtree. Subtrees go, largest first,
    to the group with the fewest samples so far (ties: lowest group), which is deterministic.

    Samples are a token count: every sample holds exactly ``seq_len + 1`` tokens (documents packed with
    EOT), so a subtree's tokens are its samples times ``seq_len + 1``. The only tokens that carry no
    document are the EOT padding of each leaf cluster's last sample (``padded_tokens`` in the prepare
    report): less than one sample per leaf, which does not change the packing at any real scale.
    """
    subtrees = sorted(samples_per_subtree, key=lambda s: (-samples_per_subtree[s], s))
    if not subtrees:
        raise DataError("the prepared data has no level-1 subtree streams; prepare it again")
    n_groups = max(g for g in range(1, min(world_size, len(subtrees)) + 1) if world_size % g == 0)
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    load = [0] * n_groups
    for s in subtrees:
        g = min(range(n_groups), key=lambda i: (load[i], i))
        groups[g].append(s)
        load[g] += samples_per_subtree[s]
    return [sorted(g) for g in groups], world_size // n_groups


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
                    tokens: dict[str, list[np.ndarray]], tokenizer, progress: bool = True,
                    dist: Optional[DistPart] = None) -> dict[str, Any]:
    """Embed, cluster, pack and write ``splits`` (name -> document indices, with ``tokens`` aligned).

    With ``dist``, ``splits`` holds this rank's documents only and the work is shared as the module
    docstring describes; the return value is the same on every rank.
    """
    if dist is not None:
        return _build_distributed(recipe, out, docs, splits, tokens, tokenizer, progress, dist)
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
    ids = {split: tree.assign_balanced(emb, cl.balance_factor) if split == "train" else tree.assign(emb)
           for split, emb in doc_emb.items()}
    timings["assignment"] = time.perf_counter() - t
    greedy_leaves = tree.assign(doc_emb["train"])[:, -1]  # for the report: what plain descent would give

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
        per_stream = write_subtree_streams(samples, lambda s: out / split / stream_name(s, k), k, p, dtype,
                                           d.shard_size_limit, f"writing {split}", progress)
        streams[split] = [{"subtree": s, "dir": f"{split}/{stream_name(s, k)}", "samples": n}
                          for s, n in sorted(per_stream.items())]
        counts[split] = {"documents": len(idx), "samples": len(samples), "tokens": stats.tokens,
                         "padded_tokens": stats.padded_tokens}
    timings["packing_writing"] = time.perf_counter() - t

    report = balance_report(ids["train"], k)
    leaves = ids["train"][:, -1]
    report["balance"] = balance_figures(np.bincount(leaves, minlength=k**p), np.bincount(greedy_leaves, minlength=k**p),
                                        k, p, cl.balance_factor, int(np.count_nonzero(leaves != greedy_leaves)))
    return _result(cl, dtype, streams, counts, report, timings, {split: len(idx) for split, idx in splits.items()})


def write_subtree_streams(samples: list[np.ndarray], folder: Callable[[int], Path], branching: int, depth: int,
                          dtype: str, size_limit: int, desc: str, progress: bool) -> dict[int, int]:
    """Write prefixed ``samples`` (in their order) into one MDS dataset per level-1 subtree, in
    ``folder(subtree)``; returns the number of samples of each subtree."""
    from streaming import MDSWriter
    from tqdm.auto import tqdm

    k, p = branching, depth
    writers: dict[int, Any] = {}
    per_stream: dict[int, int] = {}
    try:
        for sample in tqdm(samples, desc=desc, unit=" samples", disable=None if progress else True):
            subtree = int(sample[0]) // k ** (p - 1)
            if subtree not in writers:
                writers[subtree] = MDSWriter(out=str(folder(subtree)), columns={COLUMN: f"ndarray:{dtype}"},
                                             size_limit=size_limit, hashes=HASHES)
            writers[subtree].write({COLUMN: sample})
            per_stream[subtree] = per_stream.get(subtree, 0) + 1
    finally:
        for writer in writers.values():
            writer.finish()
    return per_stream


def _result(cl, dtype: str, streams: dict[str, list[dict]], counts: dict[str, dict], report: dict[str, list],
            timings: dict[str, float], sizes: dict[str, int]) -> dict[str, Any]:
    k, p = cl.branching, cl.depth
    n_docs = sum(sizes.values())
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
            "balance": report["balance"],
            "affine_busiest_rank": affine_busiest_rank({s["subtree"]: s["samples"] for s in streams.get("train", [])},
                                                       k, cl.balance_factor),
            "seconds": {key: round(v, 3) for key, v in timings.items()},
            "documents_per_s": {
                "embedding": round(n_docs / max(timings["embedding"], 1e-9), 1),
                "tree": round(sizes["train"] / max(timings["tree"], 1e-9), 1),
                "assignment": round(n_docs / max(timings["assignment"], 1e-9), 1),
                "packing_writing": round(n_docs / max(timings["packing_writing"], 1e-9), 1),
            },
        },
    }


def _build_distributed(recipe: Recipe, out: Path, docs: list[str], splits: dict[str, list[int]],
                       tokens: dict[str, list[np.ndarray]], tokenizer, progress: bool,
                       dist: DistPart) -> dict[str, Any]:
    """:func:`build_clustered` for one rank of W (module docstring). Every step that may fail runs
    through ``comm.run``, which makes all ranks fail together instead of leaving some waiting."""
    from memtrain.data.cluster import ClusterTree, check_enough, train_tree
    from memtrain.data.embed import embed_windows, load_embedder, mean_by_document

    comm = dist.comm
    rank, world = comm.rank, comm.world
    cl, d = recipe.data.clustering, recipe.data
    k, p = cl.branching, cl.depth
    seed = recipe.run.seed
    comm.run(lambda: check_enough(dist.sizes["train"], k))
    timings: dict[str, float] = {}

    def embed() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        model = load_embedder(cl.embedding_model, device=dist.device)
        doc_emb: dict[str, np.ndarray] = {}
        windows = owners = None
        for split, idx in splits.items():
            if not idx and split != "train":
                continue
            win_emb, win_doc = embed_windows([docs[i] for i in idx], tokenizer, d.seq_len, model,
                                             cl.embedding_batch_size, progress=progress)
            if idx:
                doc_emb[split] = mean_by_document(win_emb, win_doc, len(idx))
            if split == "train":
                windows, owners = win_emb, win_doc
        return doc_emb, windows, owners

    t = time.perf_counter()
    doc_emb, windows, owners = comm.run(embed)
    timings["embedding"] = time.perf_counter() - t

    # Training windows to rank 0, tagged with their document's position in the split's order.
    keep = sample_windows(len(windows), math.ceil(dist.tree_windows / world), seed, rank)
    t = time.perf_counter()
    all_windows = comm.gather_rows(np.ascontiguousarray(windows[keep]))
    all_keys = comm.gather_rows((rank + world * owners[keep]).astype(np.int64)[:, None])
    del windows, keep

    def tree_on_rank0() -> None:
        if rank != 0:
            return
        order = np.argsort(all_keys[:, 0], kind="stable")  # back to the split's document order
        tree = train_tree(all_windows[order], k, p, steps=cl.kmeans_steps, samples=cl.kmeans_samples,
                          balance_factor=cl.balance_factor, seed=seed, progress=progress,
                          embedding_model=cl.embedding_model)
        tree.save(out / TREE_FILE)

    comm.run(tree_on_rank0)
    del all_windows, all_keys
    timings["tree"] = time.perf_counter() - t

    dtype = prefixed_dtype(tokenizer.vocab_size, k, p)
    sample_len = d.seq_len + 1

    t = time.perf_counter()
    tree = comm.run(lambda: ClusterTree.load(out / TREE_FILE, expect_branching=k, expect_depth=p))
    # Every rank takes part in the balanced assignment's all-reduces, with or without training documents
    # (outside comm.run: the collectives must not be interleaved with its failure agreement).
    train_emb = doc_emb.get("train", np.zeros((0, tree.dim), np.float32))
    balanced = tree.assign_balanced(train_emb, cl.balance_factor, positions=rank + world * np.arange(len(train_emb)),
                                    allreduce=lambda a: np.asarray(comm.sum(np.asarray(a).tolist()), np.int64))
    assign_s = time.perf_counter() - t

    def assign_pack_write() -> dict[str, Any]:
        t = time.perf_counter()
        ids = {split: balanced if split == "train" else tree.assign(emb) for split, emb in doc_emb.items()}
        mine: dict[str, Any] = {"seconds": {"assignment": assign_s + time.perf_counter() - t}}
        t = time.perf_counter()
        leaf_counts = np.zeros(k**p, np.int64)
        greedy_counts = np.zeros(k**p, np.int64)
        moved = 0
        if "train" in ids:
            leaf_counts += np.bincount(ids["train"][:, -1], minlength=k**p)
            greedy = tree.assign(doc_emb["train"])[:, -1]
            greedy_counts += np.bincount(greedy, minlength=k**p)
            moved = int(np.count_nonzero(greedy != ids["train"][:, -1]))
        rng = random.Random(rank_seed(seed, rank))
        per_split: dict[str, dict] = {}
        for split, idx in splits.items():
            if not idx:
                continue
            stats = PackStats()
            samples = pack_by_leaf(tokens[split], ids[split][:, -1], tokenizer.eot_id, sample_len, dtype, stats)
            rng.shuffle(samples)
            per_stream = write_subtree_streams(
                samples, lambda s: out / split / stream_name(s, k) / part_name(rank), k, p, dtype,
                d.shard_size_limit, f"writing {split}", progress)
            per_split[split] = {"streams": per_stream, "samples": len(samples), "tokens": stats.tokens,
                                "padded_tokens": stats.padded_tokens}
        mine["seconds"]["packing_writing"] = time.perf_counter() - t
        mine["splits"] = per_split
        mine["leaf_counts"] = leaf_counts.tolist()
        mine["greedy_leaf_counts"] = greedy_counts.tolist()
        mine["moved"] = moved
        return mine

    everyone = comm.all_gather(comm.run(assign_pack_write))
    for stage in ("assignment", "packing_writing"):
        timings[stage] = max(r["seconds"][stage] for r in everyone)  # the slowest rank

    streams: dict[str, list[dict]] = {}
    counts: dict[str, dict] = {}
    for split, n_docs in dist.sizes.items():
        if not n_docs:
            continue
        per_stream: dict[int, int] = {}
        total = {"documents": n_docs, "samples": 0, "tokens": 0, "padded_tokens": 0}
        for r in everyone:
            got = r["splits"].get(split)
            if got is None:
                continue
            for key in ("samples", "tokens", "padded_tokens"):
                total[key] += got[key]
            for s, n in got["streams"].items():
                per_stream[int(s)] = per_stream.get(int(s), 0) + n
        streams[split] = [{"subtree": s, "dir": f"{split}/{stream_name(s, k)}", "samples": n}
                          for s, n in sorted(per_stream.items())]
        counts[split] = total

    def merge_on_rank0() -> None:
        if rank != 0:
            return
        for split, entries in streams.items():
            for entry in entries:
                merged = merge_parts(out / entry["dir"])
                if merged != entry["samples"]:
                    raise DataError(f"{out / entry['dir']} lists {merged} samples in its parts but the ranks wrote "
                                    f"{entry['samples']}; is the parent of data.dir on a filesystem shared by all "
                                    "nodes?")

    comm.run(merge_on_rank0)
    leaf_counts = np.sum([np.asarray(r["leaf_counts"], np.int64) for r in everyone], axis=0)
    report = balance_from_leaf_counts(leaf_counts, k, p)
    greedy_counts = np.sum([np.asarray(r["greedy_leaf_counts"], np.int64) for r in everyone], axis=0)
    report["balance"] = balance_figures(leaf_counts, greedy_counts, k, p, cl.balance_factor,
                                        sum(r["moved"] for r in everyone))
    return _result(cl, dtype, streams, counts, report, timings, dist.sizes)


__all__ = ["AFFINE_WORLD_SIZES", "TREE_FILE", "TREE_WINDOWS", "DistPart", "affine_busiest_rank", "balance_figures",
           "balance_from_leaf_counts", "build_clustered", "pack_by_leaf", "prefixed_dtype", "rank_seed",
           "sample_windows", "stream_name", "tree_windows_cap", "write_subtree_streams"]
