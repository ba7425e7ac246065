"""Tests of document embeddings and the hierarchical balanced k-means tree (CPU, fast).

Paper: hierarchical-memories, Section 2.1 (greedy descent, nested cluster ids) and Appendix C
(window embeddings, root-to-leaf training, k-means++ / sampled EM / balancing).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from memtrain.data.cluster import (ClusterTree, balance, balance_report, balanced_kmeans, check_enough, level_offset,
                                   train_tree)
from memtrain.errors import DataError

# ------------------------------------------------------------------------------------------------
# synthetic data


def skewed(n: int, dim: int = 16, blob_fraction: float = 0.9, seed: int = 0) -> np.ndarray:
    """``blob_fraction`` of the points in one tight blob, the rest around 9 other centres: plain
    k-means gives the blob's few clusters far more than 1/k of the points."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(10, dim))
    nb = int(blob_fraction * n)
    blob = centres[0] + 0.02 * rng.normal(size=(nb, dim))
    rest = centres[1 + rng.integers(0, 9, n - nb)] + 0.3 * rng.normal(size=(n - nb, dim))
    return np.concatenate([blob, rest]).astype(np.float32)


def child_fractions(ids: np.ndarray, level: int, branching: int) -> list[tuple[int, float]]:
    """For every node at ``level`` (0 = root): (its member count, its largest child's share)."""
    parent = ids[:, level - 1] if level else np.zeros(len(ids), np.int64)
    out = []
    for node in np.unique(parent):
        children = ids[parent == node, level]
        out.append((len(children), np.bincount(children).max() / len(children)))
    return out


# ------------------------------------------------------------------------------------------------
# balancing


def test_balance_step_enforces_the_limit_on_the_sample():
    # One assignment step of 6,400 samples (the paper's size) with 70% in cluster 3 and two empties.
    k, bf = 16, 1.5
    rng = np.random.default_rng(0)
    labels = np.where(rng.random(6400) < 0.7, 3, rng.integers(0, 14, 6400))
    out = balance(labels, k, bf, np.random.default_rng(1))
    counts = np.bincount(out, minlength=k)
    assert counts.max() <= bf * len(labels) / k
    assert counts.sum() == len(labels) and (counts > 0).all()
    # the overfull cluster gave at least its excess away and kept some of its assignments
    assert 0 < (out[labels == 3] == 3).sum() <= bf * len(labels) / k
    assert (out != labels).sum() >= (labels == 3).sum() - bf * len(labels) / k
    # seeded
    assert np.array_equal(out, balance(labels, k, bf, np.random.default_rng(1)))
    # an already balanced step is left alone
    even = np.arange(6400) % k
    assert np.array_equal(balance(even, k, bf, rng), even)


def test_balancing_limit_holds_after_training_on_skewed_data():
    k, bf, samples = 16, 1.5, 2000
    limit = bf / k
    x = skewed(12_000)
    tree = train_tree(x, k, 2, steps=20, samples=samples, balance_factor=bf, seed=0, progress=False)
    ids = tree.assign(x)

    def tolerance(members: int) -> float:
        # The limit is enforced on each step's balanced sample; the split we check is the greedy
        # nearest-centroid assignment of all members with the final centroids. A cluster's share
        # estimated from min(members, samples) draws has binomial noise sqrt(f(1-f)/s); allow 3 sigma.
        return 3 * math.sqrt(limit * (1 - limit) / min(members, samples))

    (root_members, root_share), = child_fractions(ids, 0, k)
    assert root_share <= limit + tolerance(root_members), root_share  # limit + 0.020
    checked = 0
    for members, share in child_fractions(ids, 1, k):
        if members >= 400:  # smaller nodes' shares are dominated by sampling noise
            assert share <= limit + tolerance(members), (members, share)
            checked += 1
    assert checked >= 8

    # The same data without balancing breaks the limit at the root by far, so the check above is
    # not vacuous: plain k-means gives the blob a few huge clusters.
    plain = train_tree(x, k, 1, steps=20, samples=samples, balance_factor=1e9, seed=0, progress=False)
    (_, plain_share), = child_fractions(plain.assign(x), 0, k)
    assert plain_share > limit + 2 * tolerance(len(x)), plain_share


