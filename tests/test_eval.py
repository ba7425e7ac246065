"""`memtrain eval` (memtrain.eval): the Appendix J corruption rule and the Section 4
blocked descent on hand-made trees, teacher-forced probe scoring on models whose logits are known,
and an end-to-end run on the builtin:longtail corpus (prepare, train with and without memories, eval
through the command line)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from memtrain.config import RecipeError
from memtrain.data.cluster import ClusterTree, level_offset, normalize, num_internal_nodes
from memtrain.eval.hierarchical import (blocked_ids, check_modes, corrupt_ids, mode_names, probe_tokens,
                                       score_sequences)
from memtrain.launcher.cli import split_checkpoint_override
from memtrain.model.anchor import ModelOutput

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# --------------------------------------------------------------------------------------------------
# Retrieval variants


def test_corrupt_ids_exact():
    k = 4
    ids = np.array([[2, 9, 38],     # a path: 38 // 4 = 9, 9 // 4 = 2
                    [3, 15, 63]])   # the last child everywhere: wraps to child 0
    assert corrupt_ids(ids, k, 3).tolist() == [[2, 9, 39], [3, 15, 60]]
    assert corrupt_ids(ids, k, 2).tolist() == [[2, 10, 43], [3, 12, 48]]
    assert corrupt_ids(ids, k, 1).tolist() == [[3, 14, 59], [0, 0, 0]]
    assert mode_names(3)[-3:] == ["corrupt_from_level_3", "corrupt_from_level_2", "corrupt_from_level_1"]
    assert mode_names(None) == ["none"]
    # On random paths: valid tree paths, equal above c, different at every level >= c.
    rng = np.random.default_rng(0)
    for k, p in ((2, 4), (3, 3), (16, 2)):
        leaf = rng.integers(0, k**p, size=200)
        ids = ClusterTree.levels_from_leaf(leaf, k, p)
        for c in range(1, p + 1):
            out = corrupt_ids(ids, k, c)
            assert (out[:, 0] < k).all() and (out[:, 1:] // k == out[:, :-1]).all()
            assert (out[:, :c - 1] == ids[:, :c - 1]).all() and (out[:, c - 1:] != ids[:, c - 1:]).all()
    with pytest.raises(ValueError, match=r"from_level must lie in \[1, "):
        corrupt_ids(ids, 16, 0)


def _tree(k: int, p: int, centroids: dict[tuple[int, int], list[list[float]]], dim: int) -> ClusterTree:
    """A tree whose node ``(level, n)`` has the given child centroids (the rest: random, unused)."""
    c = np.random.default_rng(1).normal(size=(num_internal_nodes(k, p), k, dim)).astype(np.float32)
    for (level, n), rows in centroids.items():
        c[level_offset(level, k) + n] = normalize(np.array(rows, np.float32))
    return ClusterTree(k, p, dim, c)


def test_blocked_descent_exact():
    # k=3, p=2: root children along the axes; node 2 (below e3) has its closest child to x at index 1.
    tree = _tree(3, 2, {(0, 0): [[1, 0, 0], [0, 1, 0], [0, 0, 1]],
                        (1, 2): [[0, 0.3, 1], [0.3, 0, 1], [0, -0.3, 1]],
                        (1, 0): [[1, 0.3, 0], [1, -0.3, 0], [1, 0, 0.3]]}, dim=3)
    x = np.array([[1.0, 0.0, 0.5]])  # closest root child 0, second-closest 2 (not (0 + 1) % 3)
    assert tree.assign(x).tolist() == [[0, 2]]  # greedy: child 2 of node 0 (the one towards e3)
    assert blocked_ids(tree, x).tolist() == [[2, 7]]  # node 2, then greedily its child 1 -> 2*3 + 1


def test_blocked_descent_matches_brute_force():
    rng = np.random.default_rng(2)
    k, p, dim = 4, 3, 8
    tree = ClusterTree(k, p, dim, rng.normal(size=(num_internal_nodes(k, p), k, dim)).astype(np.float32))
    x = rng.normal(size=(100, dim))
    got = blocked_ids(tree, x)
    fetched = tree.assign(x)
    xn = normalize(x, np.float64)
    for i in range(len(x)):
        d = [float(np.sum((xn[i] - tree.centroids[0, j]) ** 2)) for j in range(k)]
        node = int(np.argsort(d, kind="stable")[1])  # the second-closest level-1 cluster
        path = [node]
        for level in range(1, p):
            d = [float(np.sum((xn[i] - tree.centroids[level_offset(level, k) + node, j]) ** 2)) for j in range(k)]
            node = node * k + int(np.argmin(d))
            path.append(node)
        assert got[i].tolist() == path
    assert (got[:, 0] != fetched[:, 0]).all()
    assert (got[:, 1:] // k == got[:, :-1]).all()


def test_memory_modes_on_a_model_without_cluster_memories_name_its_memory_type():
    """A cross-attention model has a memory but no cluster-fetched one: asking it for `fetched` names its memory type
    (before: "memory.type: is 'none'", for a recipe whose memory.type is crossattn)."""
    assert check_modes(["none"], None, "crossattn") == ["none"]
    with pytest.raises(RecipeError, match=r"memory.type: is 'crossattn': mode\(s\) fetched, blocked choose, corrupt "
                                          r"or block the memories fetched by cluster id .* only mode 'none'"):
        check_modes(["fetched", "blocked", "none"], None, "crossattn")
    with pytest.raises(RecipeError, match=r"memory.type: is 'none', so the model has no memories"):
        check_modes(["fetched"], None)
    assert check_modes(["fetched", "none"], 2, "ffn") == ["fetched", "none"]


def test_import_is_light():
    code = ("import sys, memtrain.eval.evaluate, memtrain.launcher.cli\n"
            "print([m for m in ('deepspeed', 'streaming', 'sentence_transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_split_checkpoint_override():
    rest, path = split_checkpoint_override(["train.max_steps=3", "checkpoint=runs/a", "checkpoint.keep_last=2"])
    assert rest == ["train.max_steps=3", "checkpoint.keep_last=2"] and path == "runs/a"
    assert split_checkpoint_override(["a=1"]) == (["a=1"], None)


# --------------------------------------------------------------------------------------------------
# Teacher-forced scoring


class CumsumLM(nn.Module):
    """Predicts ``(sum of the tokens so far + offset) mod V`` at every position: causal, so right padding
    never changes a sequence's predictions. ``memory``: a ``[B]`` tensor of per-sequence offsets."""

    V = 50

    def forward(self, input_ids, doc_ids=None, memory=None):
        nxt = input_ids.cumsum(1)
        if memory is not None:
            nxt = nxt + memory[:, None]
        return ModelOutput(logits=torch.nn.functional.one_hot(nxt % self.V, self.V).float() * 10)


