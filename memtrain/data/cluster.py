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

Final assignment (:meth:`ClusterTree.assign_balanced`): the training documents of ``memtrain prepare``
are assigned with the same limit. The greedy descent alone lets one child of a node take far more
than ``balance_factor / k`` of the node's members (the limit is enforced on EM samples during training,
not on the final split), so at every level each node's members are spread by a capacity-constrained
descent: every child holds at most ``capacity(n) = max(floor(balance_factor * n / k), ceil(n / k))`` of
its parent's ``n`` members. Members propose to their children in order of distance (closest first);
a child that receives more proposals than it has room keeps the closest proposers (ties by position)
and turns the rest away to their next-closest child; a child that is full stays full. It is exact,
deterministic, and identical to the greedy descent wherever no child overflows. With several prepare
ranks, the counts are summed over ranks and the closest proposers are selected globally (a bisection
over the distances, one all-reduce per bisection step), so the ids do not depend on the number of ranks.
Retrieval (probes, prompts, validation documents) keeps the plain greedy descent of
:meth:`ClusterTree.assign`: balancing shapes the training data's distribution, it is not a retrieval rule.

Cluster ids are global per level: ``ids[:, l]`` is in ``[0, k^(l+1))`` and the children of cluster
``c`` at one level are ``c*k .. c*k + k-1`` at the next, so ``ids[:, l] // k == ids[:, l-1]``. The
tree's internal nodes are stored level-major: node ``n`` of level ``l`` (the root is node 0 of level
0) holds the ``k`` centroids of its children, which are the level-``l+1`` nodes ``n*k + j``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from memtrain.errors import DataError

