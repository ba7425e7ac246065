"""Tests of the data path: built-in corpus, sources, tokenizers, prepare, packing and loaders (CPU, fast)."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from memtrain.config import Recipe, recipe_from_dict
from memtrain.data.builtin import builtin_documents, country_facts, element_facts
from memtrain.data.loader import Collate, LoaderIterator, build_loader, read_meta
from memtrain.data.prepare import prepare, split_documents
from memtrain.data.sources import ReadStats, read_documents
from memtrain.data.tokenizer import SentencePieceTokenizer, load_tokenizer
from memtrain.errors import DataError

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 32
GLOBAL_SEQS = 8  # sequences per optimizer step


def make_recipe(data_dir: Path, sources: list[str], **data) -> Recipe:
    tokenizer = data.pop("tokenizer", {"vocab_size": 300, "byte_fallback": False})
    return recipe_from_dict({
        "run": {"name": "t", "seed": 7},
        "model": {"vocab_size": 512, "max_seq_len": 64, "d_model": 64, "n_heads": 2, "ffn_dim": 128},
        "data": {"dir": str(data_dir), "sources": sources, "seq_len": SEQ_LEN, "val_fraction": 0.1,
                 "tokenizer": tokenizer, "shard_size_limit": 4096, **data},
        "train": {"global_batch_tokens": SEQ_LEN * GLOBAL_SEQS, "micro_batch_size": 2, "max_steps": 10},
    })


def write_jsonl(path: Path, texts: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "id": 0}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    docs = builtin_documents(0)
    return docs[::100]  # ~116 documents of every kind, ~20 KB


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus):
    """One prepared data folder shared by the loader tests (never modified by them)."""
    root = tmp_path_factory.mktemp("prepared")
    src = write_jsonl(root / "docs.jsonl", corpus)
    recipe = make_recipe(root / "data", [str(src)])
    meta = prepare(recipe)
    return recipe, meta


# --------------------------------------------------------------------------------------------------
# built-in corpus


def test_builtin_corpus_is_deterministic_and_factual():
    docs = builtin_documents(0)
    assert docs == builtin_documents(0)
    assert docs != builtin_documents(1)
    assert 5_000 < len(docs) < 20_000
    assert 1_000_000 < sum(len(d.encode()) for d in docs) < 3_000_000

    iron = next(e for e in element_facts() if e.name == "Iron")
    assert iron.facts["symbol"] == "Fe" and iron.facts["number"] == 26
    assert abs(iron.facts["mass"] - 55.845) < 0.01
    iron_docs = [d for d in docs if re.search(r"\biron\b", d, re.I) and re.search(r"\bFe\b", d)]
    assert len(iron_docs) == 2  # one entity, rendered twice
    assert all("26" in d and "55.845" in d for d in iron_docs)

    germany = next(e for e in country_facts() if e.name == "Germany")
    assert (germany.facts["alpha_2"], germany.facts["alpha_3"], germany.facts["numeric"]) == ("DE", "DEU", "276")
    germany_docs = [d for d in docs if "Germany" in d and "DEU" in d]
    assert germany_docs and all("276" in d for d in germany_docs)


# --------------------------------------------------------------------------------------------------
# sources


def test_read_documents_formats_and_empty_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("First file.\nIt has two lines.", encoding="utf-8")
    (tmp_path / "b.txt").write_text("  \n\t", encoding="utf-8")  # whitespace only
    write_jsonl(tmp_path / "c.jsonl", ["json one", "", "   ", None, "json two"])
    pq.write_table(pa.table({"text": ["pq one", "", "pq two"]}), tmp_path / "d.parquet")

    stats = ReadStats()
    docs = list(read_documents([str(tmp_path / "*.txt"), str(tmp_path / "c.jsonl"), str(tmp_path / "d.parquet")],
                               "text", stats))
    assert docs == ["First file.\nIt has two lines.", "json one", "json two", "pq one", "pq two"]
    assert stats.documents == 5 and stats.skipped_empty == 5
    assert [Path(f).name for f in stats.files] == ["a.txt", "b.txt", "c.jsonl", "d.parquet"]

    write_jsonl(tmp_path / "e.jsonl", [])
    (tmp_path / "e.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    assert list(read_documents([str(tmp_path / "e.jsonl")], "body")) == ["x"]

    # empty files hold no documents, as an empty .txt (before: StopIteration from the JSON reader, ArrowInvalid
    # "BatchSize must be greater than 0" from parquet's, each stopping the whole prepare)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "f.jsonl").write_text("")
    (tmp_path / "empty" / "g.json").write_text("\n  \n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty" / "h.parquet")
    (tmp_path / "empty" / "i.txt").write_text("")
    stats = ReadStats()
    assert list(read_documents([str(tmp_path / "empty" / "*"), str(tmp_path / "e.jsonl")], "body", stats)) == ["x"]
    assert stats.documents == 1 and len(stats.files) == 5


def test_read_documents_errors(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"fine text \xff\xfe then garbage")
    with pytest.raises(DataError, match=r"bad\.txt is not valid UTF-8"):
        list(read_documents([str(tmp_path / "bad.txt")], "text"))
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "bad \xff"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl is not valid UTF-8"):
        list(read_documents([str(tmp_path / "bad.jsonl")], "text"))
    with pytest.raises(DataError, match=r"no files match .*nothing.*check data\.sources"):
        list(read_documents([str(tmp_path / "nothing" / "*.jsonl")], "text"))
    with pytest.raises(DataError, match="no files match"):
        list(read_documents([str(tmp_path / "missing.txt")], "text"))
    write_jsonl(tmp_path / "doc.jsonl", ["x"])
    with pytest.raises(DataError, match=r"doc\.jsonl has a record without the field 'content'"):
        list(read_documents([str(tmp_path / "doc.jsonl")], "content"))
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported extension"):
        list(read_documents([str(tmp_path / "t.csv")], "text"))
    # a file named twice (a repeated entry, overlapping globs, another path to it) would be read twice, its
    # documents in both splits; so would a built-in corpus named twice
    doc = str(tmp_path / "doc.jsonl")
    for sources, named in (([doc, doc], f"{doc!r} is named twice"),
                           ([doc, str(tmp_path / "*.jsonl")], f"{doc!r} is named twice"),
                           ([doc, str(tmp_path / "." / "doc.jsonl")], "is named twice"),
                           (["builtin", "builtin"], "'builtin' is named twice")):
        with pytest.raises(DataError, match=re.escape(named) + r" by data.sources .*land in both splits"):
            list(read_documents(sources, "text"))


# --------------------------------------------------------------------------------------------------
# tokenizers


def test_sentencepiece_training_is_reproducible(tmp_path, corpus):
    a = SentencePieceTokenizer.train(corpus, tmp_path / "a.model", 300, "unigram", seed=3, byte_fallback=False)
    b = SentencePieceTokenizer.train(corpus, tmp_path / "sub" / "b.model", 300, "unigram", seed=3, byte_fallback=False)
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "sub" / "b.model").read_bytes()
    text = "Iron (Fe) has atomic number 26.\nSecond line."
    assert a.decode(a.encode(text)) == text  # identity normalisation and a newline piece
    assert a.encode_batch([text, "x"]) == [b.encode(text), b.encode("x")]
    assert a.vocab_size == 300 and a.eot_id == 2
    assert isinstance(load_tokenizer(tmp_path / "a.model"), SentencePieceTokenizer)
    with pytest.raises(DataError, match=r"data\.tokenizer\.vocab_size"):
        SentencePieceTokenizer.train(corpus[:5], tmp_path / "c.model", 5000, seed=3, byte_fallback=False)
    with pytest.raises(DataError, match="byte_fallback: false"):  # 256 byte pieces do not fit in 300
        SentencePieceTokenizer.train(corpus, tmp_path / "d.model", 300, seed=3, byte_fallback=True)
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.model")


def test_sentencepiece_model_does_not_depend_on_the_host(tmp_path, corpus, monkeypatch):
    """The same documents give the same model on a 1-core and a 64-core host. SentencePiece's unigram trainer
    sums per-thread expected counts in floating point, so its thread count must not follow the host's CPUs
    (it did: os.cpu_count() up to 16, and 1, 2, 4 and 16 threads gave four different models)."""
    import sentencepiece as spm

    from memtrain.data import tokenizer as tok

    threads = []
    real_train = spm.SentencePieceTrainer.train

    def train(**kwargs):
        threads.append(kwargs["num_threads"])
        return real_train(**kwargs)

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", train)
    models = []
    for i, cpus in enumerate((1, 64)):
        monkeypatch.setattr(os, "cpu_count", lambda cpus=cpus: cpus)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cpus=cpus: set(range(cpus)), raising=False)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        SentencePieceTokenizer.train(corpus, tmp_path / f"{i}.model", 300, "unigram", seed=3)
        models.append((tmp_path / f"{i}.model").read_bytes())
        # Encoding follows the host (its ids do not depend on the thread count), up to 16 threads.
        assert SentencePieceTokenizer(tmp_path / f"{i}.model")._threads == min(cpus, 16)
    assert threads == [tok.TRAIN_THREADS] * 2
    assert models[0] == models[1]
    # The thread count matters, which is why it is pinned: another count gives another model of this corpus.
    monkeypatch.setattr(tok, "TRAIN_THREADS", 16)
    SentencePieceTokenizer.train(corpus, tmp_path / "16.model", 300, "unigram", seed=3)
    assert (tmp_path / "16.model").read_bytes() != models[0]


def test_hf_tokenizer_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>").save_pretrained(tmp_path / "hf")
    hf = load_tokenizer(tmp_path / "hf")
    assert hf.eot_id == 1 and hf.vocab_size == 4
    assert hf.encode("hello world") == [2, 3] and hf.encode_batch(["world", "hello"]) == [[3], [2]]
    # folders that are no tokenizer: one short line each (before: an AttributeError traceback for an empty one,
    # a 5 KB line listing every model type transformers knows for a lone tokenizer.json)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"tokenizer folder .*empty is empty; point data.tokenizer.path"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "lone").mkdir()
    (tmp_path / "lone" / "tokenizer.json").write_text((tmp_path / "hf" / "tokenizer.json").read_text())
    (tmp_path / "lone" / "config.json").write_text("{}")
    with pytest.raises(DataError) as err:
        load_tokenizer(tmp_path / "lone")
    assert str(err.value).startswith(f"could not load a Hugging Face tokenizer from {tmp_path / 'lone'} (")
    assert len(str(err.value)) < 600 and "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------------
# prepare


def test_a_data_dir_that_is_a_link_is_prepared_where_it_points(tmp_path, corpus):
    """data.dir as a symbolic link (to a larger disk, say): the folder is built beside its target and renamed into
    it, and the link stays. Before, the link itself was replaced by a new folder, the target left empty and a
    dangling link left behind."""
    src = write_jsonl(tmp_path / "docs.jsonl", corpus)
    target = tmp_path / "disk" / "data"
    target.parent.mkdir()
    (tmp_path / "data").symlink_to(target)
    recipe = make_recipe(tmp_path / "data", [str(src)])
    for force in (False, True):
        assert prepare(recipe, force=force)["status"] == "prepared"
        assert (tmp_path / "data").is_symlink() and (target / "meta.json").is_file()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "disk", "docs.jsonl"]
        assert sorted(p.name for p in target.parent.iterdir()) == ["data"]


def test_prepare_end_to_end_and_idempotent(tmp_path, corpus):
    src = write_jsonl(tmp_path / "docs.jsonl", corpus + ["", "  "])
    recipe = make_recipe(tmp_path / "data", [str(src)])
    meta = prepare(recipe)
    d = tmp_path / "data"
    assert meta["status"] == "prepared" and meta["tokens_per_s"] > 0 and meta["documents_per_s"] > 0
    assert (d / "meta.json").is_file() and (d / "tokenizer.model").is_file()
    assert (d / "train" / "index.json").is_file() and (d / "val" / "index.json").is_file()
    assert len(list((d / "train").glob("shard.*.mds"))) > 1  # shard_size_limit splits it
    c = meta["counts"]
    assert c["documents"] == len(corpus) and c["skipped_empty"] == 2
    assert c["val_documents"] == round(len(corpus) * 0.1) and c["train_documents"] + c["val_documents"] == len(corpus)
    assert c["train_samples"] * (SEQ_LEN + 1) + c["train_dropped_tokens"] == c["train_tokens"]
    assert (meta["train_samples"], meta["val_samples"]) == (c["train_samples"], c["val_samples"])
    assert meta["seq_len"] == SEQ_LEN and meta["sample_len"] == SEQ_LEN + 1 and meta["dtype"] == "uint16"
    on_disk = read_meta(d, recipe)
    run_only = ("status", "seconds", "documents_per_s", "tokens_per_s")
    assert on_disk == {k: v for k, v in meta.items() if k not in run_only}
    assert load_tokenizer(meta["tokenizer"], base=d).vocab_size == meta["vocab_size"] == 300
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".data.")]  # no temporary folders left

    mtimes = {p: p.stat().st_mtime_ns for p in d.rglob("*")}
    again = prepare(recipe)
    assert again["status"] == "already prepared" and again["fingerprint"] == meta["fingerprint"]
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*")} == mtimes

    changed = make_recipe(d, [str(src)], val_fraction=0.2)
    with pytest.raises(DataError, match="--force"):
        prepare(changed)
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*")} == mtimes
    forced = prepare(changed, force=True)
    assert forced["status"] == "prepared" and forced["fingerprint"] != meta["fingerprint"]
    assert read_meta(d)["counts"]["val_documents"] == round(len(corpus) * 0.2)

    # A folder missing the tokenizer its meta.json names is not "already prepared": one error naming the file
    # and --force, which writes it again.
    (d / "tokenizer.model").unlink()
    with pytest.raises(DataError, match=r"prepared with these settings but tokenizer\.model is missing from it; "
                                        r"pass --force to prepare it again$"):
        prepare(changed)
    assert prepare(changed, force=True)["status"] == "prepared" and (d / "tokenizer.model").is_file()


def test_prepare_again_after_a_source_changed_is_one_error_not_already_prepared(tmp_path, corpus):
    """meta.json records each source file's size, time and xxh64 as it was before it was read. Preparing again
    with the same settings after a file was edited (another size, or the same size with other contents) or a glob
    matches a new file is one error naming the file and --force, not "already prepared" over the old data. A file
    only touched, or gone, changes nothing; nothing is written either way, and --force records the new state."""
    import os
    import time

    from memtrain.data.prepare import SOURCE_FILES

    folder = tmp_path / "corpus"
    folder.mkdir()
    a = write_jsonl(folder / "a.jsonl", corpus[:60])
    b = write_jsonl(folder / "b.jsonl", corpus[60:])
    recipe = make_recipe(tmp_path / "data", [str(folder / "*.jsonl")])
    meta = prepare(recipe)
    assert sorted(meta[SOURCE_FILES]) == [str(a), str(b)]
    assert meta[SOURCE_FILES][str(a)]["bytes"] == a.stat().st_size
    d = tmp_path / "data"
    mtimes = {p: p.stat().st_mtime_ns for p in d.rglob("*")}

    os.utime(a, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: same bytes
    assert prepare(recipe)["status"] == "already prepared"
    text = a.read_text()
    flipped = text.replace("a", "e", 1)
    assert flipped != text and len(flipped.encode()) == len(text.encode())
    a.write_text(flipped)  # same size, other contents
    with pytest.raises(DataError, match=rf"data.sources changed since: {a} has other contents; pass --force"):
        prepare(recipe)
    a.write_text(text + '{"text": "one more document about nothing in particular"}\n')
    was = meta[SOURCE_FILES][str(a)]["bytes"]
    with pytest.raises(DataError, match=rf"{a} has {a.stat().st_size} bytes, not {was}"):
        prepare(recipe)
    a.write_text(text)
    c = write_jsonl(folder / "c.jsonl", corpus[:3])
    with pytest.raises(DataError, match=rf"{c} is new"):
        prepare(recipe)
    c.unlink()
    b.unlink()  # gone: the prepared data stands without it
    assert prepare(recipe)["status"] == "already prepared"
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*")} == mtimes

    write_jsonl(b, corpus[60:] + ["a document added to b before preparing again"])
    with pytest.raises(DataError, match="changed since"):
        prepare(recipe)
    forced = prepare(recipe, force=True)
    assert forced["status"] == "prepared" and forced[SOURCE_FILES][str(b)]["bytes"] == b.stat().st_size
    assert forced["counts"]["documents"] == len(corpus) + 1
    assert prepare(recipe)["status"] == "already prepared"


def test_prepare_failure_leaves_no_data_dir(tmp_path, corpus, monkeypatch):
    import streaming

    real = streaming.MDSWriter

    class FailingWriter(real):
        def write(self, sample):
            if getattr(self, "_n", 0) >= 5:
                raise OSError("disk full")
            self._n = getattr(self, "_n", 0) + 1
            super().write(sample)

    src = write_jsonl(tmp_path / "docs.jsonl", corpus)
    recipe = make_recipe(tmp_path / "data", [str(src)])
    monkeypatch.setattr(streaming, "MDSWriter", FailingWriter)
    with pytest.raises(OSError, match="disk full"):
        prepare(recipe)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]

    # a failed --force rebuild keeps the data that was there
    monkeypatch.setattr(streaming, "MDSWriter", real)
    meta = prepare(recipe)
    monkeypatch.setattr(streaming, "MDSWriter", FailingWriter)
    with pytest.raises(OSError, match="disk full"):
        prepare(make_recipe(tmp_path / "data", [str(src)], val_fraction=0.3), force=True)
    assert read_meta(tmp_path / "data")["fingerprint"] == meta["fingerprint"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "docs.jsonl"]


def test_prepare_user_errors(tmp_path, corpus, prepared):
    recipe, meta = prepared
    tokenizer = str(recipe.data_dir / meta["tokenizer"])  # a 300-token model
    src = write_jsonl(tmp_path / "short.jsonl", ["tiny", "docs"])
    with pytest.raises(DataError, match=r"only \d+ tokens.*data\.seq_len"):
        prepare(make_recipe(tmp_path / "d1", [str(src)], val_fraction=0.0, tokenizer={"path": tokenizer}))
    assert not (tmp_path / "d1").exists()

    small = recipe_from_dict({**recipe.to_dict(), "model": {**recipe.to_dict()["model"], "vocab_size": 256},
                              "data": {**recipe.to_dict()["data"], "dir": str(tmp_path / "d2"),
                                       "tokenizer": {"path": tokenizer}}})
    with pytest.raises(DataError, match=r"model\.vocab_size"):
        prepare(small)

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a prepared memtrain data folder"):
        prepare(make_recipe(tmp_path / "mine", [str(src)]), force=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_packing_preserves_documents_in_order(prepared, corpus):
    from conftest import streaming_dataset

    recipe, meta = prepared
    tok = load_tokenizer(meta["tokenizer"], base=recipe.data_dir)
    train_idx, val_idx = split_documents(len(corpus), recipe.data.val_fraction, recipe.run.seed)
    for split, idx in (("train", train_idx), ("val", val_idx)):
        expected = np.concatenate([np.array(tok.encode(corpus[i]) + [tok.eot_id]) for i in idx])
        ds = streaming_dataset(local=str(recipe.data_dir / split), remote=None, shuffle=False, batch_size=1)
        stored = np.concatenate([ds[i]["tokens"] for i in range(ds.num_samples)]).astype(np.int64)
        n = meta["counts"][f"{split}_samples"]
        assert ds.num_samples == n and len(stored) == n * (SEQ_LEN + 1)
        assert len(expected) - len(stored) == meta["counts"][f"{split}_dropped_tokens"] < SEQ_LEN + 1
        np.testing.assert_array_equal(stored, expected[:len(stored)])
        assert tok.decode(stored.tolist()).startswith(tok.decode(tok.encode(corpus[idx[0]])))
        del ds
    assert sorted(train_idx + val_idx) == list(range(len(corpus))) and not set(train_idx) & set(val_idx)


# --------------------------------------------------------------------------------------------------
# collate and loaders


def test_collate_on_hand_made_samples():
    eot = 2
    samples = [{"tokens": np.array([5, 6, 2, 7, 2, 2, 8, 9], np.uint16)},
               {"tokens": np.array([2, 4, 4, 4, 4, 4, 4, 2], np.uint16)}]
    batch = Collate(eot)(samples)
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (2, 7)
    assert batch["input_ids"].tolist() == [[5, 6, 2, 7, 2, 2, 8], [2, 4, 4, 4, 4, 4, 4]]
    # EOT -> EOT is padding (text never has it: empty documents are skipped); its loss is ignored.
    assert batch["labels"].tolist() == [[6, 2, 7, 2, -100, 8, 9], [4, 4, 4, 4, 4, 4, 2]]
    assert batch["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert "cluster_ids" not in batch


def test_collate_cluster_prefixed_samples():
    eot, k, p = 2, 4, 3  # 64 leaves
    samples = [{"tokens": np.array([0, 5, 6, 2, 7, 2], np.uint16)},
               {"tokens": np.array([63, 2, 8, 2, 2, 2], np.uint16)},
               {"tokens": np.array([27, 9, 9, 9, 9, 9], np.uint16)}]
    batch = Collate(eot, k, p)(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 2, 7], [2, 8, 2, 2], [9, 9, 9, 9]]
    assert batch["labels"].tolist() == [[6, 2, 7, 2], [8, 2, -100, -100], [9, 9, 9, 9]]  # EOT padding ignored
    # leaf 27 = 1*16 + 2*4 + 3 -> level ids (1, 6, 27); leaf 63 -> (3, 15, 63)
    assert batch["cluster_ids"].tolist() == [[0, 0, 0], [3, 15, 63], [1, 6, 27]]
    with pytest.raises(DataError, match=r"cluster id 64 lies outside \[0, 64\)"):
        Collate(eot, k, p)([{"tokens": np.array([64, 5, 6, 2, 7, 2], np.uint16)}])


def test_read_meta_errors(tmp_path, prepared):
    with pytest.raises(DataError, match="no prepared data in .*memtrain prepare"):
        read_meta(tmp_path / "none")
    recipe, _ = prepared
    with pytest.raises(DataError, match=r"data\.seq_len"):
        read_meta(recipe.data_dir, recipe_from_dict(recipe.to_dict(), ["data.seq_len=64"]))


def rows(batch) -> list[tuple]:
    return [tuple(r) for r in batch["input_ids"].tolist()]


def take(it, n) -> list[list[tuple]]:
    return [rows(next(it)) for _ in range(n)]


def test_train_and_val_loaders_in_one_process(prepared):
    recipe, meta = prepared
    train = build_loader(recipe, "train", 2)
    val = build_loader(recipe, "val", 3)
    batch = next(iter(train))
    assert set(batch) == {"input_ids", "labels", "doc_ids", "sample_index"} and batch["input_ids"].shape == (2, SEQ_LEN)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    # each row's global sample index names it: random access by that index reads the same tokens
    for row, index in zip(batch["input_ids"], batch["sample_index"].tolist()):
        assert torch.equal(torch.as_tensor(train.dataset[index]["tokens"][:SEQ_LEN].astype("int64")), row)
    val_batches = list(val)
    assert sum(len(b["input_ids"]) for b in val_batches) == meta["counts"]["val_samples"]
    assert torch.cat([b["sample_index"] for b in val_batches]).tolist() == list(range(meta["counts"]["val_samples"]))
    assert [rows(b) for b in val] == [rows(b) for b in val_batches]  # validation order is fixed
    # train epochs hold whole global batches; every micro-batch is full
    epoch = list(train)
    assert len(epoch) * 2 == meta["counts"]["train_samples"] // GLOBAL_SEQS * GLOBAL_SEQS
    del train, val, batch, epoch


@pytest.mark.parametrize("where", ["mid-epoch", "epoch end", "after epoch end"])
def test_loader_resume_matches_uninterrupted(prepared, where):
    recipe, meta = prepared
    per_epoch = meta["counts"]["train_samples"] // GLOBAL_SEQS * GLOBAL_SEQS // 2  # micro-batches of 2
    stop = {"mid-epoch": per_epoch // 2, "epoch end": per_epoch, "after epoch end": per_epoch + 1}[where]
    it = LoaderIterator(build_loader(recipe, "train", 2))
    reference = take(it, 2 * per_epoch + 5)
    assert reference[:per_epoch] != reference[per_epoch:2 * per_epoch]  # epochs are reshuffled
    del it
    gc.collect()

    it = LoaderIterator(build_loader(recipe, "train", 2))
    assert take(it, stop) == reference[:stop]
    state = json.loads(json.dumps(it.state_dict()))  # must survive a JSON checkpoint
    del it
    gc.collect()
    resumed = LoaderIterator(build_loader(recipe, "train", 2))
    resumed.load_state_dict(state)
    assert take(resumed, len(reference) - stop) == reference[stop:]

    # a resumed iterator's own state resumes correctly too
    again = LoaderIterator(build_loader(recipe, "train", 2))
    again.load_state_dict(resumed.state_dict())
    assert take(again, 3) == take(resumed, 3)


def test_loader_state_rejects_other_data(prepared):
    recipe, _ = prepared
    it = LoaderIterator(build_loader(recipe, "train", 2))
    state = it.state_dict()
    state["data_fingerprint"] = "0" * 16
    with pytest.raises(DataError, match="different data"):
        LoaderIterator(build_loader(recipe, "train", 2)).load_state_dict(state)
    next(it)
    with pytest.raises(RuntimeError):
        it.load_state_dict(it.state_dict())


@pytest.mark.parametrize("canonical_nodes", [1, 2])
def test_global_batches_do_not_depend_on_world_size(prepared, canonical_nodes):
    """Streaming's partition for simulated worlds: each step's global batch is the same sample set."""
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    base, _ = prepared
    recipe = recipe_from_dict(base.to_dict(), [f"data.num_canonical_nodes={canonical_nodes}"])
    loader = build_loader(recipe, "train", 2)
    ds = loader.dataset
    real = take(iter(LoaderIterator(loader)), 6)  # also sets Streaming's lazily chosen shuffle block size

    def steps(nodes: int, ranks: int, micro: int, epoch: int, done: int = 0) -> list[list[int]]:
        """Sorted sample ids of each optimizer step, resuming after ``done`` steps of the epoch."""
        ds.batch_size = micro
        ids = generate_work(ds.batching_method, ds, World(nodes, ranks, 1, 0), epoch, done * GLOBAL_SEQS)
        accum = GLOBAL_SEQS // (nodes * ranks * micro)
        micro_steps = [ids[:, :, 0, i, :] for i in range(ids.shape[3])]
        for m in micro_steps:  # ranks get disjoint, full micro-batches
            assert (m >= 0).all() and len(set(m.ravel().tolist())) == m.size
        return [sorted(np.concatenate([m.ravel() for m in micro_steps[s * accum:(s + 1) * accum]]).tolist())
                for s in range(len(micro_steps) // accum)]

    for epoch in (0, 1):
        reference = steps(1, 1, 2, epoch)
        assert len(reference) * GLOBAL_SEQS == ds.epoch_size
        for nodes, ranks, micro in [(1, 1, 4), (1, 2, 2), (1, 4, 2), (2, 2, 2), (1, 2, 4), (2, 1, 4)]:
            if nodes * ranks * micro <= GLOBAL_SEQS and (nodes <= canonical_nodes or nodes % canonical_nodes == 0):
                assert steps(nodes, ranks, micro, epoch) == reference, (nodes, ranks, micro)
                # resuming mid-epoch (checkpoints store the global sample offset) in another world
                assert steps(nodes, ranks, micro, epoch, done=3) == reference[3:], (nodes, ranks, micro)

    # the simulation is what the real single-rank loader does
    ds.batch_size = 2
    ids = generate_work(ds.batching_method, ds, World(1, 1, 1, 0), 0, 0)[0, 0, 0]
    assert real == [[tuple(ds[int(i)]["tokens"][:-1].tolist()) for i in b] for b in ids[:6]]


_RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    from memtrain.config import Recipe, recipe_from_dict
    from memtrain.data.loader import LoaderIterator, build_loader
    recipe = recipe_from_dict(json.loads(sys.argv[1]))
    it = LoaderIterator(build_loader(recipe, "train", int(sys.argv[2])))
    print(json.dumps([next(it)["input_ids"].tolist() for _ in range(int(sys.argv[3]))]))
""")