def test_score_sequences_on_known_logits():
    model = CumsumLM()
    seqs = [[3, 4, 7],          # 3+4 = 7: correct
            [3, 4, 7, 14],      # then 14: correct
            [3, 4, 7, 13],      # last answer token wrong
            [3, 4, 8, 16],      # first answer token wrong (the rest would follow from it)
            [1, 2, 3, 4, 10, 20, 40, 30],  # long prompt, answer 10 20 40 (80 mod 50 =) 30: correct
            [5, 5],             # answer 5 != 5 (prediction after [5] is 5): correct
            [9]]                # no answer token: incorrect
    starts = [2, 2, 2, 2, 4, 1, 1]
    want = [True, True, False, False, True, True, False]
    for batch_size in (1, 3, 64):
        for pad in (0, 7):
            got = score_sequences(model, seqs, starts, batch_size=batch_size, pad_id=pad)
            assert got.tolist() == want, (batch_size, pad)
    # The memory of each row reaches that row: offsets shift the predictions.
    offsets = torch.tensor([0, 0, 0, 0, 0, 1, 0])
    seen = []

    def memory_fn(idx):
        seen.append(idx.tolist())
        return offsets[idx]

    got = score_sequences(model, seqs, starts, memory_fn, batch_size=4)
    assert got.tolist() == [True, True, False, False, True, False, False]
    assert seen == [[0, 1, 2, 3], [4, 5, 6]]
    # Sequences longer than max_len keep their last max_len tokens (the answer stays in place).
    assert score_sequences(model, [[10, 1, 2, 13]], [3]).tolist() == [True]
    assert score_sequences(model, [[10, 1, 2, 3]], [3]).tolist() == [False]
    assert score_sequences(model, [[10, 1, 2, 3]], [3], max_len=3).tolist() == [True]  # [1, 2] predicts 3