def test_balance_report():
    k = 2
    ids = ClusterTree.levels_from_leaf(np.array([0, 0, 0, 1, 2, 3, 3, 3]), k, 2)
    report = balance_report(ids, k)
    # level 1: clusters 0 and 1 hold 4 of 8 each; level 2: leaf 0 holds 3 of its parent's 4, leaf 3 holds 3 of 4
    assert report["max_cluster_fraction"] == [0.5, 0.75]
    assert report["clusters_per_level"] == [2, 4]
    report = balance_report(ClusterTree.levels_from_leaf(np.array([0, 1, 1, 1]), k, 2), k)
    assert report["max_cluster_fraction"] == [1.0, 0.75] and report["clusters_per_level"] == [1, 2]


# ------------------------------------------------------------------------------------------------
# greedy descent


@pytest.fixture(scope="module")
def small_tree() -> ClusterTree:
    x = np.random.default_rng(1).normal(size=(600, 8)).astype(np.float32)
    return train_tree(x, 4, 3, steps=5, samples=300, seed=0, progress=False)


def test_assign_matches_brute_force_and_ids_nest(small_tree: ClusterTree):
    k, p = small_tree.branching, small_tree.depth
    q = np.random.default_rng(2).normal(size=(400, 8)).astype(np.float32) * 3.0  # not normalised on purpose
    ids = small_tree.assign(q)
    assert ids.shape == (400, p) and ids.dtype == np.int64
    assert np.array_equal(ids, small_tree.assign_brute_force(q))
    for level in range(p):
        assert ((ids[:, level] >= 0) & (ids[:, level] < k ** (level + 1))).all()
        if level:
            assert np.array_equal(ids[:, level] // k, ids[:, level - 1])
    assert np.array_equal(ClusterTree.levels_from_leaf(ClusterTree.leaf_ids(ids), k, p), ids)
    # the descent really follows the tree: several leaves are used, and scaling a vector changes nothing
    assert len(np.unique(ids[:, -1])) > k
    assert np.array_equal(small_tree.assign(q * 0.01), ids)


def test_assign_uses_each_nodes_own_centroids(small_tree: ClusterTree):
    # Move the centroids of child 0 of the root far away: nothing may descend into subtree 0 any more,
    # and the level-2 choice of the others must not change (only their own node's centroids matter).
    q = np.random.default_rng(3).normal(size=(300, 8)).astype(np.float32)
    before = small_tree.assign(q)
    c = small_tree.centroids.copy()
    c[0, 0] = -100.0
    moved = ClusterTree(small_tree.branching, small_tree.depth, small_tree.dim, c)
    after = moved.assign(q)
    assert (after[:, 0] != 0).all()
    keep = before[:, 0] != 0
    assert np.array_equal(after[keep], before[keep])
    assert np.array_equal(after, moved.assign_brute_force(q))


def test_level_layout():
    assert [level_offset(l, 16) for l in range(5)] == [0, 1, 17, 273, 4369]
    tree = train_tree(np.eye(6, dtype=np.float32), 2, 3, steps=2, samples=8, progress=False)
    assert tree.centroids.shape == (1 + 2 + 4, 2, 6)


# ------------------------------------------------------------------------------------------------
# training: determinism and tiny nodes


def test_training_is_deterministic_given_the_seed():
    x = skewed(3000, seed=3)
    a = train_tree(x, 4, 2, steps=5, samples=500, seed=7, progress=False)
    b = train_tree(x, 4, 2, steps=5, samples=500, seed=7, progress=False)
    c = train_tree(x, 4, 2, steps=5, samples=500, seed=8, progress=False)
    assert np.array_equal(a.centroids, b.centroids)
    assert not np.array_equal(a.centroids, c.centroids)


def test_tiny_nodes_and_too_few_documents():
    # 5 points into k=4, depth 3: the deep nodes have fewer members than k
    x = np.random.default_rng(4).normal(size=(5, 6)).astype(np.float32)
    tree = train_tree(x, 4, 3, steps=3, samples=64, seed=0, progress=False)
    ids = tree.assign(x)
    assert np.array_equal(ids, tree.assign_brute_force(x))
    # every point ends in its own leaf; a node with m < k members keeps one member per child
    assert len(np.unique(ids[:, -1])) == 5
    assert np.isfinite(tree.centroids).all()
    # a node with fewer members than k: its members are its first centroids, repeated after that
    m = np.random.default_rng(5).normal(size=(3, 6)).astype(np.float32)
    c = balanced_kmeans(m, 4, 5, 100, 1.5, np.random.default_rng(0))
    assert np.array_equal(c, m[[0, 1, 2, 0]])

    with pytest.raises(DataError, match=r"corpus has 3 documents, fewer than data.clustering.branching 4"):
        check_enough(3, 4)
    check_enough(4, 4)
    with pytest.raises(DataError, match="no embeddings"):
        train_tree(np.zeros((0, 6), np.float32), 4, 2, progress=False)


# ------------------------------------------------------------------------------------------------
# files


def test_save_load_roundtrip_and_mismatches(small_tree: ClusterTree, tmp_path: Path):
    small_tree.embedding_model = "all-MiniLM-L6-v2"
    path = tmp_path / "tree.safetensors"
    small_tree.save(path)
    loaded = ClusterTree.load(path, expect_branching=4, expect_depth=3, expect_dim=8)
    assert np.array_equal(loaded.centroids, small_tree.centroids)
    assert (loaded.branching, loaded.depth, loaded.dim, loaded.embedding_model, loaded.seed) == (4, 3, 8,
                                                                                                "all-MiniLM-L6-v2", 0)
    q = np.random.default_rng(6).normal(size=(50, 8))
    assert np.array_equal(loaded.assign(q), small_tree.assign(q))

    with pytest.raises(DataError, match=r"has depth 3 but data.clustering.depth is 4"):
        ClusterTree.load(path, expect_depth=4)
    with pytest.raises(DataError, match=r"has branching 4 but data.clustering.branching is 16"):
        ClusterTree.load(path, expect_branching=16)
    with pytest.raises(DataError, match="8-dimensional"):
        ClusterTree.load(path, expect_dim=384)

    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DataError, match="unreadable or corrupt"):
        ClusterTree.load(corrupt)
    with pytest.raises(DataError, match="does not exist"):
        ClusterTree.load(tmp_path / "missing.safetensors")

    from safetensors.numpy import save_file

    other = tmp_path / "other.safetensors"
    save_file({"centroids": np.zeros((1, 2, 3), np.float32)}, str(other), metadata={"format": "something-else"})
    with pytest.raises(DataError, match="not a memtrain cluster tree"):
        ClusterTree.load(other)
    newer = tmp_path / "newer.safetensors"
    save_file({"centroids": np.zeros((1, 2, 3), np.float32)}, str(newer),
              metadata={"format": "memtrain-cluster-tree", "version": "99", "branching": "2", "depth": "1",
                        "dim": "3"})
    with pytest.raises(DataError, match="version 99"):
        ClusterTree.load(newer)
    for bad in ("{not json", "[1, 2]"):
        broken = tmp_path / "broken.safetensors"
        save_file({"centroids": np.zeros((1, 2, 3), np.float32)}, str(broken), metadata={"memtrain-cluster-tree": bad})
        with pytest.raises(DataError, match="malformed metadata"):
            ClusterTree.load(broken)