def _two_ranks(script: str, *argv: str) -> list:
    """Runs ``script`` as ranks 0 and 1 of a 2-rank world on this host (launcher variables, a free port); returns
    the JSON each printed last."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    args = [sys.executable, "-c", script, *argv]
    procs = [subprocess.Popen(args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_two_real_ranks_split_the_single_rank_batches(prepared):
    """Two processes with launcher variables vs one rank with twice the micro-batch: same global batches."""
    recipe, _ = prepared
    it = LoaderIterator(build_loader(recipe, "train", 4))
    single = [next(it)["input_ids"].tolist() for _ in range(8)]
    # (launched only now: Streaming picks shared-memory names by scanning, which is not atomic across jobs)
    outs = _two_ranks(_RANK_SCRIPT, json.dumps(recipe.to_dict()), "2", "8")
    for step in range(8):
        r0, r1 = outs[0][step], outs[1][step]
        assert not {tuple(x) for x in r0} & {tuple(x) for x in r1}
        assert sorted(map(tuple, r0 + r1)) == sorted(map(tuple, single[step]))


_SKEWED_SCAN_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    import streaming.base.shared.prefix as sp
    from memtrain.config import recipe_from_dict
    from memtrain.data.loader import LoaderIterator, build_loader
    from memtrain.parallel.dist import import_group_capturers
    import_group_capturers()  # before the group starts, so that destroy_process_group frees it
    dist.init_process_group("gloo")
    scan = sp._check_and_find
    # rank 1's scan sees /dev/shm one segment off from its leader's, as when another job's segment is created or
    # freed between the two scans
    sp._check_and_find = lambda *a, **k: scan(*a, **k) + dist.get_rank()
    it = LoaderIterator(build_loader(recipe_from_dict(json.loads(sys.argv[1])), "train", 2))
    print(json.dumps([next(it)["input_ids"].tolist() for _ in range(2)]))
    dist.destroy_process_group()
""")