class GreedyTokenizer:
    """Longest match over a tiny vocabulary, so that ``prompt + answer`` may merge across the boundary."""

    vocab = {"ab": 10, "a": 1, "b": 2, " ": 3, "c": 4}
    eot_id = 0

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            piece = text[i:i + 2] if text[i:i + 2] in self.vocab else text[i]
            out.append(self.vocab[piece])
            i += len(piece)
        return out

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]


def test_probe_tokens_common_prefix():
    seqs, starts = probe_tokens(GreedyTokenizer(), ["ca", "c", "c c"], ["b", " ab", " b"])
    assert seqs == [[4, 10], [4, 3, 10], [4, 3, 4, 3, 2]]
    assert starts == [1, 1, 3]  # "cab": the prompt's "a" merged into "ab", which is the answer's token


def test_teacher_forcing_equals_greedy_generation():
    """On a random tiny decoder: the answer greedy generation produces is scored correct (batched, right
    padded); changing any of its tokens makes it incorrect."""
    from memtrain.config import ModelConfig
    from memtrain.model import build

    torch.manual_seed(0)
    model = build(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 40, size=rng.integers(2, 12)).tolist() for _ in range(12)]
    seqs, starts, wrong = [], [], []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(3):
                logits = model(torch.tensor([tokens])).logits
                tokens.append(int(logits[0, -1].argmax()))
            seqs.append(tokens)
            starts.append(len(prompt))
            bad = list(tokens)
            j = len(prompt) + int(rng.integers(0, 3))
            bad[j] = (bad[j] + 1) % 40
            wrong.append(bad)
    assert score_sequences(model, seqs, starts, batch_size=5).all()
    assert not score_sequences(model, wrong, starts, batch_size=5).any()


# --------------------------------------------------------------------------------------------------
# End to end: prepare builtin:longtail, train with and without memories, `memtrain eval`

K, P, SEQ = 2, 2, 64


class HashEmbedder:
    """A stand-in for all-MiniLM-L6-v2 (the real encoder embeds the 1,875 documents in ~40 s on two
    cores): unit-norm hashed bag of words, so a prompt lands near the documents naming its entity."""

    dim = 64

    def get_embedding_dimension(self):
        return self.dim

    def encode(self, texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False):
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                out[i, zlib.crc32(word.strip(".,:;?!").encode()) % self.dim] += 1.0
        return normalize(out + 1e-3)