def test_tree_files_are_equal_for_equal_trees(tmp_path, small_tree):
    """safetensors writes its metadata map in a random order per save (its issue #584), which made two
    prepares of one recipe write different tree files with the same centroids; the metadata is one key now."""
    files = set()
    for i in range(6):
        small_tree.save(tmp_path / f"{i}.safetensors")
        files.add((tmp_path / f"{i}.safetensors").read_bytes())
    assert len(files) == 1


def test_version_1_tree_files_still_load(tmp_path, small_tree):
    """Folders prepared before version 2 hold trees with one metadata key per field."""
    from safetensors.numpy import save_file

    path = tmp_path / "v1.safetensors"
    save_file({"centroids": small_tree.centroids}, str(path),
              metadata={"format": "memtrain-cluster-tree", "version": "1", "branching": "4", "depth": "3",
                        "dim": "8", "embedding_model": "all-MiniLM-L6-v2", "seed": "0"})
    loaded = ClusterTree.load(path, expect_branching=4, expect_depth=3, expect_dim=8)
    assert np.array_equal(loaded.centroids, small_tree.centroids)
    assert (loaded.branching, loaded.depth, loaded.dim, loaded.embedding_model, loaded.seed) == (
        4, 3, 8, "all-MiniLM-L6-v2", 0)


