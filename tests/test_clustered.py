"""Cluster-prefixed data (hierarchical-memories paper, Section 2.1, Appendix A.2): packing by leaf
cluster, the id prefix, one stream per level-1 subtree, the loader's cluster ids, and bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import shutil
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from memtrain.config import recipe_from_dict
from memtrain.data.builtin import builtin_documents
from memtrain.data.cluster import ClusterTree
from memtrain.data.clustered import TREE_FILE, affine_busiest_rank, balance_figures, pack_by_leaf
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

    from conftest import streaming_dataset

    seen = 0
    for stream in meta["streams"]["train"]:
        folder = data_dir / stream["dir"]
        assert folder.name == f"subtree-{stream['subtree']}"
        ds = streaming_dataset(local=str(folder), shuffle=False, batch_size=1)
        leaves = np.array([ds[i]["tokens"][0] for i in range(len(ds))])
        # Every sample of a stream belongs to that level-1 subtree.
        assert (leaves // K ** (P - 1) == stream["subtree"]).all()
        assert len(ds) == stream["samples"]
        seen += len(ds)
    assert seen == meta["train_samples"]


@pytest.fixture(scope="module")
def train_embeddings(prepared, docs):
    """The prepared training documents (in split order), their tokenizer and their embeddings, computed
    again outside prepare."""
    recipe, _ = prepared
    meta = read_meta(recipe.data_dir, recipe)
    from memtrain.data.embed import embed_documents, load_embedder
    from memtrain.data.prepare import split_documents
    from memtrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(meta["tokenizer"], base=recipe.data_dir)
    train_idx, _ = split_documents(len(docs), recipe.data.val_fraction, recipe.run.seed)
    train_docs = [docs[i] for i in train_idx]
    return train_docs, tok, embed_documents(train_docs, tok, SEQ, load_embedder(), 64, progress=False)


def test_prefix_is_the_cluster_of_the_documents_in_the_sequence(prepared, train_embeddings):
    """Re-embed and re-assign the documents: the tokens under each leaf prefix are exactly the tokens of
    the documents the tree assigns to that leaf (the balanced assignment, in split order)."""
    recipe, _ = prepared
    meta = read_meta(recipe.data_dir, recipe)
    tree = ClusterTree.load(recipe.data_dir / "tree.safetensors", expect_branching=K, expect_depth=P)

    from conftest import streaming_dataset

    train_docs, tok, emb = train_embeddings
    ids = tree.assign_balanced(emb, recipe.data.clustering.balance_factor)
    expected: dict[int, Counter] = {}
    for doc, leaf in zip(train_docs, ids[:, -1]):
        expected.setdefault(int(leaf), Counter()).update(tok.encode(doc) + [meta["eot_id"]])
    got: dict[int, Counter] = {}
    for stream in meta["streams"]["train"]:
        ds = streaming_dataset(local=str(recipe.data_dir / stream["dir"]), shuffle=False, batch_size=1)
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


def test_a_damaged_tree_names_the_fix_and_the_fix_gives_the_same_file(prepared, tmp_path):
    """A damaged tree.safetensors is one error naming `memtrain prepare RECIPE --force` (deleting the file, the old
    advice, rebuilt nothing: the folder counted as prepared; now prepare says the tree is missing), and --force
    writes the same bytes again."""
    recipe, _ = prepared
    copy = tmp_path / "data"
    shutil.copytree(recipe.data_dir, copy)
    tree = copy / TREE_FILE
    original = tree.read_bytes()
    tree.write_bytes(original[:300])
    with pytest.raises(DataError, match=r"unreadable or corrupt .*\(`memtrain prepare RECIPE --force`\)$"):
        ClusterTree.load(tree)
    tree.unlink()
    with pytest.raises(DataError, match=r"does not exist; .*`memtrain prepare RECIPE --force`"):
        ClusterTree.load(tree)
    again = make_recipe(copy, recipe.data.sources)
    with pytest.raises(DataError, match=r"but tree\.safetensors is missing from it; pass --force"):
        prepare(again)
    assert not tree.exists()
    assert prepare(again, force=True)["status"] == "prepared"
    assert tree.read_bytes() == original


def test_fewer_documents_than_clusters_is_a_clear_error(tmp_path, docs):
    src = tmp_path / "few.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:3] * 20))
    recipe = make_recipe(tmp_path / "data", [str(src)], branching=64)
    with pytest.raises(DataError, match="fewer than data.clustering.branching"):
        prepare(recipe)
    assert not (tmp_path / "data").exists()


_AFFINE_RANK = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from memtrain.config import recipe_from_dict
    from memtrain.data.loader import LoaderIterator, build_loader
    from memtrain.parallel.dist import import_group_capturers
    import_group_capturers()  # before the group starts, so that destroy_process_group frees it
    dist.init_process_group("gloo")  # as in training: a process group exists when loaders are built
    recipe = recipe_from_dict(json.loads(sys.argv[1]))
    it = LoaderIterator(build_loader(recipe, "train", 2))
    batches = [next(it) for _ in range(int(sys.argv[2]))]
    print(json.dumps({"subtrees": it.loader.memtrain_subtrees,
                      "level1": sorted({int(b["cluster_ids"][i, 0]) for b in batches for i in range(2)}),
                      "rows": [b["input_ids"].tolist() for b in batches]}))
""")