def test_ranks_take_their_leaders_shared_memory_prefix_whatever_their_own_scan_found(prepared):
    """Streaming's ranks each scan /dev/shm for a free prefix and attach to what they found; when another job's
    segment comes or goes between the leader's scan and another rank's, that rank failed with 'shared memory
    prefix=N was not registered by local leader' (three 2-rank Slurm jobs on one host). memtrain has every rank
    take its leader's prefix: two gloo ranks whose scans disagree still build their loaders and split the batches."""
    recipe, _ = prepared
    outs = _two_ranks(_SKEWED_SCAN_SCRIPT, json.dumps(recipe.to_dict()))
    for r0, r1 in zip(*outs):
        assert not {tuple(x) for x in r0} & {tuple(x) for x in r1}  # one dataset, split between the ranks


_LOCK_SCRIPT = textwrap.dedent("""
    import sys, time
    from memtrain.data.loader import _host_prefix_lock
    with _host_prefix_lock():
        print("in", time.time(), flush=True)
        time.sleep(float(sys.argv[1]))
        print("out", time.time(), flush=True)
""")


def test_the_streaming_prefix_lock_is_one_per_host_whatever_each_jobs_tmpdir(tmp_path):
    """memtrain's sbatch gives each job its own TMPDIR; the host lock that serialises Streaming's choice of a
    shared-memory prefix must still be one per host. A process with another TMPDIR waits for the holder (it took
    the lock only once the first let go); under TMPDIR the lock was per job, and three Slurm jobs starting together
    on one node failed with ``FileExistsError: '/000001_locals'``."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    first = subprocess.Popen([sys.executable, "-c", _LOCK_SCRIPT, "8"], env={**env, "TMPDIR": str(tmp_path / "a")},
                             stdout=subprocess.PIPE, text=True)
    try:
        held = first.stdout.readline().split()
        assert held[0] == "in", held
        second = subprocess.run([sys.executable, "-c", _LOCK_SCRIPT, "0"], env={**env, "TMPDIR": str(tmp_path / "b")},
                                capture_output=True, text=True, timeout=120)
        released = first.stdout.readline().split()
    finally:
        first.wait(timeout=60)
    assert second.returncode == 0, second.stderr[-2000:]
    took = second.stdout.split()
    assert took[0] == "in" and float(took[1]) >= float(released[1]), (held, released, took)


_DEFERRED_SCRIPT = textwrap.dedent("""
    import sys
    import memtrain.data.indexed, memtrain.data.loader, memtrain.data.shards
    from streaming import MDSWriter, StreamingDataLoader, StreamingDataset
    import streaming
    heavy = [m for m in ("sklearn", "scipy", "transformers.generation", "streaming.text.c4",
                         "streaming.vision.cifar10", "streaming.multimodal.webvid") if m in sys.modules]
    print("heavy", heavy)
    from streaming.text import StreamingC4
    print("text", StreamingC4.__module__, type(streaming.text).__name__, type(sys.modules["streaming.text"]).__name__)
    print("vision", streaming.vision.StreamingCIFAR10.__module__, sorted(streaming.vision.__all__))
    import streaming.multimodal.webvid as webvid
    print("multimodal", webvid.StreamingInsideWebVid.__module__, streaming.multimodal.StreamingInsideWebVid is webvid.StreamingInsideWebVid)
    ns = {}
    exec("from streaming.text import *", ns)
    print("star", sorted(k for k in ns if k.startswith("Streaming")))
