"""Cluster-prefixed data (hierarchical-memories paper, Section 2.1, Appendix A.2): packing by leaf
cluster, the id prefix, one stream per level-1 subtree, the loader's cluster ids, and bad input."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from memtrain.config import recipe_from_dict
from memtrain.data.builtin import builtin_documents
from memtrain.data.cluster import ClusterTree
from memtrain.data.clustered import pack_by_leaf
from memtrain.data.loader import LoaderIterator, build_loader, read_meta
from memtrain.data.prepare import prepare
from memtrain.data.shards import PackStats
from memtrain.errors import DataError

K, P, SEQ = 2, 2, 32


def make_recipe(data_dir: Path, sources: list[str], **clustering):
    return recipe_from_dict({
        "run": {"name": "clu", "seed": 3},
        "model": {"vocab_size": 512, "max_seq_len": SEQ},
        "data": {"dir": str(data_dir), "sources": sources, "seq_len": SEQ, "val_fraction": 0.05,
                 "tokenizer": {"vocab_size": 300, "model_type": "bpe"},
                 "clustering": {"enabled": True, "branching": K, "depth": P, "kmeans_samples": 256,
                                "embedding_batch_size": 64, **clustering}},
        "train": {"global_batch_tokens": 4 * SEQ, "micro_batch_size": 2, "max_steps": 10},
    })


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return builtin_documents(0)[::60]  # ~190 short documents of every kind


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, docs):
    root = tmp_path_factory.mktemp("clustered")
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    recipe = make_recipe(root / "data", [str(src)])
    report = prepare(recipe)
    return recipe, report


def test_pack_by_leaf_keeps_every_document_once_in_its_cluster():
    rng = np.random.default_rng(0)
    eot, sample_len = 1, 9
    docs = [rng.integers(2, 50, size=rng.integers(1, 12)) for _ in range(40)]
    leaves = rng.integers(0, 4, size=40)
    stats = PackStats()
    samples = pack_by_leaf(docs, leaves, eot, sample_len, "uint16", stats)
    assert all(len(s) == sample_len + 1 for s in samples)
    for leaf in range(4):
        stream = np.concatenate([s[1:] for s in samples if s[0] == leaf])
        expected = np.concatenate([np.append(docs[j], eot) for j in np.flatnonzero(leaves == leaf)])
        # The leaf's samples hold exactly its documents, in order, each once, then EOT padding.
        assert np.array_equal(stream[:len(expected)], expected)
        assert (stream[len(expected):] == eot).all() and len(stream) - len(expected) < sample_len
    assert stats.documents == 40 and stats.dropped_tokens == 0


def test_prepare_writes_prefixed_streams_per_subtree(prepared):
    recipe, report = prepared
    data_dir = recipe.data_dir
    meta = read_meta(data_dir, recipe)
    assert meta["clustering"] == {"branching": K, "depth": P, "tree": "tree.safetensors",
                                  "embedding_model": "all-MiniLM-L6-v2", "prefix": True}
    disk_report = json.loads((data_dir / "prepare_report.json").read_text())
    for key in ("branching", "depth", "documents", "sequences", "clusters_per_level", "max_cluster_fraction",
                "throughput", "documents_per_s"):
        assert key in disk_report, key
    assert disk_report["branching"] == K and disk_report["depth"] == P
    assert len(disk_report["max_cluster_fraction"]) == P
    assert disk_report["sequences"] == meta["train_samples"] + meta["val_samples"]

    from streaming import StreamingDataset

    seen = 0
    for stream in meta["streams"]["train"]:
        folder = data_dir / stream["dir"]
        assert folder.name == f"subtree-{stream['subtree']}"
        ds = StreamingDataset(local=str(folder), shuffle=False, batch_size=1)
        leaves = np.array([ds[i]["tokens"][0] for i in range(len(ds))])
        # Every sample of a stream belongs to that level-1 subtree.
        assert (leaves // K ** (P - 1) == stream["subtree"]).all()
        assert len(ds) == stream["samples"]
        seen += len(ds)
    assert seen == meta["train_samples"]


def test_prefix_is_the_cluster_of_the_documents_in_the_sequence(prepared, docs):
    """Re-embed and re-assign the documents: the tokens under each leaf prefix are exactly the tokens of
    the documents the tree assigns to that leaf."""
    recipe, _ = prepared
    meta = read_meta(recipe.data_dir, recipe)
    tree = ClusterTree.load(recipe.data_dir / "tree.safetensors", expect_branching=K, expect_depth=P)

    from streaming import StreamingDataset

    from memtrain.data.embed import embed_documents, load_embedder
    from memtrain.data.prepare import split_documents
    from memtrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(meta["tokenizer"], base=recipe.data_dir)
    train_idx, _ = split_documents(len(docs), recipe.data.val_fraction, recipe.run.seed)
    train_docs = [docs[i] for i in train_idx]
    emb = embed_documents(train_docs, tok, SEQ, load_embedder(), 64, progress=False)
    ids = tree.assign(emb)
    expected: dict[int, Counter] = {}
    for doc, leaf in zip(train_docs, ids[:, -1]):
        expected.setdefault(int(leaf), Counter()).update(tok.encode(doc) + [meta["eot_id"]])
    got: dict[int, Counter] = {}
    for stream in meta["streams"]["train"]:
        ds = StreamingDataset(local=str(recipe.data_dir / stream["dir"]), shuffle=False, batch_size=1)
        for i in range(len(ds)):
            tokens = ds[i]["tokens"]
            got.setdefault(int(tokens[0]), Counter()).update(tokens[1:].tolist())
    for leaf, counter in got.items():
        padding = counter[meta["eot_id"]] - expected[leaf][meta["eot_id"]]
        assert 0 <= padding < SEQ + 1
        counter[meta["eot_id"]] -= padding
    assert got == expected


def test_loader_yields_cluster_ids_at_every_level(prepared):
    recipe, _ = prepared
    it = LoaderIterator(build_loader(recipe, "train", 2))
    for _ in range(5):
        batch = next(it)
        ids = batch["cluster_ids"]
        assert ids.shape == (2, P)
        assert ((ids[:, 0] >= 0) & (ids[:, 0] < K)).all() and (ids[:, 1] // K == ids[:, 0]).all()
        assert np.array_equal(ids.numpy(), ClusterTree.levels_from_leaf(ids[:, -1].numpy(), K, P))
        assert batch["input_ids"].shape == (2, SEQ)


def test_tree_that_does_not_match_the_recipe_is_rejected(prepared):
    recipe, _ = prepared
    other = make_recipe(recipe.data_dir, recipe.data.sources, depth=3)
    with pytest.raises(DataError, match="depth 2 but data.clustering.depth is 3"):
        build_loader(other, "train", 2)


def test_fewer_documents_than_clusters_is_a_clear_error(tmp_path, docs):
    src = tmp_path / "few.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:3] * 20))
    recipe = make_recipe(tmp_path / "data", [str(src)], branching=64)
    with pytest.raises(DataError, match="fewer than data.clustering.branching"):
        prepare(recipe)
    assert not (tmp_path / "data").exists()
