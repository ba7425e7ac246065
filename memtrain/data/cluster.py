"""Hierarchical balanced k-means: the clustering tree of the memory retriever.

Hierarchical-memories paper, Section 2.1: documents are split into k clusters by k-means, each
cluster again into k sub-clusters, for p levels, giving k^l nested clusters at level l. A document's
index tuple (i_1, ..., i_p) comes from a greedy descent: at each level its embedding is compared (L2
distance) with the k centroids of the current node and the closest child is visited, O(p k)
comparisons in all.

Appendix C (training): the tree is trained root to leaves; each node is split by k-means on the
examples that belong to it, vectors L2-normalised first, k-means++ initialisation, then
Expectation-Maximisation where every step draws a fresh sample (6,400 examples, 20 steps). To keep
clusters close to uniform, at every assignment step a cluster holding more than the balancing limit
(balance_factor / k, 1.5/16 in the paper) hands a random half of its assignments to the smallest
cluster (Jegou et al., 2010).

Cluster ids are global per level: ``ids[:, l]`` is in ``[0, k^(l+1))`` and the children of cluster
``c`` at one level are ``c*k .. c*k + k-1`` at the next, so ``ids[:, l] // k == ids[:, l-1]``. The
tree's internal nodes are stored level-major: node ``n`` of level ``l`` (the root is node 0 of level
0) holds the ``k`` centroids of its children, which are the level-``l+1`` nodes ``n*k + j``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from memtrain.errors import DataError

FORMAT = "memtrain-cluster-tree"
VERSION = 1
# Vectors per chunk in the greedy descent: bounds the gathered centroids to chunk*k*dim float64
# (512 * 16 * 384 * 8 bytes = 25 MB).
_ASSIGN_CHUNK = 512


def check_enough(n: int, branching: int) -> None:
    """Raise :class:`DataError` when ``n`` documents cannot fill the root's ``branching`` clusters."""
    if n < branching:
        raise DataError(f"corpus has {n} documents, fewer than data.clustering.branching {branching} clusters; add "
                        "documents or lower branching")


def normalize(x: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """Rows scaled to unit L2 norm (all-zero rows stay zero)."""
    x = np.asarray(x, dtype=dtype)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12).astype(dtype)


def level_offset(level: int, branching: int) -> int:
    """Index of the first node of ``level`` in the level-major node order: 1 + k + ... + k^(level-1)."""
    return sum(branching ** i for i in range(level))


def num_internal_nodes(branching: int, depth: int) -> int:
    return level_offset(depth, branching)