""")


def test_training_processes_skip_streamings_dataset_packages_until_something_uses_them():
    """``import streaming`` imports its ready-made datasets, and through ``streaming.text`` transformers'
    generation code, scikit-learn and SciPy: about 2.6 s in every rank of every training process. memtrain reads
    its shards with ``streaming.base`` alone, so ``memtrain.data`` defers the three packages; the first use of one
    imports it as usual."""
    result = subprocess.run([sys.executable, "-c", _DEFERRED_SCRIPT], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["heavy"] == "[]"
    assert lines["text"] == "streaming.text.c4 module module"  # the real package replaced its placeholder
    assert lines["vision"] == ("streaming.vision.cifar10 "
                               "['StreamingADE20K', 'StreamingCIFAR10', 'StreamingCOCO', 'StreamingImageNet']")
    assert lines["multimodal"] == "streaming.multimodal.webvid True"
    assert lines["star"] == "['StreamingC4', 'StreamingEnWiki', 'StreamingPile']"


def test_sweep_removes_the_filelocks_of_prefixes_without_shared_memory(tmp_path):
    from memtrain.data.loader import sweep_orphan_filelocks

    tmp, shm = tmp_path / "tmp", tmp_path / "shm"
    tmp.mkdir()
    shm.mkdir()
    for prefix in range(1, 6):
        for kind in ("barrier", "cache"):
            (tmp / f"{prefix:06}_{kind}_filelock").touch()
    (shm / "000003_locals").touch()  # prefix 3 is held by a live dataset
    (shm / "000004_barrier").touch()  # a segment, but not the leader's registration
    others = ["notes.txt", "3_barrier_filelock", "000001_barrier_filelock.tmp", "000002_other_filelock"]
    for name in others:
        (tmp / name).touch()
    assert sweep_orphan_filelocks(tmp, shm) == 8
    assert sorted(p.name for p in tmp.iterdir()) == sorted(others + ["000003_barrier_filelock",
                                                                     "000003_cache_filelock"])
    assert sweep_orphan_filelocks(tmp, tmp_path / "no-shm") == 0  # cannot tell live prefixes: keep all
    assert len(list(tmp.iterdir())) == 6


_PREFIX_SCRIPT = textwrap.dedent("""
    import json, os, re, sys
    import memtrain.data.loader as loader_module
    from memtrain.config import recipe_from_dict

    sweep, live = loader_module.sweep_orphan_filelocks, []

    def spy(*args, **kwargs):  # the prefixes alive when the sweep starts (it runs under the host lock)
        live.extend(int(n[:6]) for n in os.listdir("/dev/shm") if re.fullmatch(r"\\d{6}_locals", n))
        return sweep(*args, **kwargs)

    loader_module.sweep_orphan_filelocks = spy
    loader = loader_module.build_loader(recipe_from_dict(json.loads(sys.argv[1])), "train", 2)
    next(iter(loader))  # the dataset takes its locks, creating its filelock files
    print(json.dumps({"prefix": loader.dataset._shm_prefix_int, "live": sorted(live)}))