# ------------------------------------------------------------------------------------------------
# embeddings


class WordTokenizer:
    """A stub tokenizer: one id per whitespace-separated word, decode joins with spaces."""

    vocab_size = 10_000
    eot_id = 0

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = ["<eot>"]

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


@pytest.fixture(scope="module")
def embedder():
    from memtrain.data.embed import load_embedder

    return load_embedder("all-MiniLM-L6-v2", device="cpu")


def test_document_windows():
    from memtrain.data.embed import document_windows

    assert document_windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert document_windows(list(range(8)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert document_windows([], 4) == []


def test_packaged_model_loads_offline_and_embeds(embedder):
    from memtrain.data.embed import embed_texts

    texts = ["The cat sat on the mat.", "A kitten was sitting on the rug.",
             "Quarterly interest rates rose at the central bank."]
    e = embed_texts(texts, embedder, batch_size=2)
    assert e.shape == (3, 384) and e.dtype == np.float32
    assert np.allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    assert e[0] @ e[1] > e[0] @ e[2] + 0.2  # similar texts are much closer than unrelated ones


def test_unknown_embedding_model_is_a_data_error(tmp_path: Path):
    from memtrain.data.embed import load_embedder

    with pytest.raises(DataError, match="not a local folder"):
        load_embedder("some-org/some-model-that-is-not-here")
    with pytest.raises(DataError, match="no sentence-transformers model"):
        load_embedder(str(tmp_path))


def test_document_embedding_is_the_normalised_mean_of_its_windows(embedder):
    from memtrain.data.embed import embed_documents, embed_texts, embed_windows

    tok = WordTokenizer()
    long_doc = ("iron is a metal with atomic number twenty six and it rusts in moist air "
                "while gold does not")  # 20 words = 2.5 windows of 8
    docs = [long_doc, "", "copper conducts electricity well"]
    win, owner = embed_windows(docs, tok, 8, embedder, batch_size=4, progress=False)
    assert win.shape == (4, 384) and owner.tolist() == [0, 0, 0, 2]  # 3 windows, none for the empty doc
    words = long_doc.split()
    expected = embed_texts([" ".join(words[0:8]), " ".join(words[8:16]), " ".join(words[16:20])], embedder)
    assert np.allclose(win[:3], expected, atol=1e-5)

    doc_emb, win2, owner2 = embed_documents(docs, tok, 8, embedder, batch_size=4, progress=False,
                                            return_windows=True)
    mean = win[:3].mean(axis=0)
    assert doc_emb.shape == (3, 384)
    assert np.allclose(doc_emb[0], mean / np.linalg.norm(mean), atol=1e-5)
    assert not np.allclose(doc_emb[0], win[0], atol=1e-3)  # really a mean, not the first window
    assert np.allclose(doc_emb[2], win[3], atol=1e-5)  # one window: the mean is that window
    assert np.allclose(doc_emb[1], embed_texts([""], embedder)[0], atol=1e-5)  # empty doc: embedding of ""
    assert np.array_equal(win2, win) and np.array_equal(owner2, owner)
    assert np.allclose(embed_documents(docs, tok, 8, embedder, 4, progress=False), doc_emb)


# ------------------------------------------------------------------------------------------------
# the balanced final assignment


def allowed(n: int, k: int, bf: float) -> int:
    """Most members one child of an n-member node may hold: the limit in whole members, or ceil(n/k)
    where k children at the limit could not hold all n (computed here without the library)."""
    return max(math.floor(bf * n / k), math.ceil(n / k))


def nodes_of(ids: np.ndarray, level: int, k: int):
    """(parent node, member rows, their children 0..k-1) for every non-empty node at ``level``."""
    parent = ids[:, level - 1] if level else np.zeros(len(ids), np.int64)
    for node in np.unique(parent):
        rows = np.flatnonzero(parent == node)
        yield int(node), rows, ids[rows, level] - node * k


def thread_ranks(world: int):
    """``world`` threads standing in for prepare ranks: reducer(r) sums an int64 array over them."""
    import threading

    barrier = threading.Barrier(world)
    slots: list = [None] * world

    def reducer(r: int):
        def allreduce(a: np.ndarray) -> np.ndarray:
            slots[r] = np.asarray(a, np.int64).copy()
            barrier.wait()
            out = np.sum(slots, axis=0)
            barrier.wait()  # nobody overwrites a slot before everyone has summed
            return out
        return allreduce

    return reducer


@pytest.fixture(scope="module")
def overloaded():
    """A tree trained without balancing on data with 90% of the points in one blob (plus exact
    duplicates, so that distances tie): greedy descent overloads one child at several levels."""
    x = skewed(3000, seed=5)
    x[::7] = x[3]  # 429 identical points
    tree = train_tree(x, 4, 3, steps=5, samples=600, balance_factor=1e9, seed=0, progress=False)
    return tree, x


def test_capacity_is_the_limit_in_whole_members():
    from memtrain.data.cluster import capacity

    n = np.array([0, 1, 4, 5, 6, 8, 13, 100, 1000])
    assert capacity(n, 4, 1.5).tolist() == [allowed(int(m), 4, 1.5) for m in n] == [0, 1, 1, 2, 2, 3, 4, 37, 375]
    assert capacity(np.array([1000]), 16, 1.5).tolist() == [93]  # 1.5 / 16 = 0.09375 of 1000
    assert capacity(np.array([10]), 4, 4.0).tolist() == [10]  # balance_factor k: no limit


def test_balanced_assignment_respects_the_limit_at_every_node(overloaded):
    tree, x = overloaded
    k, p, bf = 4, 3, 1.5
    greedy = tree.assign(x)
    ids = tree.assign_balanced(x, bf)
    assert ids.shape == (len(x), p) and ids.dtype == np.int64
    for level in range(1, p):
        assert np.array_equal(ids[:, level] // k, ids[:, level - 1])  # ids nest as the greedy ones do
    # The greedy descent breaks the limit badly, so the checks below have teeth.
    assert balance_report(greedy, k)["max_cluster_fraction"][0] > 0.8
    assert sum(max(np.bincount(ch, minlength=k)) > allowed(len(rows), k, bf)
               for level in range(p) for _, rows, ch in nodes_of(greedy, level, k)) >= 3

    checked = 0
    for level in range(p):
        for _, rows, children in nodes_of(ids, level, k):
            counts = np.bincount(children, minlength=k)
            n = len(rows)
            assert counts.max() <= allowed(n, k, bf), (level, n, counts)
            if k * math.floor(bf * n / k) >= n:  # big enough for the limit itself: exactly within it
                assert counts.max() / n <= bf / k + 1e-12, (level, n, counts)
                checked += 1
    assert checked >= 1 + 4 + 8
    shares = balance_report(ids, k)["max_cluster_fraction"]
    assert shares[0] == 1125 / 3000 == bf / k and max(shares) <= bf / k  # the overloaded root child: at its cap
    # deterministic
    assert np.array_equal(tree.assign_balanced(x, bf), ids)
    # the ids depend on the rows' positions (the tie-break), not on their order in the array
    perm = np.random.default_rng(0).permutation(len(x))
    again = np.empty_like(ids)
    again[perm] = tree.assign_balanced(x[perm], bf, positions=perm)
    assert np.array_equal(again, ids)


def test_balanced_assignment_keeps_greedy_choices_and_the_closest_members(overloaded):
    """Round 0 is the greedy descent: inside a node, a child whose greedy proposers fit keeps them
    all; a child that overflows keeps exactly its cap, its closest proposers (ties by position)."""
    tree, x = overloaded
    k, bf = 4, 1.5
    ids = tree.assign_balanced(x, bf)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    overflowing = fitting = 0
    for level in range(tree.depth):
        for node, rows, children in nodes_of(ids, level, k):
            d = np.array([[np.sum((xn[i].astype(np.float64) - tree.centroids[level_offset(level, k) + node, j]) ** 2)
                           for j in range(k)] for i in rows])
            first = d.argmin(axis=1)
            cap = allowed(len(rows), k, bf)
            for j in range(k):
                proposers = rows[first == j]
                kept = proposers[children[first == j] == j]
                if len(proposers) <= cap:
                    assert len(kept) == len(proposers)  # nobody moved from a child with room
                    fitting += 1
                else:
                    assert len(kept) == cap
                    kd = d[np.isin(rows, kept), j]
                    gone = d[np.isin(rows, proposers) & ~np.isin(rows, kept), j]
                    assert kd.max() <= gone.min() + 1e-9  # the closest stayed
                    overflowing += 1
    assert overflowing >= 3 and fitting >= 10
    # moved members go to a child no closer than their first choice
    greedy = tree.assign(x)
    moved = ids[:, 0] != greedy[:, 0]
    assert 0 < moved.mean() < 0.8


def test_balanced_assignment_equals_greedy_on_balanced_data():
    # Four level-1 centroids along the axes, four children each along further axes; 20 points at each
    # leaf: every child holds 1/4 of its parent, within 1.5/4, so nothing may move.
    k, dim = 4, 20
    eye = np.eye(dim, dtype=np.float32)
    c = np.zeros((1 + k, k, dim), np.float32)
    c[0] = eye[:k]
    for i in range(k):
        c[1 + i] = eye[i] + eye[k + 4 * i: k + 4 * i + 4]
    tree = ClusterTree(k, 2, dim, c)
    rng = np.random.default_rng(0)
    x = np.repeat(c[1:].reshape(-1, dim), 20, axis=0) + 0.01 * rng.normal(size=(16 * 20, dim)).astype(np.float32)
    x = x[rng.permutation(len(x))]
    greedy = tree.assign(x)
    assert (np.bincount(greedy[:, 1], minlength=16) == 20).all()
    assert np.array_equal(tree.assign_balanced(x, 1.5), greedy)
    # a factor of k is no limit at all: greedy everywhere, even on the overloaded data
    skew = skewed(500, dim=dim, seed=1)
    assert np.array_equal(tree.assign_balanced(skew, float(k)), tree.assign(skew))
    assert not np.array_equal(tree.assign_balanced(skew, 1.5), tree.assign(skew))

    with pytest.raises(ValueError, match=r"balance_factor must be >= 1, got 0.5"):
        tree.assign_balanced(x, 0.5)
    with pytest.raises(ValueError, match=r"positions must be unique"):
        tree.assign_balanced(x[:3], 1.5, positions=np.array([0, 1, 1]))
    with pytest.raises(ValueError, match=r"positions has shape \(2,\), expected \(3,\)"):
        tree.assign_balanced(x[:3], 1.5, positions=np.array([0, 1]))
    with pytest.raises(ValueError, match=r"positions must be >= 0"):
        tree.assign_balanced(x[:3], 1.5, positions=np.array([0, -1, 2]))


@pytest.mark.parametrize("world", [2, 3])
def test_balanced_assignment_is_the_same_on_any_number_of_ranks(overloaded, world):
    """Distributed prepare: rank r holds rows r, r+W, ... with those positions and sums counts over
    the ranks; the ids equal the single process's, so the limit holds over all ranks together. The
    429 identical points tie at the selection threshold: the position bisection decides them."""
    import threading

    tree, x = overloaded
    single = tree.assign_balanced(x, 1.5)
    reducer = thread_ranks(world)
    got: list = [None] * world
    errors: list = []

    def rank(r: int) -> None:
        try:
            rows = np.arange(r, len(x), world)
            got[r] = tree.assign_balanced(x[rows], 1.5, positions=rows, allreduce=reducer(r))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    merged = np.empty_like(single)
    for r in range(world):
        merged[r::world] = got[r]
    assert np.array_equal(merged, single)
    # balancing each rank's share on its own would not give this (the selection really is global)
    alone = np.empty_like(single)
    for r in range(world):
        alone[r::world] = tree.assign_balanced(x[r::world], 1.5, positions=np.arange(r, len(x), world))
    assert not np.array_equal(alone, single)


def test_a_rank_without_documents_takes_part():
    import threading

    tree = train_tree(skewed(400, seed=2), 4, 2, steps=3, samples=200, balance_factor=1e9, progress=False)
    x = skewed(400, seed=2)
    single = tree.assign_balanced(x, 1.5)
    reducer = thread_ranks(2)
    got: list = [None, None]
    parts = [np.arange(len(x)), np.zeros(0, np.int64)]

    def rank(r: int) -> None:
        got[r] = tree.assign_balanced(x[parts[r]], 1.5, positions=parts[r], allreduce=reducer(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert np.array_equal(got[0], single) and got[1].shape == (0, 2)
