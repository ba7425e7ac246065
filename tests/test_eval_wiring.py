"""Evaluation wiring (issue 20, item 1): which memory every evaluation mode hands the model.

Memories are made distinguishable: bank row ``i`` of level ``l`` holds the value ``1000 (l + 1) + i``
in every entry and the generic block of level ``l`` holds ``-(l + 1)``. A probe model resolves its
``memory`` argument exactly as :class:`memtrain.model.anchor.DecoderLM` does
(``generic_memory(memory, B)``) and records, per sequence and per level, the block it received. The
tests drive the real evaluation code (``probe_accuracy`` with its retrieval, ``val_perplexity`` on
data from ``memtrain prepare``, ``long_context``) and compare the recorded blocks with ids computed
here independently (brute-force descent of the tree, the prepared documents' topics).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
import transformers
from torch import nn

from memtrain.config import recipe_from_dict
from memtrain.data.cluster import ClusterTree, level_offset, normalize, num_internal_nodes
from memtrain.eval.common import PromptEncoder, batch_memory
from memtrain.eval.hierarchical import corrupt_ids, mode_ids, mode_names, probe_accuracy, val_perplexity
from memtrain.eval.longctx import long_context, stream_call_tokens
from memtrain.data.tasks import format_prompt
from memtrain.model import build
from memtrain.model.anchor import ModelOutput
from memtrain.model.hierarchical import FetchedMemory, GenericMemory
from memtrain.model.titans.arch import TitansOutput
from memtrain.parallel.bank import MemoryBank

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NONE = "none"  # what the probe records for a forward without memory


# --------------------------------------------------------------------------------------------------
# Distinguishable memories and a probe model that reports which blocks it received


def code(level: int, cluster: int) -> float:
    return 1000.0 * (level + 1) + cluster


def coded_bank(layout) -> MemoryBank:
    """A float64 bank whose row ``i`` of level ``l`` is ``code(l, i)`` everywhere."""
    bank = MemoryBank(layout, dtype=torch.float64)
    with torch.no_grad():
        for level, table in enumerate(bank.tables):
            if table is not None:
                table.copy_(torch.tensor([code(level, i) for i in range(table.shape[0])],
                                         dtype=torch.float64)[:, None].expand_as(table))
    bank.requires_grad_(False)
    return bank


def path_of(ids, layout) -> tuple:
    """What the probe must record for a sequence fetching the global ids ``ids`` (one per level)."""
    return tuple(None if r == 0 else (level, int(ids[level])) for level, r in enumerate(layout.levels))


def generic_path(layout) -> tuple:
    return tuple(None if r == 0 else ("generic", level) for level, r in enumerate(layout.levels))


class ProbeLM(nn.Module):
    """Stands in for ``DecoderLM``: resolves ``memory`` as it does (``generic_memory(memory, B)``, the
    per-level rows the layers read) and records every forward as ``(input_ids, paths, memory.ids)``:
    ``paths[b]`` is :data:`NONE` for ``memory=None``, else one entry per level: ``(level, cluster)``
    decoded from a bank row, ``("generic", level)`` for the generic block, ``"zero"`` for a zero row,
    None for a level without memory (r_l = 0). ``logits_fn(input_ids, paths)`` gives the logits."""

    def __init__(self, layout, logits_fn: Callable[[torch.Tensor, list], torch.Tensor]):
        super().__init__()
        self.memory_layout = layout
        self.generic_memory = GenericMemory(layout).double()
        with torch.no_grad():
            for level, block in enumerate(self.generic_memory.blocks):
                block.fill_(-(level + 1.0))
        self.generic_memory.requires_grad_(False)
        self.logits_fn = logits_fn
        self.calls: list[tuple[torch.Tensor, list, Optional[torch.Tensor]]] = []

    def forward(self, input_ids, doc_ids=None, memory=None):
        B = input_ids.shape[0]
        if memory is None:
            paths, ids = [NONE] * B, None
        else:
            assert isinstance(memory, FetchedMemory)
            rows = self.generic_memory(memory, B)
            paths = [tuple(_decode(r, b) for r in rows) for b in range(B)]
            ids = None if memory.ids is None else memory.ids.clone()
        self.calls.append((input_ids.clone(), paths, ids))
        return ModelOutput(logits=self.logits_fn(input_ids, paths))


def _decode(rows: Optional[torch.Tensor], b: int):
    if rows is None:
        return None
    row = rows[b]
    assert bool((row == row[0]).all()), "a memory row mixes several blocks"
    x = float(row[0])
    if x == 0:
        return "zero"
    if x < 0:
        return ("generic", int(-x) - 1)
    return (int(x) // 1000 - 1, int(x) % 1000)


def memory_recipe(k: int, p: int, levels: list[int], **data) -> Any:
    return recipe_from_dict({
        "run": {"name": "wiring", "seed": 3, "device": "cpu"},
        "model": {"vocab_size": 64, "d_model": 8, "n_layers": 1, "n_heads": 2, "ffn_dim": 16, "max_seq_len": 32},
        "memory": {"type": "ffn", "levels": levels},
        "data": {"seq_len": 32, "tokenizer": {"vocab_size": 60, "model_type": "bpe"}, **data,
                 "clustering": {"enabled": True, "branching": k, "depth": p, "embedding_model": "stub",
                                "kmeans_samples": 64, "embedding_batch_size": 64}},
        "train": {"global_batch_tokens": 4 * 32, "micro_batch_size": 4, "max_steps": 1},
    })


def memory_layout(recipe):
    model = build(recipe.model, recipe.memory, recipe.data.clustering.branching)
    return model.memory_layout


def greedy_path(tree: ClusterTree, x: np.ndarray, first: Optional[int] = None) -> list[int]:
    """Brute-force descent of one normalised vector: at every level the closest child (ties: lowest
    index); ``first`` forces the level-1 cluster."""
    k, node, path = tree.branching, 0, []
    for level in range(tree.depth):
        d = [float(np.sum((x - tree.centroids[level_offset(level, k) + node, j].astype(np.float64)) ** 2))
             for j in range(k)]
        child = int(np.argmin(d)) if level > 0 or first is None else first
        node = node * k + child
        path.append(node)
    return path


def second_closest_root(tree: ClusterTree, x: np.ndarray) -> int:
    d = [float(np.sum((x - tree.centroids[0, j].astype(np.float64)) ** 2)) for j in range(tree.branching)]
    return int(np.argsort(d, kind="stable")[1])


# --------------------------------------------------------------------------------------------------
# batch_memory and mode_ids


def test_wiring_batch_memory_and_mode_ids():
    """batch_memory must hand each sequence the bank rows of its own ids at every level (not another
    sequence's, not shifted levels, not the generic block), the generic block to every sequence for
    ``generic``, None for ``none``, and must not count evaluation fetches; mode_ids must map each mode
    to its own ids (fetched -> retrieved, blocked -> blocked, corrupt_from_level_c -> rule J)."""
    K, P = 3, 3
    rng = np.random.default_rng(0)
    leaf = np.array([0, 26, 13, 5, 13, 22])
    ids = ClusterTree.levels_from_leaf(leaf, K, P)
    for levels in ([1, 1, 1], [2, 0, 1]):
        layout = memory_layout(memory_recipe(K, P, levels))
        bank = coded_bank(layout)
        probe = ProbeLM(layout, lambda x, paths: torch.zeros(*x.shape, 4))
        x = torch.ones(len(ids), 3, dtype=torch.long)
        mem = batch_memory(bank, "fetched", len(ids), torch.from_numpy(ids), torch.device("cpu"))
        probe(x, memory=mem)
        assert probe.calls[-1][1] == [path_of(row, layout) for row in ids]
        assert torch.equal(probe.calls[-1][2], torch.from_numpy(ids))
        assert mem.generic is None
        probe(x, memory=batch_memory(bank, "generic", len(ids), None, torch.device("cpu")))
        assert probe.calls[-1][1] == [generic_path(layout)] * len(ids)
        # generic ignores ids even when some are given
        probe(x, memory=batch_memory(bank, "generic", len(ids), torch.from_numpy(ids), torch.device("cpu")))
        assert probe.calls[-1][1] == [generic_path(layout)] * len(ids)
        assert batch_memory(bank, "none", len(ids), torch.from_numpy(ids), torch.device("cpu")) is None
        assert bank.stats(norms=False) == {f"memory_module/rows_touched_frac/level{l + 1}": 0.0
                                           for l, r in enumerate(levels) if r} | {
                                               "memory_module/rows_touched_frac/all": 0.0,
                                               "comm/bank_bytes_sent": 0.0, "comm/bank_bytes_received": 0.0}
    with pytest.raises(ValueError, match="memory mode 'blocked' needs cluster ids"):
        batch_memory(bank, "blocked", 2, None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"level-1 cluster ids must lie in \[0, 3\); got \[0, 3\]"):
        batch_memory(bank, "fetched", 2, torch.tensor([[3, 9, 27], [0, 0, 0]]), torch.device("cpu"))

    fetched = ClusterTree.levels_from_leaf(rng.integers(0, K**P, size=50), K, P)
    blocked = ClusterTree.levels_from_leaf(rng.integers(0, K**P, size=50), K, P)
    assert np.array_equal(mode_ids("fetched", fetched, blocked, K), fetched)
    assert np.array_equal(mode_ids("blocked", fetched, blocked, K), blocked)
    assert mode_ids("generic", fetched, blocked, K) is None and mode_ids("none", fetched, blocked, K) is None
    for c in range(1, P + 1):
        got = mode_ids(f"corrupt_from_level_{c}", fetched, blocked, K)
        _check_corrupt(got, fetched, K, c)


def _check_corrupt(got: np.ndarray, true: np.ndarray, k: int, c: int) -> None:
    """Appendix J, checked on its properties: levels < c keep the true ids, every level >= c differs
    from the true one, and the result is a valid tree path (each id a child of the one above)."""
    assert np.array_equal(got[:, :c - 1], true[:, :c - 1])
    assert (got[:, c - 1:] != true[:, c - 1:]).all()
    assert (got[:, 0] < k).all() and (got[:, 1:] // k == got[:, :-1]).all()


# --------------------------------------------------------------------------------------------------
# Fact probes: every mode of probe_accuracy, with the real retrieval on a tiny tree


@dataclass(frozen=True)
class FakeProbe:
    prompt: str
    answer: str
    bucket: str
    kind: str


class ProbeTokenizer:
    """``"Q<i>"`` -> ``[3 + i]``, ``"A"`` -> ``[1]``; 0 is end-of-text, 2 the wrong answer."""

    eot_id = 0

    def encode(self, text):
        return [1 if w == "A" else 3 + int(w[1:]) for w in text.split()]

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]


class TableEmbedder:
    """Prompt -> a fixed vector (stands in for the clustering embedding model)."""

    def __init__(self, table: dict[str, np.ndarray]):
        self.table = table
        self.dim = len(next(iter(table.values())))

    def get_embedding_dimension(self):
        return self.dim

    def encode(self, texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False):
        return normalize(np.stack([self.table[t] for t in texts]).astype(np.float32))


def probe_good(path, i: int) -> bool:
    """Whether the probe model answers probe ``i`` correctly given the memory it received: a function
    of the blocks (so each mode's accuracy follows from its ids)."""
    if path == NONE:
        return i % 3 == 1
    if all(p is None or p[0] == "generic" for p in path):
        return i % 3 == 0
    return (sum(p[1] for p in path if p is not None) + i) % 2 == 0


def test_wiring_probe_accuracy_reads_the_right_cluster_path_per_mode(tmp_path, monkeypatch):
    """probe_accuracy with the real retrieval (prompt embedding -> tree descent, blocked descent): every
    probe must read exactly the leaf path the tree assigns to its prompt (``fetched``), the path under
    the second-closest level-1 centroid (``blocked``), the Appendix J path from level c
    (``corrupt_from_level_c``), the generic block, or nothing, and each mode's accuracy must be
    computed from that mode's forwards. Catches swapped or shifted ids, swapped modes, a blocked
    retrieval that takes (closest + 1) mod k or the greedy path, corruption from the wrong level, and
    generic memory where ids are due."""
    from memtrain.data import embed, longtail, tokenizer as tokenizer_mod

    K, P, DIM, N, BS = 3, 3, 6, 23, 5
    rng = np.random.default_rng(7)
    tree = ClusterTree(K, P, DIM, rng.normal(size=(num_internal_nodes(K, P), K, DIM)).astype(np.float32))
    data_dir = tmp_path / "data"
    tree.save(data_dir / "tree.safetensors")
    meta = {"tokenizer": "probe-tokenizer", "clustering": {"tree": "tree.safetensors"}}
    emb = rng.normal(size=(N, DIM))
    buckets = [("head", "torso", "tail")[i % 3] for i in range(N)]
    kinds = [("symbol", "numeric")[(i // 2) % 2] for i in range(N)]
    probes = [FakeProbe(f"Q{i}", " A", buckets[i], kinds[i]) for i in range(N)]
    monkeypatch.setattr(longtail, "probes", lambda seed=0: probes)
    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", lambda ref, base=None: ProbeTokenizer())
    monkeypatch.setattr(embed, "load_embedder",
                        lambda name="", device=None: TableEmbedder({p.prompt: e for p, e in zip(probes, emb)}))

    recipe = memory_recipe(K, P, [1, 1, 1])
    layout = memory_layout(recipe)
    bank = coded_bank(layout)
    V = N + 3

    def logits_fn(x, paths):
        answer = torch.tensor([1 if probe_good(p, int(i) - 3) else 2 for p, i in zip(paths, x[:, 0])])
        return torch.nn.functional.one_hot(answer, V).double()[:, None, :].expand(-1, x.shape[1], -1)

    model = ProbeLM(layout, logits_fn)
    modes = mode_names(P) + ["none"]
    assert modes == ["fetched", "generic", "blocked", "corrupt_from_level_3", "corrupt_from_level_2",
                     "corrupt_from_level_1", "none"]
    report = probe_accuracy(model, bank, recipe, data_dir, meta, modes, torch.device("cpu"), batch_size=BS)

    # Expected ids, by brute force on the tree, from the embeddings the stand-in encoder returns.
    xs = normalize(normalize(emb.astype(np.float32)), np.float64)
    true = np.array([greedy_path(tree, x) for x in xs])
    blocked = np.array([greedy_path(tree, x, first=second_closest_root(tree, x)) for x in xs])
    assert (blocked[:, 0] != true[:, 0]).all()
    assert (blocked[:, 0] != (true[:, 0] + 1) % K).any()  # the tree tells "second closest" from "next"
    assert (blocked[:, 1:] != true[:, 1:]).all()
    expected: dict[str, list] = {"fetched": [path_of(r, layout) for r in true],
                                 "blocked": [path_of(r, layout) for r in blocked],
                                 "generic": [generic_path(layout)] * N, "none": [NONE] * N}
    expected_ids: dict[str, Optional[np.ndarray]] = {"fetched": true, "blocked": blocked, "generic": None,
                                                     "none": None}

    calls_per_mode = math.ceil(N / BS)
    assert len(model.calls) == calls_per_mode * len(modes)
    for m, mode in enumerate(modes):
        calls = model.calls[m * calls_per_mode:(m + 1) * calls_per_mode]
        probe_idx = [int(i) - 3 for x, _, _ in calls for i in x[:, 0]]
        assert probe_idx == list(range(N))
        got_paths = [p for _, paths, _ in calls for p in paths]
        got_ids = None if calls[0][2] is None else torch.cat([ids for _, _, ids in calls]).numpy()
        if mode.startswith("corrupt_from_level_"):
            c = int(mode.rsplit("_", 1)[1])
            _check_corrupt(got_ids, true, K, c)
            assert np.array_equal(got_ids, corrupt_ids(true, K, c))
            expected[mode] = [path_of(r, layout) for r in got_ids]
            expected_ids[mode] = got_ids
        assert got_paths == expected[mode], mode
        if expected_ids[mode] is None:
            assert got_ids is None, mode
        else:
            assert np.array_equal(got_ids, expected_ids[mode]), mode
        # The mode's accuracy is computed from the mode's own forwards.
        good = [probe_good(p, i) for i, p in enumerate(expected[mode])]
        cell = report["modes"][mode]
        assert cell["all"] == {"accuracy": sum(good) / N, "correct": sum(good), "count": N}, mode
        for b in ("head", "torso", "tail"):
            sel = [g for g, bb in zip(good, buckets) if bb == b]
            assert cell["buckets"][b]["correct"] == sum(sel) and cell["buckets"][b]["count"] == len(sel), mode
        for kd in ("symbol", "numeric"):
            sel = [g for g, kk in zip(good, kinds) if kk == kd]
            assert cell["kinds"][kd]["correct"] == sum(sel) and cell["kinds"][kd]["count"] == len(sel), mode
    # The modes do give different accuracies here, so a swap of result cells shows.
    assert len({report["modes"][m]["all"]["correct"] for m in modes}) >= 4
    assert report["count"] == N
    assert bank.stats(norms=False)["memory_module/rows_touched_frac/all"] == 0.0  # eval fetches are not counted


# --------------------------------------------------------------------------------------------------
# Validation perplexity on data from `memtrain prepare`

TOPICS = ("abcd", "efgh", "ijkl", "mnop", "qrst", "uvwx")
TOPIC_DIM = 8
TOPIC_VECTORS = normalize(np.random.default_rng(11).normal(size=(len(TOPICS), TOPIC_DIM)), np.float64)


def topics_of(text: str) -> set[int]:
    return {t for ch in text for t, letters in enumerate(TOPICS) if ch in letters}


class TopicEmbedder:
    """Each text embeds to the (normalised) sum of its letters' topic vectors: a document (all its
    letters from one topic) and every window of it embed to exactly that topic's vector."""

    def get_embedding_dimension(self):
        return TOPIC_DIM

    def encode(self, texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False):
        out = np.zeros((len(texts), TOPIC_DIM))
        for i, text in enumerate(texts):
            for ch in text:
                for t in topics_of(ch):
                    out[i] += TOPIC_VECTORS[t]
        norm = np.linalg.norm(out, axis=1, keepdims=True)
        return (out / np.where(norm > 0, norm, 1.0)).astype(np.float32)


VAL_K, VAL_P = 2, 3


@pytest.fixture(scope="module")
def prepared_topics(tmp_path_factory):
    """A clustered data folder from `memtrain prepare` (tokenizer, tree, shards) of 96 one-topic
    documents, embedded by :class:`TopicEmbedder`."""
    from memtrain.data import embed
    from memtrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("wiring")
    rng = np.random.default_rng(0)
    docs = []
    for i in range(96):
        letters = list(TOPICS[i % len(TOPICS)])
        docs.append(" ".join("".join(rng.choice(letters, size=rng.integers(2, 6)))
                             for _ in range(rng.integers(8, 30))))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    recipe = memory_recipe(VAL_K, VAL_P, [1, 1, 1], dir=str(root / "data"), sources=[str(root / "docs.jsonl")],
                           val_fraction=0.25)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(embed, "load_embedder", lambda name="", device=None: TopicEmbedder())
        prepare(recipe)
    return recipe


def test_wiring_val_perplexity_reads_each_sequences_prepared_ids(prepared_topics):
    """val_perplexity: with ``fetched`` every val sequence must read the blocks of the cluster path
    `memtrain prepare` assigned to its documents (the loader's ``cluster_ids``, checked here against
    the tree's assignment of the documents' topics); ``generic`` the generic block; ``none`` nothing;
    and each mode's loss must be the loss of its own forwards. Catches ids taken from another
    sequence or batch, the generic memory used for fetched, and per-mode sums swapped."""
    from memtrain.data.loader import ValidationSet, read_meta
    from memtrain.data.tokenizer import load_tokenizer

    recipe = prepared_topics
    meta = read_meta(recipe.data_dir, recipe)
    eot, vocab = meta["eot_id"], recipe.model.vocab_size
    layout = memory_layout(recipe)
    bank = coded_bank(layout)

    def bias(path) -> float:
        if path == NONE:
            return 0.0
        if path == generic_path(layout):
            return 0.75
        return 1.0 + 0.125 * sum((lvl + 1) * (cid + 1) for lvl, cid in path)

    def logits_fn(x, paths):
        out = torch.zeros(*x.shape, vocab, dtype=torch.float64)
        out[..., eot] = torch.tensor([bias(p) for p in paths], dtype=torch.float64)[:, None]
        return out

    model = ProbeLM(layout, logits_fn)
    modes = ["fetched", "generic", "none"]
    out = val_perplexity(model, bank, recipe, modes, 0, torch.device("cpu"))

    batches = list(ValidationSet(recipe, recipe.train.micro_batch_size, batches=0))
    assert len(batches) >= 3 and out["fetched"]["batches"] == len(batches)
    assert len(model.calls) == len(batches) * len(modes)
    tree = ClusterTree.load(recipe.data_dir / "tree.safetensors")
    topic_path = {t: tuple(tree.assign(TOPIC_VECTORS[t][None])[0]) for t in range(len(TOPICS))}
    tok = load_tokenizer(meta["tokenizer"], base=recipe.data_dir)
    loss = {m: 0.0 for m in modes}
    tokens, leaves = 0, set()
    for i, batch in enumerate(batches):
        ids = batch["cluster_ids"]
        for b in range(ids.shape[0]):
            # The loader's ids are the tree's path of the documents in the sequence.
            row = [t for t in batch["input_ids"][b].tolist() if t != eot]
            topics = topics_of(tok.decode(row))
            assert topics and {topic_path[t] for t in topics} == {tuple(ids[b].tolist())}
            leaves.add(int(ids[b, -1]))
        expected = {"fetched": [path_of(r, layout) for r in ids.tolist()],
                    "generic": [generic_path(layout)] * ids.shape[0], "none": [NONE] * ids.shape[0]}
        labels = batch["labels"]
        scored = labels != -100
        tokens += int(scored.sum())
        for j, mode in enumerate(modes):
            x, paths, got_ids = model.calls[i * len(modes) + j]
            assert torch.equal(x, batch["input_ids"])
            assert paths == expected[mode], (i, mode)
            if mode == "fetched":
                assert torch.equal(got_ids, ids)
            a = torch.tensor([bias(p) for p in expected[mode]], dtype=torch.float64)[:, None].expand_as(labels)
            per_token = torch.log(vocab - 1 + torch.exp(a)) - a * (labels == eot)
            loss[mode] += float(per_token[scored].sum())
    assert len(leaves) >= 3  # several clusters in the val split
    for mode in modes:
        assert out[mode]["tokens"] == tokens
        assert out[mode]["loss"] == pytest.approx(loss[mode] / tokens, rel=1e-6, abs=0)  # fp32 inside
    assert len({round(out[m]["loss"], 4) for m in modes}) == 3


# --------------------------------------------------------------------------------------------------
# Long-context tasks: which memory every forward gets


class TableTokenizer:
    """Prompt text -> the token ids given for it; decode writes the ids as numbers."""

    eot_id = 0

    def __init__(self, table: dict[str, list[int]]):
        self.table = table

    def encode(self, text):
        return list(self.table[text])

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def examples_with_prompts(prompts: list[list[int]]) -> tuple[list[dict], TableTokenizer]:
    examples = [{"task": "passkey", "context": f"context {i}", "question": "Q?", "answer": "7", "length": 64,
                 "depth": 0.5, "n_tokens": len(p)} for i, p in enumerate(prompts)]
    return examples, TableTokenizer({format_prompt(e): p for e, p in zip(examples, prompts)})


def sums_reference(prompt: list[int], max_new: int, vocab: int) -> list[int]:
    out, total = [], sum(prompt)
    for _ in range(max_new):
        t = total % vocab
        if t == 0:
            break
        out.append(t)
        total += t
    return out


def test_wiring_long_context_hierarchical_model_uses_the_generic_memory():
    """long_context on a hierarchical-memory model: every forward must carry the generic block at every
    level for every row (no retrieval for these prompts: the bank is never read), in a window of
    model.max_seq_len tokens. Catches fetched ids, no memory, or bank rows in long-context generation."""
    recipe = memory_recipe(3, 3, [1, 1, 1])
    layout = memory_layout(recipe)
    bank = coded_bank(layout)
    fetches = []
    real_fetch = bank.fetch
    bank.fetch = lambda *a, **kw: fetches.append(a) or real_fetch(*a, **kw)
    V = 16

    def logits_fn(x, paths):
        return torch.nn.functional.one_hot(x.cumsum(1) % V, V).double()

    model = ProbeLM(layout, logits_fn)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (5, 12, 40, 12, 3)]
    examples, tok = examples_with_prompts(prompts)
    res = long_context(model, bank, recipe, tok, PromptEncoder(tok), examples, ["passkey"], [64], 5, 4,
                       torch.device("cpu"), batch_size=2)
    assert res["memory"].startswith("generic") and res["context"]["mode"] == "window"
    assert res["context"]["max_context"] == recipe.model.max_seq_len
    assert model.calls and not fetches
    for x, paths, ids in model.calls:
        assert paths == [generic_path(layout)] * x.shape[0] and ids is None
    budget = recipe.model.max_seq_len - 4 + 1
    want = [sums_reference(p[-budget:], 4, V) for p in prompts]
    assert [e["prediction"] for e in res["examples"]] == [" ".join(map(str, w)) for w in want]


@dataclass
class StreamState:
    """The stub Titans memory: every token each row has been fed since its memory was fresh."""

    seen: list[list[int]]


def test_wiring_titans_stream_carries_memory_within_a_sample_only():
    """long_context on a Titans model: prompts longer than the context are read in calls of
    stream_call_tokens tokens, each call continuing from the memory state the previous call of the same
    sample returned, and every sample starts from the initial memory (memory=None). The stub memory
    records every token fed since it was fresh, so a forward's view must be exactly its own sample's
    prompt + generated tokens from the first token. Catches a state not carried (a restart mid-prompt),
    carried across samples, carried from the wrong call, or offsets that skip or repeat tokens."""
    cfg = {"type": "titans", "vocab_size": 40, "d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_dim": 32,
           "max_seq_len": 20, "titans": {"variant": "mac", "memory_heads": 2, "memory_chunk_size": 4,
                                         "segment_len": 8, "window": 6, "persistent_tokens": 2}}
    recipe = recipe_from_dict({"model": cfg, "data": {"seq_len": 20, "tokenizer": {"vocab_size": 40}},
                               "train": {"global_batch_tokens": 80, "micro_batch_size": 4}})
    model = build(recipe.model).eval()
    C = stream_call_tokens(model)
    assert C == 16
    V = 40
    views: list[tuple[list[list[int]], Optional[StreamState]]] = []

    def stub(input_ids, doc_ids=None, memory=None):
        assert input_ids.shape[1] <= recipe.model.max_seq_len
        prev = memory.seen if memory is not None else [[] for _ in range(input_ids.shape[0])]
        assert len(prev) == input_ids.shape[0]
        seen = [p + row for p, row in zip(prev, input_ids.tolist())]
        views.append((seen, memory))
        carried = torch.tensor([sum(p) for p in prev], dtype=torch.long)
        total = input_ids.cumsum(1) + carried[:, None]
        return TitansOutput(logits=torch.nn.functional.one_hot(total % V, V).float(), memory=StreamState(seen))

    model.forward = stub
    g = torch.Generator().manual_seed(1)
    lengths = (45, 45, 70, 9, 45, 70, 33)
    prompts = [[i + 1] + torch.randint(1, V, (n - 1,), generator=g).tolist() for i, n in enumerate(lengths)]
    examples, tok = examples_with_prompts(prompts)
    res = long_context(model, None, recipe, tok, PromptEncoder(tok), examples, ["passkey"], [64], 7, 5,
                       torch.device("cpu"), batch_size=2)
    assert res["context"] == {"mode": "stream", "max_context": 20, "call_tokens": C, "prompt_budget": None}
    assert res["memory"].startswith("fresh per sample") and res["truncated"] == 0
    want = [sums_reference(p, 5, V) for p in prompts]
    assert [e["prediction"] for e in res["examples"]] == [" ".join(map(str, w)) for w in want]
    full = [p + w for p, w in zip(prompts, want)]
    for seen, _ in views:
        for row in seen:
            f = full[row[0] - 1]  # every prompt starts with its own id: a view must start at a sample's start
            assert row[:len(f)] == f[:len(row)]
            if len(row) > len(f):  # a row that stopped at end-of-text rides along with its batch
                assert row[len(f)] == 0
    assert sum(memory is not None for _, memory in views) >= 10


def test_wiring_memory_llama_blocks_start_every_forward_from_m0():
    """long_context on a MemoryLlama model whose blocks are in ``stream`` mode (they would carry their
    state from one forward to the next): every forward of the generation must read the memory from M_0
    (state None) in every block, the model gets no memory argument, and the blocks' mode is restored
    afterwards. Catches a memory carried across samples or across the re-run prefixes of one sample."""
    from memtrain.model.titans.memory_llama import inject_memory, memory_blocks, set_memory_mode

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    inject_memory(hf, "elma", memory_kwargs=dict(heads=2, chunk_size=4))
    blocks = memory_blocks(hf)
    assert len(blocks) == 2
    reads: list[tuple[int, Any]] = []
    for j, blk in enumerate(blocks):
        real_read = blk.read

        def read(x, normed, state, j=j, real_read=real_read):
            reads.append((j, state))
            return real_read(x, normed, state)

        blk.read = read

    class Adapter(nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf
            self.memory_args: list = []

        def forward(self, input_ids, doc_ids=None, memory=None):
            self.memory_args.append(memory)
            return ModelOutput(logits=self.hf(input_ids=input_ids, use_cache=False).logits)

    model = Adapter()
    recipe = recipe_from_dict({"model": {"type": "hf", "pretrained": "/unused", "max_seq_len": 64},
                               "memory": {"type": "memory_llama"}, "data": {"seq_len": 64}})
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 48, (n,), generator=g).tolist() for n in (20, 11, 20, 11)]
    examples, tok = examples_with_prompts(prompts)
    tok.eot_id = 147  # never generated: every sample runs max_new_tokens forwards (batches of equal lengths)
    set_memory_mode(hf, "stream")
    with torch.no_grad():  # sensitivity: in stream mode a second forward starts from a carried state
        hf(input_ids=torch.tensor([prompts[0]]), use_cache=False)
        hf(input_ids=torch.tensor([prompts[0]]), use_cache=False)
    assert reads[-1][1] is not None and reads[-2][1] is not None
    reads.clear()
    set_memory_mode(hf, "stream")
    res = long_context(model, None, recipe, tok, PromptEncoder(tok), examples, ["passkey"], [64], 3, 3,
                       torch.device("cpu"), batch_size=2)
    assert res["memory"].startswith("fresh per sample") and res["context"]["max_context"] == 128
    forwards = len(model.memory_args)
    assert forwards == 2 * 3  # two batches (lengths 20 and 11, two prompts each), three new tokens each
    assert model.memory_args == [None] * forwards
    assert len(reads) == forwards * len(blocks)
    assert [state is None for _, state in reads] == [True] * len(reads)  # every block read from M_0
    assert all(blk.mode == "stream" and blk.state is None for blk in blocks)