""")


def test_a_new_dataset_reuses_the_prefixes_whose_datasets_are_gone(tmp_path, prepared):
    """Streaming never deletes its filelock files and skips every prefix that has one, so before the sweep each
    dataset on a host took a new prefix and every scan walked all the earlier ones. A dataset built in a temporary
    folder holding the filelocks of 200 finished datasets takes the lowest prefix no live dataset holds, and the
    sweep leaves the files of live prefixes only: those of the host's other datasets (other tests may be running),
    its own and one this test keeps alive with a segment at a number no scan reaches."""
    from multiprocessing import shared_memory

    recipe, _ = prepared
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    fake = 200
    for prefix in range(fake):
        for kind in ("barrier", "cache"):
            (tmp / f"{prefix:06}_{kind}_filelock").touch()
    held = 987_654
    for kind in ("barrier", "cache"):
        (tmp / f"{held}_{kind}_filelock").touch()
    (tmp / "unrelated.txt").touch()
    segment = shared_memory.SharedMemory(name=f"{held}_locals", create=True, size=16)
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
        result = subprocess.run([sys.executable, "-c", _PREFIX_SCRIPT, json.dumps(recipe.to_dict())],
                                env={**env, "TMPDIR": str(tmp)}, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        segment.close()
        segment.unlink()
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    live = set(out["live"]) - {held}
    assert held in out["live"] and len(live) < fake // 2, out
    # Datasets are created under the host lock only, so no prefix came alive after the sweep's listing: the scan
    # took the lowest free one, at most the number alive. Without the sweep every prefix below 200 is skipped.
    assert out["prefix"] <= len(live), out
    left = {int(p.name[:6]) for p in tmp.iterdir() if p.name.endswith("_filelock")}
    assert left <= live | {out["prefix"], held}, sorted(left - live)
    assert {out["prefix"], held} <= left and (tmp / "unrelated.txt").exists()


_KILLED_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from memtrain.config import Recipe, recipe_from_dict
    from memtrain.data.loader import LoaderIterator, build_loader
    it = LoaderIterator(build_loader(recipe_from_dict(json.loads(sys.argv[1])), "train", 2))
    next(it)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_loaders_survive_gc_and_a_killed_run(prepared):
    recipe, _ = prepared
    first = take(LoaderIterator(build_loader(recipe, "train", 2)), 3)
    gc.collect()
    assert take(LoaderIterator(build_loader(recipe, "train", 2)), 3) == first  # second run, same process

    shm = Path("/dev/shm")
    before = set(os.listdir(shm)) if shm.is_dir() else set()
    p = subprocess.run([sys.executable, "-c", _KILLED_SCRIPT, json.dumps(recipe.to_dict())],
                       env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    leaked = (set(os.listdir(shm)) - before) if shm.is_dir() else set()
    try:
        assert take(LoaderIterator(build_loader(recipe, "train", 2)), 3) == first
    finally:
        for name in leaked:  # what the killed run left behind, and nothing else
            (shm / name).unlink(missing_ok=True)


_MANY_LOADERS_SCRIPT = textwrap.dedent("""
    import json, sys
    from memtrain.config import recipe_from_dict
    from memtrain.data.loader import LoaderIterator, build_loader
    recipe = recipe_from_dict(json.loads(sys.argv[1]))
    keep = [LoaderIterator(build_loader(recipe, "train", 2)) for _ in range(10)]
    print(sum(len(next(it)["input_ids"]) for it in keep))