FORMAT = "memtrain-cluster-tree"
# 2: the metadata is one JSON string under the key FORMAT, so equal trees are equal files. safetensors writes
# its metadata map in a random order per save (safetensors issue #584, seen with 0.8.0: two prepares of one
# recipe gave the same centroids in different files); one key has one order. 1: one metadata key per field
# (still read).
VERSION = 2
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

    def _chunk_distances(self, x: np.ndarray, level: int, node: np.ndarray, s: int) -> np.ndarray:
        # ||x - c||^2 - ||x||^2 for rows s..s+chunk: ||x||^2 is the same for every child of a row, so
        # it changes neither the argmin nor the order of a row's children
        rows = node[s:s + _ASSIGN_CHUNK] + level_offset(level, self.branching)
        c = self.centroids[rows].astype(np.float64)  # [chunk, k, dim]
        return self._sq[rows] - 2.0 * np.einsum("nkd,nd->nk", c, x[s:s + _ASSIGN_CHUNK])

    def descend(self, x: np.ndarray, level: int, node: np.ndarray) -> np.ndarray:
        """One greedy step: for unit-norm float64 rows ``x`` sitting at level-``level`` nodes
        ``node``, the index (0..k-1) of the closest child centroid (ties -> lowest index)."""
        out = np.empty(len(x), np.int64)
        for s in range(0, len(x), _ASSIGN_CHUNK):
            out[s:s + _ASSIGN_CHUNK] = np.argmin(self._chunk_distances(x, level, node, s), axis=1)
        return out

    def distances(self, x: np.ndarray, level: int, node: np.ndarray) -> np.ndarray:
        """``[n, k]`` float64: the squared L2 distance of every unit-norm row ``x`` to each child
        centroid of its level-``level`` node, minus ``||x||^2`` (the numbers :meth:`descend` takes the
        argmin of)."""
        out = np.empty((len(x), self.branching), np.float64)
        for s in range(0, len(x), _ASSIGN_CHUNK):
            out[s:s + _ASSIGN_CHUNK] = self._chunk_distances(x, level, node, s)
        return out

    def assign(self, x: np.ndarray) -> np.ndarray:
        """Greedy descent (Section 2.1) of every row of ``x [n, dim]`` after L2 normalisation; returns
        the global cluster id at every level, ``[n, depth]`` int64.

        This is the retrieval rule: a prompt, a probe or a validation document goes to its closest
        child at every level, whatever the load of the clusters (memtrain.eval.hierarchical's
        ``retrieve_probe_ids`` and ``memtrain prepare``'s validation split use it). Training documents
        are assigned by :meth:`assign_balanced`."""
        x = self._check(x)
        ids = np.empty((len(x), self.depth), np.int64)
        node = np.zeros(len(x), np.int64)
        for level in range(self.depth):
            node = node * self.branching + self.descend(x, level, node)
            ids[:, level] = node
        return ids

    def assign_balanced(self, x: np.ndarray, balance_factor: float = 1.5, positions: Optional[np.ndarray] = None,
                        allreduce: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> np.ndarray:
        """Capacity-constrained descent of every row of ``x [n, dim]`` (the final assignment of the
        training documents; module docstring); returns ``[n, depth]`` int64 global ids like
        :meth:`assign`.

        At every level, among the members of each node (``n`` of them), no child receives more than
        :func:`capacity` ``(n)`` members: ``floor(balance_factor * n / k)``, i.e. at most
        ``balance_factor / k`` of its parent's members, except in nodes too small for that to place
        every member (``k * floor(balance_factor * n / k) < n``, only when ``n < (2k - 1) /
        (balance_factor - 1)``), where the cap is ``ceil(n / k)``. Rounds ``t = 0 .. k-1``: every
        member not yet placed proposes to its ``t``-th closest child (round 0 is the greedy choice); a
        child with room for all its proposers takes them all, otherwise it takes the closest ones
        (ascending distance, ties by position) up to its room and is then full. A member turned away by
        all ``k`` children would need all ``k`` to be full, i.e. ``k * cap >= n`` members placed
        without it, so every member is placed. Where no child overflows the result is exactly
        :meth:`assign`'s; members of a child that does not overflow in round 0 keep their greedy child.

        ``positions`` (unique non-negative int64, default ``0..n-1``) orders equally distant members. Distributed
        use: every rank passes its own rows, their positions in the global order, and ``allreduce``
        (sum of an int64 array over the ranks, the same calls on every rank); member counts, proposals
        and the selection of the closest proposers (:func:`_closest_distributed`) are then global, so
        every rank gets the ids the single process computes on all rows, for any number of ranks.
        """
        x = self._check(x)
        if balance_factor < 1.0:
            raise ValueError(f"balance_factor must be >= 1, got {balance_factor}")
        n, k = len(x), self.branching
        pos = np.arange(n, dtype=np.int64) if positions is None else np.asarray(positions, np.int64)
        if pos.shape != (n,):
            raise ValueError(f"positions has shape {pos.shape}, expected ({n},)")
        if allreduce is None and len(np.unique(pos)) != n:
            raise ValueError("positions must be unique")
        if n and pos.min() < 0:
            raise ValueError("positions must be >= 0")
        total = (lambda a: a) if allreduce is None else (lambda a: np.asarray(allreduce(np.asarray(a, np.int64)),
                                                                              np.int64))
        ids = np.empty((n, self.depth), np.int64)
        node = np.zeros(n, np.int64)
        for level in range(self.depth):
            members = total(np.bincount(node, minlength=k ** level))
            cap = capacity(members, k, balance_factor)
            child = _balanced_step(lambda rows, level=level, node=node: self.distances(x[rows], level, node[rows]),
                                   node, pos, cap, k, total, allreduce is not None)
            node = node * k + child
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
        """Write a safetensors file with the centroids and the tree's metadata (atomically): the same tree
        gives the same bytes (:data:`VERSION`)."""
        from safetensors.numpy import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "version": str(VERSION), "branching": str(self.branching),
                "depth": str(self.depth), "dim": str(self.dim), "embedding_model": self.embedding_model,
                "seed": str(self.seed)}
        tmp = path.with_name(path.name + ".tmp")
        save_file({"centroids": self.centroids}, str(tmp), metadata={FORMAT: json.dumps(meta, sort_keys=True)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, expect_branching: Optional[int] = None, expect_depth: Optional[int] = None,
             expect_dim: Optional[int] = None) -> "ClusterTree":
        """Read a file written by :meth:`save`; :class:`DataError` if it is missing, unreadable, or
        disagrees with the expected branching / depth / embedding dimension."""
        from safetensors import safe_open

        path = Path(path)
        # A prepared folder counts as prepared without its tree, so only --force writes the tree again.
        rebuild = "rebuild it by preparing the data again (`memtrain prepare RECIPE --force`)"
        if not path.is_file():
            raise DataError(f"cluster tree {path} does not exist; prepare the data with data.clustering.enabled: "
                            "true (`memtrain prepare RECIPE --force`)")
        try:
            with safe_open(str(path), framework="np") as f:
                meta = f.metadata() or {}
                centroids = f.get_tensor("centroids")
        except Exception as e:  # safetensors raises several types (SafetensorError, OSError, ...) on bad files
            raise DataError(f"cluster tree {path} is unreadable or corrupt ({e}); {rebuild}") from None
        if FORMAT in meta:  # version 2 and later: the fields as one JSON object
            try:
                meta = json.loads(meta[FORMAT])
            except ValueError as e:
                raise DataError(f"cluster tree {path} has malformed metadata ({e}); {rebuild}") from None
            if not isinstance(meta, dict):
                raise DataError(f"cluster tree {path} has malformed metadata (not an object); {rebuild}")
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


def capacity(members: np.ndarray, k: int, balance_factor: float) -> np.ndarray:
    """The most members one child of a node with ``members`` members may hold in the final
    assignment: ``floor(balance_factor * members / k)`` (the balancing limit in whole members), raised
    to ``ceil(members / k)`` where the limit could not place every member (``k`` times the limit below
    ``members``, which happens only in nodes of fewer than ``(2k - 1) / (balance_factor - 1)`` members:
    62 at k = 16 and 14 at k = 4 with the paper's 1.5)."""
    members = np.asarray(members, np.int64)
    limit = np.floor(balance_factor * members.astype(np.float64) / k).astype(np.int64)
    return np.maximum(limit, -(-members // k))


def _sortable(d: np.ndarray) -> np.ndarray:
    """float64 -> uint64 with the same order (finite values; -0.0 just below +0.0), so distances can
    be bisected bit by bit."""
    b = np.ascontiguousarray(d, np.float64).view(np.uint64)
    return np.where(b >> np.uint64(63), ~b, b | np.uint64(1 << 63))


def _balanced_step(dist_rows: Callable[[np.ndarray], np.ndarray], node: np.ndarray, pos: np.ndarray,
                   cap: np.ndarray, k: int, total: Callable[[np.ndarray], np.ndarray], distributed: bool) -> np.ndarray:
    """One level of :meth:`ClusterTree.assign_balanced`: the child (0..k-1) of every member, given
    ``dist_rows(rows) -> [len(rows), k]`` (the members' distances to their node's children, as
    :meth:`ClusterTree.distances`), their nodes, positions and every node's cap. ``total`` sums an
    int64 array over the ranks (identity for one process).

    Memory stays O(n) plus the members turned away in round 0: the greedy choice and its distance are
    computed chunk by chunk, the full distance rows again only for the members that need a second
    choice (a row's distances do not depend on the other rows of its chunk, which is also what makes
    every rank compute the single process's numbers)."""
    n = len(node)
    n_children = len(cap) * k
    room = np.repeat(cap, k)  # what each child (global index node * k + j) can still take
    child = np.full(n, -1, np.int64)
    first = np.empty(n, np.int64)  # the greedy choice, as descend
    first_d = np.empty(n, np.float64)
    for s in range(0, n, _ASSIGN_CHUNK):
        d = dist_rows(np.arange(s, min(n, s + _ASSIGN_CHUNK)))
        first[s:s + len(d)] = np.argmin(d, axis=1)
        first_d[s:s + len(d)] = d[np.arange(len(d)), first[s:s + len(d)]]
    todo = np.arange(n)
    dist = prefs = row = None  # distances and children by distance of the members turned away in round 0
    for t in range(k):
        if t == 0:
            c, cd = first, first_d
        else:
            if dist is None:
                dist = dist_rows(todo)
                order = np.argsort(dist, axis=1, kind="stable")
                # the other children by distance (the first choice left out by its index, not by
                # position, so a recomputed row can never send a member back to its first child)
                prefs = order[order != first[todo][:, None]].reshape(len(todo), k - 1)
                prefs = prefs.astype(np.int16 if k < 1 << 15 else np.int64)
                row = np.full(n, -1, np.int64)
                row[todo] = np.arange(len(todo))
            r = row[todo]
            c = prefs[r, t - 1].astype(np.int64)
            cd = dist[r, c]
        target = node[todo] * k + c
        demand = total(np.bincount(target, minlength=n_children))
        over = demand > room
        take = ~over[target]
        if over.any():  # the same on every rank: demand and room are global
            sel = np.flatnonzero(over[target])
            key = _sortable(cd[sel])
            if distributed:
                take[sel] = _closest_distributed(target[sel], key, pos[todo[sel]], np.flatnonzero(over), room, total)
            else:
                take[sel] = _closest_local(target[sel], key, pos[todo[sel]], room)
        placed = np.minimum(demand, room)
        room -= placed
        child[todo[take]] = c[take]
        todo = todo[~take]
        if int(demand.sum() - placed.sum()) == 0:
            break
    if (child < 0).any():  # unreachable: capacity() leaves room for every member
        raise AssertionError("balanced assignment left members unplaced")
    return child


def _closest_local(target: np.ndarray, key: np.ndarray, pos: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Which proposers each child keeps: the ``room[child]`` smallest by (key, position)."""
    order = np.lexsort((pos, key, target))
    t = target[order]
    first = np.searchsorted(t, t, side="left")
    keep = np.empty(len(order), bool)
    keep[order] = np.arange(len(order)) - first < room[t]
    return keep


def _closest_distributed(target: np.ndarray, key: np.ndarray, pos: np.ndarray, over: np.ndarray,
                         room: np.ndarray, total: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """:func:`_closest_local` when the proposers are spread over ranks: for every overflowing child
    (``over``, global indices, the same on every rank), bisect the 64-bit key for the smallest
    threshold ``u`` with at least ``room`` proposers at or below it (all ranks' counts summed), then,
    only where several proposers share the threshold key, bisect the position among those. One
    all-reduce of ``len(over)`` counts per bisection step, at most 64 + 63 steps."""
    slot = np.searchsorted(over, target)  # this rank's proposers -> index into over
    want = room[over].astype(np.int64)
    m = len(over)

    def count(mask: np.ndarray) -> np.ndarray:
        return total(np.bincount(slot[mask], minlength=m).astype(np.int64))

    lo = np.zeros(m, np.uint64)
    hi = np.full(m, np.iinfo(np.uint64).max, np.uint64)  # count(key <= hi) = demand > want
    while (lo < hi).any():  # the same on every rank: lo and hi follow global counts
        mid = lo + (hi - lo) // np.uint64(2)
        enough = count(key <= mid[slot]) >= want
        hi = np.where(enough, mid, hi)
        lo = np.where(enough, lo, mid + np.uint64(1))
    below = key < hi[slot]
    at = key == hi[slot]
    need = want - count(below)  # proposers to keep among those at the threshold key (>= 1 unless want = 0)
    if (count(at) == need).all():
        return below | at
    plo = np.zeros(m, np.int64)
    phi = np.full(m, np.iinfo(np.int64).max, np.int64)
    while (plo < phi).any():
        mid = plo + (phi - plo) // 2
        enough = count(at & (pos <= mid[slot])) >= need
        phi = np.where(enough, mid, phi)
        plo = np.where(enough, plo, mid + 1)
    return below | (at & (pos <= phi[slot]))


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


__all__ = ["ClusterTree", "balance", "balance_report", "balanced_kmeans", "capacity", "check_enough",
           "kmeans_plus_plus", "level_offset", "nearest", "normalize", "num_internal_nodes", "train_tree"]