@dataclass(eq=False)  # numpy fields: compare trees with np.array_equal on centroids
class ClusterTree:
    """A trained tree: ``centroids[node, j]`` is the centroid of child ``j`` of internal ``node``."""

    branching: int
    depth: int
    dim: int
    centroids: np.ndarray  # [num_internal_nodes, branching, dim] float32
    embedding_model: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        expected = (num_internal_nodes(self.branching, self.depth), self.branching, self.dim)
        if self.centroids.shape != expected:
            raise ValueError(f"centroids have shape {self.centroids.shape}, expected {expected}")
        self.centroids = np.ascontiguousarray(self.centroids, dtype=np.float32)
        self._sq = np.zeros(self.centroids.shape[:2], np.float64)
        self._update_norms(0, len(self.centroids))

    def _update_norms(self, start: int, stop: int) -> None:
        # ||c||^2 per centroid, for distances ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2 in the descent
        c = self.centroids[start:stop].astype(np.float64)
        self._sq[start:stop] = np.einsum("nkd,nkd->nk", c, c)

    # ------------------------------------------------------------------------------------------
    # assignment

    def descend(self, x: np.ndarray, level: int, node: np.ndarray) -> np.ndarray:
        """One greedy step: for unit-norm float64 rows ``x`` sitting at level-``level`` nodes
        ``node``, the index (0..k-1) of the closest child centroid (ties -> lowest index)."""
        k = self.branching
        out = np.empty(len(x), np.int64)
        base = level_offset(level, k)
        for s in range(0, len(x), _ASSIGN_CHUNK):
            rows = node[s:s + _ASSIGN_CHUNK] + base
            c = self.centroids[rows].astype(np.float64)  # [chunk, k, dim]
            # ||x||^2 is the same for every child of a row, so it does not change the argmin
            dist = self._sq[rows] - 2.0 * np.einsum("nkd,nd->nk", c, x[s:s + _ASSIGN_CHUNK])
            out[s:s + _ASSIGN_CHUNK] = np.argmin(dist, axis=1)
        return out

    def assign(self, x: np.ndarray) -> np.ndarray:
        """Greedy descent (Section 2.1) of every row of ``x [n, dim]`` after L2 normalisation; returns
        the global cluster id at every level, ``[n, depth]`` int64."""
        x = self._check(x)
        ids = np.empty((len(x), self.depth), np.int64)
        node = np.zeros(len(x), np.int64)
        for level in range(self.depth):
            node = node * self.branching + self.descend(x, level, node)
            ids[:, level] = node
        return ids

    def assign_brute_force(self, x: np.ndarray) -> np.ndarray:
        """The same greedy rule written as a plain loop, one vector and one child at a time (for tests)."""
        x = self._check(x)
        k = self.branching
        ids = np.empty((len(x), self.depth), np.int64)
        for i in range(len(x)):
            node = 0
            for level in range(self.depth):
                best, best_d = 0, np.inf
                for j in range(k):
                    c = self.centroids[level_offset(level, k) + node, j].astype(np.float64)
                    d = float(np.sum((x[i] - c) ** 2))
                    if d < best_d:
                        best, best_d = j, d
                node = node * k + best
                ids[i, level] = node
        return ids

    @staticmethod
    def leaf_ids(ids: np.ndarray) -> np.ndarray:
        return ids[:, -1]

    @staticmethod
    def levels_from_leaf(leaf: np.ndarray, branching: int, depth: int) -> np.ndarray:
        """All levels' ids from leaf ids: ``ids[:, l] = leaf // k^(depth-1-l)``."""
        leaf = np.asarray(leaf, np.int64)
        return np.stack([leaf // branching ** (depth - 1 - l) for l in range(depth)], axis=1)

    def _check(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expected embeddings [n, {self.dim}], got shape {x.shape}")
        return normalize(x, np.float64)

    # ------------------------------------------------------------------------------------------
    # files

    def save(self, path: str | Path) -> None:
        """Write a safetensors file with the centroids and the tree's metadata (atomically)."""
        from safetensors.numpy import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "version": str(VERSION), "branching": str(self.branching),
                "depth": str(self.depth), "dim": str(self.dim), "embedding_model": self.embedding_model,
                "seed": str(self.seed)}
        tmp = path.with_name(path.name + ".tmp")
        save_file({"centroids": self.centroids}, str(tmp), metadata=meta)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, expect_branching: Optional[int] = None, expect_depth: Optional[int] = None,
             expect_dim: Optional[int] = None) -> "ClusterTree":
        """Read a file written by :meth:`save`; :class:`DataError` if it is missing, unreadable, or
        disagrees with the expected branching / depth / embedding dimension."""
        from safetensors import safe_open

        path = Path(path)
        rebuild = f"delete {path} to rebuild the tree"
        if not path.is_file():
            raise DataError(f"cluster tree {path} does not exist; run the clustering step (data.clustering.enabled) "
                            "to build it")
        try:
            with safe_open(str(path), framework="np") as f:
                meta = f.metadata() or {}
                centroids = f.get_tensor("centroids")
        except Exception as e:  # safetensors raises several types (SafetensorError, OSError, ...) on bad files
            raise DataError(f"cluster tree {path} is unreadable or corrupt ({e}); {rebuild}") from None
        if meta.get("format") != FORMAT:
            raise DataError(f"{path} is not a memtrain cluster tree (format {meta.get('format')!r}); {rebuild}")
        try:
            version = int(meta["version"])
            branching, depth, dim = int(meta["branching"]), int(meta["depth"]), int(meta["dim"])
            seed = int(meta.get("seed", "0"))
        except (KeyError, ValueError) as e:
            raise DataError(f"cluster tree {path} has malformed metadata ({e!r}); {rebuild}") from None
        if version > VERSION:
            raise DataError(f"cluster tree {path} has format version {version}, newer than this memtrain reads "
                            f"({VERSION}); upgrade memtrain or {rebuild}")
        for key, found, want in (("depth", depth, expect_depth), ("branching", branching, expect_branching)):
            if want is not None and found != want:
                raise DataError(f"tree in {path} has {key} {found} but data.clustering.{key} is {want}; {rebuild} "
                                f"or set data.clustering.{key}: {found}")
        if expect_dim is not None and dim != expect_dim:
            raise DataError(f"tree in {path} was trained on {dim}-dimensional embeddings but the embedding model "
                            f"gives {expect_dim}; {rebuild} or set data.clustering.embedding_model to "
                            f"{meta.get('embedding_model', '')!r}")
        try:
            return cls(branching, depth, dim, centroids, meta.get("embedding_model", ""), seed)
        except ValueError as e:
            raise DataError(f"cluster tree {path} is inconsistent ({e}); {rebuild}") from None


# ----------------------------------------------------------------------------------------------
# training


def train_tree(embeddings: np.ndarray, branching: int, depth: int, steps: int = 20, samples: int = 6400,
               balance_factor: float = 1.5, seed: int = 0, progress: bool = True,
               embedding_model: str = "") -> ClusterTree:
    """Train a tree of ``depth`` levels, each node split into ``branching`` children (Appendix C).

    Nodes are trained breadth-first from the root. Each node's members (the rows that the greedy
    descent through the already-trained levels brings to it) are clustered by :func:`balanced_kmeans`;
    then every member is sent to its closest child with :meth:`ClusterTree.descend`, the rule used at
    inference, so the tree that splits the data is exactly the tree that assigns it later.

    Every node has its own random generator seeded by ``(seed, level, node)``, so results do not depend
    on the order nodes are trained in. Nodes with fewer members than ``branching`` and nodes without
    members are handled as described in :func:`balanced_kmeans` and :func:`_empty_node`.
    """
    x = np.asarray(embeddings)
    if x.ndim != 2 or len(x) == 0:
        raise DataError(f"no embeddings to cluster (got shape {x.shape}); add documents to data.sources")
    if not np.isfinite(x).all():
        raise ValueError("embeddings contain NaN or infinite values")
    if branching < 2 or depth < 1 or steps < 0 or samples < 1 or balance_factor < 1.0:
        raise ValueError(f"need branching >= 2, depth >= 1, steps >= 0, samples >= 1 and balance_factor >= 1; got "
                         f"{branching}, {depth}, {steps}, {samples}, {balance_factor}")
    x = normalize(x, np.float32)
    x64 = x.astype(np.float64)
    n, dim = x.shape
    k = branching
    tree = ClusterTree(k, depth, dim, np.zeros((num_internal_nodes(k, depth), k, dim), np.float32),
                       embedding_model, seed)
    bar = _progress_bar(num_internal_nodes(k, depth), progress)
    node = np.zeros(n, np.int64)  # every row's node at the current level
    for level in range(depth):
        order = np.argsort(node, kind="stable")
        bounds = np.searchsorted(node[order], np.arange(k ** level + 1))
        base = level_offset(level, k)
        for nd in range(k ** level):
            members = order[bounds[nd]:bounds[nd + 1]]
            rng = np.random.default_rng([seed, level, nd])
            if len(members):
                c = balanced_kmeans(x[members], k, steps, samples, balance_factor, rng)
            else:
                c = _empty_node(tree, level, nd)
            tree.centroids[base + nd] = c
            if bar is not None:
                bar.update(1)
        tree._update_norms(base, base + k ** level)
        node = node * k + tree.descend(x64, level, node)
    if bar is not None:
        bar.close()
    return tree


def _empty_node(tree: ClusterTree, level: int, nd: int) -> np.ndarray:
    """Centroids of a node no training row reached: k copies of the node's own centroid in its parent.

    A query that still reaches it (it is a reachable Voronoi cell, just empty in the training data)
    goes to child 0, since ties resolve to the lowest index; children 1..k-1 stay unreachable."""
    k = tree.branching
    parent_row = level_offset(level - 1, k) + nd // k
    return np.repeat(tree.centroids[parent_row, nd % k][None], k, axis=0)


def balanced_kmeans(x: np.ndarray, k: int, steps: int, samples: int, balance_factor: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Split one node's unit-norm members ``x [m, dim]`` into ``k`` centroids (Appendix C).

    k-means++ initialisation, then ``steps`` EM steps, each on a fresh sample of ``samples`` members:
    without replacement when the node has at least that many, else with replacement (so every step
    weighs the same number of assignments). Each E step is balanced by :func:`balance`; the M step
    takes centroids as the means of the balanced assignment, and an empty cluster is re-seeded at a
    random sampled member.

    A node with fewer members than ``k`` (deep nodes of a small corpus) is not clustered: its members
    become the first centroids and the remaining ones repeat them (``centroid j = x[j % m]``). Every
    member then lands in its own child, and the duplicate children are never chosen by the descent
    (ties go to the lowest index), so they stay empty leaves whose memories are simply never used.
    """
    m = len(x)
    if m < k:
        return x[np.arange(k) % m].astype(np.float32)
    replace = m < samples

    def draw() -> np.ndarray:
        return rng.choice(m, size=samples, replace=True) if replace else rng.choice(m, size=samples, replace=False)

    x64 = x.astype(np.float64) if replace else None  # converted once; the M step reuses it
    first = draw()
    if replace:
        c = kmeans_plus_plus(x, k, rng, weights=np.bincount(first, minlength=m))
    else:
        c = kmeans_plus_plus(x[first], k, rng)
    for _ in range(steps):
        idx = draw()
        if replace:
            # distances once per member, not once per repeated slot
            labels = nearest(x, c)[idx]
        else:
            labels = nearest(x[idx], c)
        labels = balance(labels, k, balance_factor, rng)
        counts = np.bincount(labels, minlength=k)
        # sums of the assigned vectors as (assignment-count matrix) @ vectors
        if replace:
            w = np.bincount(labels * m + idx, minlength=k * m).reshape(k, m)  # m < samples: small
            sums = w.astype(np.float64) @ x64
        else:
            w = np.zeros((k, samples), np.float64)
            w[labels, np.arange(samples)] = 1.0
            sums = w @ x[idx].astype(np.float64)
        c = (sums / np.maximum(counts, 1)[:, None]).astype(np.float32)
        empty = np.flatnonzero(counts == 0)
        if len(empty):
            c[empty] = x[idx[rng.integers(0, len(idx), size=len(empty))]]
    return c


def kmeans_plus_plus(x: np.ndarray, k: int, rng: np.random.Generator,
                     weights: Optional[np.ndarray] = None) -> np.ndarray:
    """k-means++ seeding (Arthur & Vassilvitskii, 2006): each new centroid is drawn with probability
    proportional to (weight times) the squared distance to the closest centroid so far. ``weights``
    counts how often each row was sampled, so a sample drawn with replacement is seeded from its
    distinct rows at the same cost as without duplicates."""
    w = np.ones(len(x)) if weights is None else np.asarray(weights, np.float64)
    sq = np.einsum("nd,nd->n", x, x, dtype=np.float64)
    c = np.empty((k, x.shape[1]), np.float32)

    def d2_to(j: int) -> np.ndarray:
        return np.maximum(sq - 2.0 * (x @ c[j]).astype(np.float64) + float(c[j] @ c[j]), 0.0)

    c[0] = x[rng.choice(len(x), p=w / w.sum())]
    d2 = d2_to(0)
    for j in range(1, k):
        p = w * d2
        total = p.sum()
        # every sampled row coincides with a chosen centroid: any of them is as good
        c[j] = x[rng.choice(len(x), p=p / total) if total > 0 else rng.choice(len(x), p=w / w.sum())]
        d2 = np.minimum(d2, d2_to(j))
    return c


def nearest(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Index of the closest centroid (L2) for every row; at k=16 a matrix product beats an index."""
    dist = np.einsum("kd,kd->k", c, c)[None, :] - 2.0 * (x @ c.T)
    return np.argmin(dist, axis=1)


def balance(labels: np.ndarray, k: int, balance_factor: float, rng: np.random.Generator) -> np.ndarray:
    """Jegou et al. (2010) balancing of one assignment step (Appendix C).

    While some cluster holds more than ``balance_factor / k`` of the assignments, the largest one
    hands a random half of its assignments to the currently smallest cluster. A move is made only
    while it makes the counts strictly more even (smallest count < half the largest, i.e. the sum of
    squared counts falls), which guarantees termination; with balance_factor >= 1 the loop stops
    above the limit only in rare near-balanced states.
    """
    labels = labels.copy()
    limit = balance_factor * len(labels) / k
    counts = np.bincount(labels, minlength=k)
    while True:
        big, small = int(np.argmax(counts)), int(np.argmin(counts))
        half = counts[big] // 2
        if counts[big] <= limit or half == 0 or counts[small] >= counts[big] - half:
            return labels
        members = np.flatnonzero(labels == big)
        moved = rng.choice(members, size=half, replace=False)
        labels[moved] = small
        counts[big] -= half
        counts[small] += half


def balance_report(ids: np.ndarray, branching: int) -> dict[str, list]:
    """How even a split is: per level, the largest cluster's share of its parent's assignments
    (``max_cluster_fraction``; level 1's parent is the root, i.e. all rows) and the number of
    non-empty clusters (``clusters_per_level``)."""
    ids = np.asarray(ids, np.int64)
    n, depth = ids.shape
    fractions: list[float] = []
    nonempty: list[int] = []
    for level in range(depth):
        counts = np.bincount(ids[:, level], minlength=branching ** (level + 1))
        if level == 0:
            parent = np.full_like(counts, n)
        else:
            parent = np.repeat(np.bincount(ids[:, level - 1], minlength=branching ** level), branching)
        fractions.append(float(np.max(counts / np.maximum(parent, 1))) if n else 0.0)
        nonempty.append(int(np.count_nonzero(counts)))
    return {"max_cluster_fraction": fractions, "clusters_per_level": nonempty}


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="training cluster tree", unit="node")


__all__ = ["ClusterTree", "balance", "balance_report", "balanced_kmeans", "check_enough", "kmeans_plus_plus",
           "level_offset", "nearest", "normalize", "num_internal_nodes", "train_tree"]