""")


def test_concurrent_jobs_on_one_host_do_not_collide(prepared):
    """Streaming's shared-memory prefix choice is not atomic; memtrain serialises it per host."""
    recipe, _ = prepared
    args = [sys.executable, "-c", _MANY_LOADERS_SCRIPT, json.dumps(recipe.to_dict())]
    procs = [subprocess.Popen(args, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert out.strip().splitlines()[-1] == "20"


def test_remote_data_streams_into_a_cache_per_run(prepared, tmp_path):
    """data.remote: shards prepared elsewhere (here a path; s3:// etc. go through the same Streaming
    downloader) are cached under each run's own folder, and yield the same batches as local reading."""
    recipe, _ = prepared
    local = take(LoaderIterator(build_loader(recipe, "train", 2)), 4)
    runs = []
    for name in ("a", "b"):
        r = recipe_from_dict(recipe.to_dict(), [f"data.remote={recipe.data_dir}", f"data.dir={tmp_path / 'unused'}",
                                                f"run.dir={tmp_path / name}"])
        assert take(LoaderIterator(build_loader(r, "train", 2)), 4) == local
        runs.append(tmp_path / name / "data-cache")
    for cache in runs:
        (folder,) = cache.glob("data-*")  # the folder of this meta.json's data
        assert (folder / "meta.json").read_bytes() == (recipe.data_dir / "meta.json").read_bytes()
        assert list((folder / "train").glob("shard.*.mds"))
    assert not (tmp_path / "unused").exists()
    bad = recipe_from_dict(recipe.to_dict(), [f"data.remote={tmp_path / 'nowhere'}", f"run.dir={tmp_path / 'c'}"])
    with pytest.raises(DataError, match="cannot fetch .*nowhere/meta.json"):
        build_loader(bad, "train", 2)


_REMOTE_READER = """
import json, sys
from memtrain.config import recipe_from_dict
from memtrain.data.loader import LoaderIterator, build_loader
it = LoaderIterator(build_loader(recipe_from_dict(json.loads(sys.argv[1])), "train", 2))
print(json.dumps([next(it)["input_ids"].tolist() for _ in range(3)]))
"""


def test_remote_prepared_again_is_read_afresh_and_the_old_cache_goes_when_unread(tmp_path, corpus):
    """A run's cache of data.remote holds each remote meta.json's data in its own folder. When the remote is prepared
    again (other data, the same settings), the next reader streams the new shards, not the cached old ones (which
    Streaming used to take as they were, with the new meta.json's counts), and the old folder is deleted once no
    process holds it; one held by a reader stays."""
    src = write_jsonl(tmp_path / "docs.jsonl", corpus)
    remote = tmp_path / "remote"
    make = lambda: make_recipe(remote, [str(src)])  # noqa: E731
    prepare(make())
    run = recipe_from_dict(make().to_dict(), [f"data.remote={remote}", f"data.dir={tmp_path / 'unused'}",
                                              f"run.dir={tmp_path / 'run'}"])

    def read_elsewhere() -> list:  # another process: it holds its cache folder only while it runs
        out = subprocess.run([sys.executable, "-c", _REMOTE_READER, json.dumps(run.to_dict())], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def local() -> list:
        it = LoaderIterator(build_loader(make(), "train", 2))
        return [next(it)["input_ids"].tolist() for _ in range(3)]

    cache = tmp_path / "run" / "data-cache"
    assert read_elsewhere() == local()
    (first,) = cache.glob("data-*")
    write_jsonl(src, [t.upper() for t in corpus])  # other text: other tokens
    prepare(make(), force=True)
    assert read_elsewhere() == local()  # the new data, not the shards cached before
    (second,) = cache.glob("data-*")  # the first folder was nobody's any more
    assert second != first and (second / "meta.json").read_bytes() == (remote / "meta.json").read_bytes()

    held = LoaderIterator(build_loader(run, "train", 2))  # this process now holds the second folder
    next(held)
    write_jsonl(src, corpus)
    prepare(make(), force=True)
    assert read_elsewhere() == local()
    assert second.is_dir() and len(list(cache.glob("data-*"))) == 2  # held by this process: it stays
    next(held)


def test_damaged_shard_is_one_clear_error(prepared, tmp_path):
    recipe, _ = prepared
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(recipe.data_dir, copy)
    for shard in (copy / "train").glob("shard.*.mds"):
        shard.write_bytes(shard.read_bytes()[:50])  # truncated
    damaged = recipe_from_dict(recipe.to_dict(), [f"data.dir={copy}"])
    it = LoaderIterator(build_loader(damaged, "train", 2))
    with pytest.raises(DataError, match="a shard is damaged.*--force"):
        for _ in range(50):
            next(it)