def _affine_ranks(recipe, world: int, steps: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = json.dumps(recipe.to_dict())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, "-c", _AFFINE_RANK, data, str(steps)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_affine_ranks_read_disjoint_subtrees_and_together_all(prepared):
    recipe, _ = prepared
    affine = make_recipe(recipe.data_dir, recipe.data.sources)
    affine.data.placement = "affine"
    meta = read_meta(recipe.data_dir, recipe)
    everything = sorted(s["subtree"] for s in meta["streams"]["train"])
    assert len(everything) == K
    outs = _affine_ranks(affine, world=2, steps=6)
    for out in outs:
        assert out["level1"] == out["subtrees"] and len(out["subtrees"]) == 1  # only its own subtree
    assert sorted(outs[0]["subtrees"] + outs[1]["subtrees"]) == everything


def test_affine_groups_of_ranks_split_their_subtrees_rows(prepared):
    """4 ranks on 2 subtrees: two groups of two ranks; the ranks of a group share the subtree and never
    the same sample."""
    recipe, _ = prepared
    affine = make_recipe(recipe.data_dir, recipe.data.sources)
    affine.data.placement = "affine"
    affine.train.global_batch_tokens = 8 * SEQ  # 2 per micro-batch x 4 ranks
    outs = _affine_ranks(affine, world=4, steps=4)
    assert outs[0]["subtrees"] == outs[1]["subtrees"] != outs[2]["subtrees"] == outs[3]["subtrees"]
    for a, b in ((0, 1), (2, 3)):
        rows_a = {tuple(r) for batch in outs[a]["rows"] for r in batch}
        rows_b = {tuple(r) for batch in outs[b]["rows"] for r in batch}
        assert not rows_a & rows_b


@pytest.mark.parametrize("placement", ["global", "affine"])
def test_clustered_loader_resumes_exactly(prepared, placement):
    recipe, _ = prepared
    affine = make_recipe(recipe.data_dir, recipe.data.sources)
    affine.data.placement = placement
    whole = LoaderIterator(build_loader(affine, "train", 2))
    first = [next(whole)["input_ids"].tolist() for _ in range(40)]  # crosses an epoch boundary
    part = LoaderIterator(build_loader(affine, "train", 2))
    for _ in range(17):
        next(part)
    state = json.loads(json.dumps(part.state_dict()))
    resumed = LoaderIterator(build_loader(affine, "train", 2))
    resumed.load_state_dict(state)
    assert [next(resumed)["input_ids"].tolist() for _ in range(23)] == first[17:]


@pytest.mark.slow
def test_two_rank_affine_training_resumes_exactly(prepared, tmp_path):
    """Training reads cluster-prefixed data under affine placement on 2 ranks (ZeRO-1); a run resumed
    from its step-3 checkpoint reproduces the uninterrupted losses (each rank restores its own
    position in its own subtrees)."""
    import yaml

    recipe, _ = prepared
    data = recipe.to_dict()
    data["model"].update({"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64})
    data["data"]["placement"] = "affine"
    data["run"]["dir"] = str(tmp_path / "run")
    data["train"].update({"max_steps": 6, "global_batch_tokens": 4 * SEQ, "micro_batch_size": 2,
                          "schedule": {"kind": "cosine", "warmup": 1, "min_lr": 0.0}})
    data["checkpoint"] = {"every_steps": 3, "keep_last": 3}
    data["logging"] = {"every_steps": 1, "tensorboard": False}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_"))}

    def run() -> list[float]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                              str(port), "-m", "memtrain", "train", str(tmp_path / "r.yaml"), "parallel.zero_stage=1"],
                             cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-4000:]
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        return [r["loss/train"] for r in rows]

    full = run()
    assert len(full) == 6
    (tmp_path / "run" / "checkpoints" / "global_step6" / "COMPLETE.json").unlink()
    assert run() == full


def test_clustered_streams_from_a_remote_location(prepared, tmp_path):
    recipe, _ = prepared
    local = [next(it)["cluster_ids"].tolist() for it in [LoaderIterator(build_loader(recipe, "train", 2))] * 6]
    remote = recipe_from_dict(recipe.to_dict(), [f"data.remote={recipe.data_dir}", f"run.dir={tmp_path / 'run'}"])
    it = LoaderIterator(build_loader(remote, "train", 2))
    assert [next(it)["cluster_ids"].tolist() for _ in range(6)] == local
    (cache,) = (tmp_path / "run" / "data-cache").glob("data-*")
    assert sorted(p.name for p in (cache / "train").iterdir()) == [f"subtree-{i}" for i in range(K)]


def _max_share_of_parent(ids: np.ndarray) -> list[float]:
    """Per level, the largest child's share of its parent's documents, node by node."""
    out = []
    for level in range(ids.shape[1]):
        parent = ids[:, level - 1] if level else np.zeros(len(ids), np.int64)
        best = 0.0
        for node in np.unique(parent):
            children = ids[parent == node, level].tolist()
            best = max(best, Counter(children).most_common(1)[0][1] / len(children))
        out.append(best)
    return out


def test_report_gives_the_balance_of_the_final_assignment(prepared, train_embeddings):
    """prepare_report.json's balance figures and the busiest rank under affine placement, computed
    again here: the documents' leaves from a fresh embedding, the groups by a bin packing written here."""
    recipe, _ = prepared
    meta = read_meta(recipe.data_dir, recipe)
    disk = json.loads((recipe.data_dir / "prepare_report.json").read_text())
    bf = recipe.data.clustering.balance_factor
    tree = ClusterTree.load(recipe.data_dir / "tree.safetensors", expect_branching=K, expect_depth=P)
    _, _, emb = train_embeddings
    balanced, greedy = tree.assign_balanced(emb, bf), tree.assign(emb)
    bal = disk["balance"]
    assert bal["balance_factor"] == bf and bal["limit"] == bf / K
    assert disk["max_cluster_fraction"] == bal["max_share_of_parent"]
    assert bal["max_share_of_parent"] == pytest.approx(_max_share_of_parent(balanced), abs=1e-12)
    assert bal["max_share_of_parent_greedy"] == pytest.approx(_max_share_of_parent(greedy), abs=1e-12)
    assert bal["documents_moved"] == int((balanced[:, -1] != greedy[:, -1]).sum())
    assert bal["documents_moved_fraction"] == pytest.approx(bal["documents_moved"] / len(emb), abs=1e-6)
    # every node here has enough documents for the limit itself: it holds everywhere, where the greedy
    # descent of the same documents breaks it (0.84 of a level-1 cluster's documents in one leaf)
    assert max(bal["max_share_of_parent"]) <= bf / K and bal["nodes_above_limit"] == [0] * P
    assert max(bal["max_share_of_parent_greedy"]) > bf / K and bal["documents_moved"] > 0

    samples = {s["subtree"]: s["samples"] for s in meta["streams"]["train"]}
    total = sum(samples.values())
    assert [e["world_size"] for e in disk["affine_busiest_rank"]] == [2, 4, 8, 16, 32, 64, 128, 256]
    for entry in disk["affine_busiest_rank"]:
        world = entry["world_size"]
        groups = max(g for g in range(1, min(world, len(samples)) + 1) if world % g == 0)
        loads = [0] * groups
        for s in sorted(samples, key=lambda s: (-samples[s], s)):  # largest first, onto the lightest group
            loads[loads.index(min(loads))] += samples[s]
        per_group = world // groups
        assert (entry["groups"], entry["ranks_per_group"]) == (groups, per_group)
        assert entry["busiest_rank_share"] == pytest.approx(max(loads) / total / per_group, abs=1e-6)
        assert entry["ideal"] == pytest.approx(1 / world, abs=1e-6)
        # K subtrees, one per group: a rank reads at most bf / K of the samples over its group's ranks
        assert entry["limit"] == pytest.approx(bf / K / per_group, abs=1e-6)
        assert entry["within_limit"] == (entry["busiest_rank_share"] <= entry["limit"])


def test_affine_busiest_rank_by_hand():
    # k = 4 subtrees with 40, 30, 20 and 10 samples, balance_factor 1.5 (limit 0.375 a subtree)
    rows = {e["world_size"]: e for e in affine_busiest_rank({0: 40, 1: 30, 2: 20, 3: 10}, 4, 1.5, (1, 2, 3, 4, 8))}
    # W = 2: two groups, {0, 3} and {1, 2} (largest first onto the lightest): 50 samples each
    assert (rows[2]["groups"], rows[2]["busiest_rank_share"], rows[2]["ratio_to_ideal"]) == (2, 0.5, 1.0)
    # bin packing bound with 2 groups of 4 subtrees: 1/2 + (1 - 1/2) * 0.375
    assert rows[2]["limit"] == 0.6875 and rows[2]["within_limit"]
    # W = 3: three groups, {0}, {1} and {2, 3}: the busiest reads 40 of 100, under 1/3 + (2/3) * 0.375
    assert (rows[3]["groups"], rows[3]["ranks_per_group"], rows[3]["busiest_rank_share"]) == (3, 1, 0.4)
    assert rows[3]["limit"] == pytest.approx(1 / 3 + 2 / 3 * 0.375, abs=1e-6) and rows[3]["within_limit"]
    assert rows[1]["busiest_rank_share"] == rows[1]["limit"] == 1.0
    # W = 4: one subtree a rank; subtree 0 holds 0.4 > 0.375, which the report flags
    assert (rows[4]["busiest_rank_share"], rows[4]["ideal"], rows[4]["limit"]) == (0.4, 0.25, 0.375)
    assert not rows[4]["within_limit"]
    # W = 8: two ranks a subtree
    assert (rows[8]["ranks_per_group"], rows[8]["busiest_rank_share"], rows[8]["limit"]) == (2, 0.2, 0.1875)
    assert affine_busiest_rank({0: 0, 1: 0}, 2, 1.5) == []


def test_balance_figures_by_hand():
    k, p = 2, 2
    # leaves 0..3 hold 3, 1, 2, 2 documents; greedy put 4, 0, 1, 3
    got = balance_figures(np.array([3, 1, 2, 2]), np.array([4, 0, 1, 3]), k, p, 1.5, moved=2)
    assert got["limit"] == 0.75 and got["balance_factor"] == 1.5
    assert got["max_share_of_parent"] == [0.5, 0.75]
    assert got["max_share_of_parent_greedy"] == [0.5, 1.0]
    assert got["nodes_above_limit"] == [0, 0]  # floor(1.5 * 4 / 2) = 3 of 4
    assert (got["documents_moved"], got["documents_moved_fraction"]) == (2, 0.25)
    # level-1 cluster 1 holds one document: its child holds all of it, above floor(1.5 * 1 / 2) = 0
    # (capacity() allows ceil(1 / 2) = 1 there), and the report counts that node
    got = balance_figures(np.array([1, 0, 2, 1]), np.array([1, 0, 2, 1]), k, p, 1.5, moved=0)
    assert got["max_share_of_parent"] == [0.75, 1.0] and got["nodes_above_limit"] == [0, 1]