def _recipe(root: Path, run: str, memory: bool) -> dict:
    recipe = {
        "run": {"name": f"eval-{run}", "seed": 5, "device": "cpu", "dir": str(root / "runs" / run)},
        "model": {"vocab_size": 512, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64, "max_seq_len": SEQ},
        "data": {"dir": str(root / "data"), "sources": ["builtin:longtail"], "seq_len": SEQ, "val_fraction": 0.05,
                 "tokenizer": {"vocab_size": 400, "model_type": "bpe"},
                 "clustering": {"enabled": True, "branching": K, "depth": P, "kmeans_samples": 256,
                                "embedding_batch_size": 64}},
        "train": {"max_steps": 6, "global_batch_tokens": 8 * SEQ, "micro_batch_size": 4,
                  "optimizer": {"lr": 3.0e-3}, "schedule": {"kind": "cosine", "warmup": "1 steps", "min_lr": 3.0e-4},
                  "eval": {"batches": 2}},
        "checkpoint": {"every_steps": 6, "keep_last": 1},
        "logging": {"every_steps": 6, "tensorboard": False},
    }
    if memory:
        recipe["memory"] = {"type": "ffn", "levels": [8, 4], "optimizer": {"lr": 3.0e-2, "min_lr": 3.0e-3}}
    path = root / f"{run}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Prepared builtin:longtail data (hashed-word embeddings), a trained FFN-memory run and a trained
    memory-less run. The embedder stays patched while the module's tests run (eval embeds prompts)."""
    from memtrain.config import load_recipe
    from memtrain.data import embed
    from memtrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("eval")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(embed, "load_embedder", lambda name="", device=None: HashEmbedder())
        mem, plain = _recipe(root, "mem", True), _recipe(root, "plain", False)
        prepare(load_recipe(mem))
        # Training starts a (gloo) process group: keep it out of the test process. It would also use
        # both cores, which slows a tiny model down many times over when other processes share them.
        code = ("import sys, torch\ntorch.set_num_threads(1)\ntorch.set_num_threads = lambda n: None\n"
                "from memtrain.config import load_recipe\nfrom memtrain.launcher.train import train\n"
                "for path in sys.argv[1:]:\n    train(load_recipe(path))\n")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RANK", "LOCAL_", "WORLD_SIZE", "MASTER_", "SLURM_", "TORCHELASTIC"))}
        out = subprocess.run([sys.executable, "-c", code, str(mem), str(plain)], cwd=REPO, capture_output=True,
                             text=True, timeout=600, env={**env, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-5000:]
        yield root, mem, plain


def _eval(capsys, *args: str) -> tuple[int, str, str]:
    from memtrain.launcher.cli import main

    capsys.readouterr()
    code = main(["eval", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_eval_memory_run(runs, capsys):
    from memtrain.data.longtail import probes

    root, mem, _ = runs
    code, out, err = _eval(capsys, mem, "--batches", "3")
    assert code == 0, err
    report = json.loads((root / "runs" / "mem" / "eval" / "global_step6.json").read_text())
    modes = ["fetched", "generic", "blocked", "corrupt_from_level_2", "corrupt_from_level_1"]
    assert report["modes"] == modes and report["checkpoint"]["step"] == 6
    ppl = report["perplexity"]
    assert set(ppl) == {"fetched", "generic"}
    assert all(math.isfinite(v["perplexity"]) and v["perplexity"] > 1 and v["batches"] == 3 for v in ppl.values())
    assert ppl["fetched"]["tokens"] == ppl["generic"]["tokens"] > 0
    assert ppl["fetched"]["perplexity"] != ppl["generic"]["perplexity"]  # the memories were trained
    n = len(probes(0))
    assert report["probes"]["count"] == n
    assert set(report["probes"]["modes"]) == set(modes)
    for mode, acc in report["probes"]["modes"].items():
        assert acc["all"]["count"] == n
        assert 0.0 <= acc["all"]["accuracy"] <= 1.0
        assert sum(b["count"] for b in acc["buckets"].values()) == n
        assert sum(k["count"] for k in acc["kinds"].values()) == n
        assert set(acc["kinds"]) == {"atomic_number", "symbol", "alpha_2", "alpha_3", "numeric"}
        for group in [*acc["buckets"].values(), *acc["kinds"].values()]:
            assert group["count"] > 0 and 0.0 <= group["accuracy"] <= 1.0
            assert group["correct"] == round(group["accuracy"] * group["count"])
    lines = out.splitlines()
    assert lines[1].split() == ["mode", "val", "ppl", "all", "head", "torso", "tail"]
    assert [line.split()[0] for line in lines[2:7]] == modes
    assert lines[-1] == f"wrote {root / 'runs' / 'mem' / 'eval' / 'global_step6.json'}"

    # --out, a checkpoint folder, and modes of one's choice
    target = root / "elsewhere" / "mem.json"
    code, out, err = _eval(capsys, mem, f"checkpoint={root / 'runs' / 'mem' / 'checkpoints' / 'global_step6'}",
                           "--out", target, "--batches", "1", "--modes", "generic,none")
    assert code == 0, err
    report = json.loads(target.read_text())
    assert report["modes"] == ["generic", "none"] and set(report["perplexity"]) == {"generic", "none"}


def test_eval_memoryless_run(runs, capsys):
    root, _, plain = runs
    code, out, err = _eval(capsys, plain)
    assert code == 0, err
    report = json.loads((root / "runs" / "plain" / "eval" / "global_step6.json").read_text())
    assert report["modes"] == ["none"] and report["memory"] is None
    assert set(report["perplexity"]) == {"none"} and math.isfinite(report["perplexity"]["none"]["perplexity"])
    assert report["perplexity"]["none"]["batches"] == 2  # train.eval.batches
    assert set(report["probes"]["modes"]) == {"none"}
    assert 0.0 <= report["probes"]["modes"]["none"]["all"]["accuracy"] <= 1.0


def test_eval_names_a_tree_that_changed_after_prepare(runs, capsys, tmp_path):
    """The probes descend the prepared tree: a tree whose bytes changed after prepare (one bit, the same size) is
    one line naming it and the fix, checked against meta.json's record before the tree is read."""
    root, mem, _ = runs
    copy = tmp_path / "data"
    shutil.copytree(root / "data", copy)
    tree = copy / "tree.safetensors"
    data = bytearray(tree.read_bytes())
    data[-5] ^= 0x01
    tree.write_bytes(bytes(data))
    out_file = tmp_path / "never.json"
    code, out, err = _eval(capsys, mem, f"data.dir={copy}", "--batches", "1", "--modes", "fetched", "--out", out_file)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"memtrain: {tree}: xxh64 checksum ") and "`memtrain prepare RECIPE --force`" in err
    assert not out_file.exists()


def test_eval_checks_the_val_shards_before_it_reads_them(runs, capsys, tmp_path):
    """Perplexity reads the val split: a val shard changed after prepare is one line naming it, as training's check
    says it (before: an IndexError traceback from the embedding, or, where the bytes stayed inside the vocabulary,
    a wrong perplexity without a word). Damage to a train shard does not stop eval, which does not read it."""
    from memtrain.data.verify import shard_files

    root, mem, _ = runs
    copy = tmp_path / "data"
    shutil.copytree(root / "data", copy)
    files = [p for p, _, _ in shard_files(copy)]
    val = next(p for p in files if p.relative_to(copy).parts[0] == "val")
    train = next(p for p in files if p.relative_to(copy).parts[0] == "train")
    data = bytearray(train.read_bytes())
    data[len(data) // 2] ^= 0xFF
    train.write_bytes(bytes(data))
    code, _, err = _eval(capsys, mem, f"data.dir={copy}", "--batches", "1", "--modes", "fetched",
                         "--out", tmp_path / "ok.json")
    assert code == 0, err
    data = bytearray(val.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64
    val.write_bytes(bytes(data))
    out_file = tmp_path / "never.json"
    code, out, err = _eval(capsys, mem, f"data.dir={copy}", "--batches", "1", "--modes", "fetched", "--out", out_file)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"memtrain: the prepared data in {copy} is damaged: {val.relative_to(copy).as_posix()}: "
                          "xxh64 checksum ") and "`memtrain prepare RECIPE --force`" in err
    assert not out_file.exists()
    # --batches 0 computes no perplexity and reads no val shard: the probes still run
    code, _, err = _eval(capsys, mem, f"data.dir={copy}", "--batches", "0", "--modes", "fetched",
                         "--out", tmp_path / "probes.json")
    assert code == 0, err


def test_eval_names_a_users_own_tokenizer_that_changed_after_prepare(runs, capsys, tmp_path):
    """The probes are encoded with the tokenizer meta.json names. One of the user's own (an absolute path, whose
    bytes are not checked) replaced by another of the same vocabulary size is one line: its fingerprint differs.
    Before, the probes were encoded into other ids and scored without a word."""
    from memtrain.data.builtin import builtin_documents
    from memtrain.data.tokenizer import SentencePieceTokenizer

    root, mem, _ = runs
    copy = tmp_path / "data"
    shutil.copytree(root / "data", copy)
    own = tmp_path / "own.model"
    meta = json.loads((copy / "meta.json").read_text())
    SentencePieceTokenizer.train(iter(builtin_documents(0)[::5]), own, meta["vocab_size"], "bpe", seed=3,
                                 byte_fallback=False)
    (copy / "meta.json").write_text(json.dumps({**meta, "tokenizer": str(own)}))
    out_file = tmp_path / "never.json"
    code, out, err = _eval(capsys, mem, f"data.dir={copy}", "--batches", "1", "--modes", "fetched", "--out", out_file)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"memtrain: tokenizer '{own}' is not the one {copy} was prepared with: ") and "--force" in err
    assert not out_file.exists()


def test_eval_with_remote_data_fetches_the_tree_and_tokenizer(runs, capsys, tmp_path):
    """With data.remote the run's cache holds only meta.json (in its data's folder); eval fetches the tokenizer and
    tree there (before, the probes stopped: "tokenizer ... does not exist") and reports what eval on the local
    folder reports."""
    root, mem, _ = runs
    reports = {}
    for name, where in (("local", []), ("remote", [f"data.remote={root / 'data'}",
                                                  f"data.cache_dir={tmp_path / 'cache'}"])):
        target = tmp_path / f"{name}.json"
        code, out, err = _eval(capsys, mem, *where, "--batches", "1", "--modes", "fetched,generic", "--out", target)
        assert code == 0, err
        reports[name] = json.loads(target.read_text())
    (folder,) = (tmp_path / "cache").glob("data-*")  # the folder of the remote meta.json's data
    cached = {p.name for p in folder.iterdir()}
    assert {"meta.json", "tokenizer.model", "tree.safetensors"} <= cached  # and the val shards Streaming fetched
    for key in ("perplexity", "probes"):
        assert reports["remote"][key] == reports["local"][key]


def _rehash(folder: Path, name: str) -> None:
    """Record file ``name``'s new size and checksum in ``folder``'s COMPLETE.json (as if written so)."""
    from memtrain.parallel import checkpoint_folder

    marker = json.loads((folder / "COMPLETE.json").read_text())
    marker["files"].update(checkpoint_folder.hash_files(folder, [name]))
    (folder / "COMPLETE.json").write_text(json.dumps(marker))


def test_eval_user_errors(runs, capsys):
    import shutil

    root, mem, plain = runs
    # A checkpoint with a weight missing (its checksum recorded again): loading is strict.
    damaged = root / "runs" / "damaged" / "checkpoints" / "global_step6"
    if not damaged.exists():
        shutil.copytree(root / "runs" / "mem" / "checkpoints" / "global_step6", damaged)
        states = torch.load(damaged / "mp_rank_00_model_states.pt", weights_only=True)
        del states["module"]["blocks.0.ffn.w1.weight"]
        torch.save(states, damaged / "mp_rank_00_model_states.pt")
        _rehash(damaged, "mp_rank_00_model_states.pt")
    # A checkpoint with bytes overwritten inside a file (same size): its checksum differs.
    overwritten = root / "runs" / "overwritten" / "checkpoints" / "global_step6"
    if not overwritten.exists():
        shutil.copytree(root / "runs" / "mem" / "checkpoints" / "global_step6", overwritten)
        with open(overwritten / "mp_rank_00_model_states.pt", "r+b") as f:
            f.seek(2000)
            f.write(bytes(64))
    before = sorted(p for p in root.rglob("*"))
    cases = [
        ((mem, f"run.dir={root / 'runs' / 'empty'}"), "no complete checkpoint"),  # nothing trained there
        ((mem, f"checkpoint={root / 'runs' / 'plain'}"), "was written with memory"),  # another memory setting
        ((mem, "memory.levels=[4,4]"), "memory"),  # the run's own checkpoint, other memory sizes
        ((plain, "--modes", "fetched"), "no memories"),  # a memory-less model asked for memory modes
        ((plain, f"data.dir={root / 'nodata'}"), "no prepared data"),
        ((mem, f"checkpoint={damaged}"), "missing ['blocks.0.ffn.w1.weight']"),
        ((mem, f"checkpoint={overwritten}"), "is damaged: mp_rank_00_model_states.pt has xxh64 "),
        # --out checked before the evaluation: a folder, a path through a file (before: found only when the
        # report was written at the end)
        ((mem, "--out", root), f"--out {root} is a folder; give the path of the file to write, e.g. "
                               f"{root / 'report.json'}"),
        ((mem, "--out", mem / "x.json"), f"--out {mem / 'x.json'}: {mem} is a file, not a folder"),
    ]
    for args, message in cases:
        code, out, err = _eval(capsys, *args)
        assert code == 2, (args, out, err)
        assert len(err.strip().splitlines()) == 1 and message in err, (args, err)
        assert out == ""
    assert sorted(p for p in root.rglob("*")) == before  # nothing written


def test_eval_out_where_this_user_may_not_write_is_refused_before_the_evaluation(runs, capsys, tmp_path, monkeypatch):
    """--out in a folder this user may not write in: refused before any model is loaded (before: after the whole
    evaluation, with a PermissionError traceback). The probe file is created and removed in the nearest folder of
    the path that exists; nothing is left behind."""
    import errno
    import tempfile

    from memtrain.eval import evaluate
    from memtrain.launcher.cli import check_out_file

    root, mem, _ = runs
    locked = tmp_path / "locked"
    locked.mkdir()
    real = tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):
        if dir is not None and str(dir).startswith(str(locked)):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, out, err = _eval(capsys, mem, "--out", locked / "new" / "report.json")
    assert code == 2 and out == ""
    target = locked / "new" / "report.json"
    assert err == (f"memtrain: --out {target} cannot be written: Permission denied in {locked}; choose another "
                   "--out, or fix that folder (its permissions, or space on its file system)\n")
    assert list(locked.iterdir()) == []
    monkeypatch.setattr(tempfile, "mkstemp", real)
    probe = tmp_path / "ok" / "report.json"
    check_out_file(str(probe))  # a writable place: nothing made, nothing left
    assert not (tmp_path / "ok").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["locked"]
