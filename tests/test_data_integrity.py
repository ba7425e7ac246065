"""Integrity of prepared data (memtrain.data.verify): the xxh64 checksums every shard records, damaged
or missing shards named by `verify_shards` and `memtrain prepare RECIPE --verify`, the ranks' shares,
folders prepared before checksums, and the recipe checked against the prepared tree (CPU, fast)."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from memtrain.config import load_recipe, recipe_from_dict
from memtrain.data.builtin import builtin_documents
from memtrain.data.loader import LoaderIterator, build_loader
from memtrain.data.prepare import prepare
from memtrain.data.shards import merge_parts, part_name, write_mds
from memtrain.data.verify import (check_recipe_data, file_digest, prepared_file, shard_files, verify_folder,
                                  verify_shards)
from memtrain.errors import DataError
from memtrain.launcher.cli import main

REPO = Path(__file__).resolve().parents[1]
SEQ = 32
K, P = 2, 2


def make_recipe(data_dir: Path, src: Path, clustering: bool = False):
    return recipe_from_dict({
        "run": {"name": "integrity", "seed": 5},
        "model": {"vocab_size": 512, "max_seq_len": SEQ, "d_model": 64, "n_heads": 2, "ffn_dim": 128},
        "data": {"dir": str(data_dir), "sources": [str(src)], "seq_len": SEQ, "val_fraction": 0.05,
                 "tokenizer": {"vocab_size": 300, "model_type": "bpe"},
                 "shard_size_limit": 1 << 14,  # several shards of 16 KB per split
                 "clustering": {"enabled": clustering, "branching": K, "depth": P, "kmeans_samples": 256,
                                "embedding_batch_size": 64}},
        "train": {"global_batch_tokens": 4 * SEQ, "micro_batch_size": 2, "max_steps": 10},
    })


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("integrity") / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in builtin_documents(0)[::30]))
    return src


@pytest.fixture(scope="module")
def plain(source):
    """A plain prepared folder (never modified: the damage tests work on copies)."""
    recipe = make_recipe(source.parent / "plain", source)
    return recipe, prepare(recipe)


@pytest.fixture(scope="module")
def clustered(source):
    recipe = make_recipe(source.parent / "clustered", source, clustering=True)
    return recipe, prepare(recipe)


@pytest.fixture(params=["plain", "clustered"])
def prepared(request):
    return request.getfixturevalue(request.param)


def _indexes(data_dir: Path) -> list[Path]:
    return sorted(data_dir.rglob("index.json"))


def _rel(data_dir: Path, path: Path) -> str:
    return path.relative_to(data_dir).as_posix()


def _copy(recipe, dest: Path):
    shutil.copytree(recipe.data_dir, dest)
    return recipe_from_dict(recipe.to_dict(), [f"data.dir={dest}"])


def _largest_shard(data_dir: Path) -> Path:
    return max((p for p, _, _ in shard_files(data_dir)), key=lambda p: p.stat().st_size)


# --------------------------------------------------------------------------------------------------
# what prepare records


def test_every_shard_records_its_xxh64(prepared):
    from streaming.base.hashing import get_hash

    recipe, _ = prepared
    files = shard_files(recipe.data_dir)
    on_disk = sorted(p for p in recipe.data_dir.rglob("*.mds"))
    assert sorted(p for p, _, _ in files) == on_disk and len(on_disk) >= 3
    for index in _indexes(recipe.data_dir):
        for shard in json.loads(index.read_text())["shards"]:
            assert shard["hashes"] == ["xxh64"] and set(shard["raw_data"]["hashes"]) == {"xxh64"}
    for path, algo, digest in files:
        # what Streaming recorded is its own whole-file hash, which the chunked reader reproduces
        assert algo == "xxh64" and digest == get_hash("xxh64", path.read_bytes()) == file_digest(path)


def test_meta_json_records_the_tokenizer_and_tree(prepared):
    """Streaming's indexes list only shards: the tokenizer and tree the folder holds are recorded in meta.json."""
    import xxhash

    recipe, meta = prepared
    on_disk = json.loads((recipe.data_dir / "meta.json").read_text())
    names = ["tokenizer.model"] + (["tree.safetensors"] if recipe.data.clustering.enabled else [])
    assert sorted(on_disk["checksums"]) == sorted(names) and meta["checksums"] == on_disk["checksums"]
    for name in names:
        data = (recipe.data_dir / name).read_bytes()
        assert on_disk["checksums"][name] == {"bytes": len(data), "xxh64": xxhash.xxh64(data).hexdigest()}


def test_chunked_digest_equals_the_whole_file_hash(tmp_path, monkeypatch):
    import memtrain.data.verify as verify
    from streaming.base.hashing import get_hash

    data = np.random.default_rng(0).bytes(10_007)
    path = tmp_path / "blob"
    path.write_bytes(data)
    monkeypatch.setattr(verify, "CHUNK", 1000)  # 11 chunks, the last one short
    for algo in ("xxh64", "xxh3_64", "sha1"):
        assert file_digest(path, algo) == get_hash(algo, data)
    with pytest.raises(ValueError, match="unknown hash algorithm 'nope'"):
        file_digest(path, "nope")


def test_merged_parts_keep_their_checksums(tmp_path):
    """Distributed prepare writes one MDS part per rank and merges the indexes with Streaming's merge_index."""
    rng = np.random.default_rng(1)
    data_dir = tmp_path / "data"
    total = 0
    for rank in range(2):
        samples = [rng.integers(0, 300, SEQ + 1).astype(np.uint16) for _ in range(300)]
        total += write_mds(data_dir / "train" / part_name(rank), samples, "uint16", 1 << 12)
    assert merge_parts(data_dir / "train") == total
    (data_dir / "meta.json").write_text(json.dumps({"train_samples": total, "val_samples": 0}))
    merged = json.loads((data_dir / "train" / "index.json").read_text())["shards"]
    assert len(merged) > 2 and all(s["raw_data"]["hashes"].get("xxh64") for s in merged)
    rels = [_rel(data_dir, p) for p, _, _ in shard_files(data_dir)]
    assert {r.split("/")[1] for r in rels} == {"part-00000", "part-00001"}
    report = verify_folder(data_dir)
    assert report.problems == [] and report.unchecked == [] and report.files == len(merged)

    victim = data_dir / "train" / "part-00001" / "shard.00000.mds"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert [p.split(":")[0] for p in verify_shards(data_dir)] == ["train/part-00001/shard.00000.mds"]


# --------------------------------------------------------------------------------------------------
# verification


def _named(recipe) -> list[Path]:
    """The tokenizer and tree of a prepared folder (what verification checks besides the shards)."""
    names = ["tokenizer.model"] + (["tree.safetensors"] if recipe.data.clustering.enabled else [])
    return [recipe.data_dir / name for name in names]


def test_a_clean_folder_verifies(prepared):
    recipe, _ = prepared
    report = verify_folder(recipe.data_dir)
    files = [p for p, _, _ in shard_files(recipe.data_dir)] + _named(recipe)
    assert report.problems == [] and report.unchecked == []
    assert report.files == len(files) and report.bytes == sum(p.stat().st_size for p in files)
    assert verify_shards(recipe.data_dir) == []


def test_random_bytes_in_the_middle_of_a_shard_are_named(prepared, tmp_path):
    recipe, _ = prepared
    copy = _copy(recipe, tmp_path / "data")
    shard = _largest_shard(copy.data_dir)
    data = bytearray(shard.read_bytes())
    assert len(data) >= 3 * 4096
    mid = len(data) // 2 - 2048
    data[mid:mid + 4096] = os.urandom(4096)
    shard.write_bytes(bytes(data))  # the same size: only the checksum can tell
    problems = verify_shards(copy.data_dir)
    assert len(problems) == 1
    assert problems[0].startswith(f"{_rel(copy.data_dir, shard)}: xxh64 checksum ")
    assert "does not match the recorded" in problems[0]


def test_truncated_and_missing_files_and_indexes_are_named(plain, tmp_path):
    recipe, _ = plain
    copy = _copy(recipe, tmp_path / "data")
    d = copy.data_dir
    truncated = _largest_shard(d)
    size = truncated.stat().st_size
    truncated.write_bytes(truncated.read_bytes()[:size // 2])
    missing = d / "val" / "shard.00000.mds"
    missing.unlink()
    problems = verify_shards(d)
    assert problems == [f"{_rel(d, truncated)}: {size // 2} bytes but index.json records {size} (truncated, "
                        "extended or replaced)", "val/shard.00000.mds: missing"]

    (d / "val" / "index.json").unlink()  # an index meta.json implies: its shards cannot be listed
    assert verify_shards(d) == ["val/index.json: missing (meta.json lists this stream)", problems[0]]
    with pytest.raises(DataError, match=r"is damaged: val/index.json: missing .*--force"):
        shard_files(d)
    shutil.rmtree(d / "val")
    (d / "meta.json").unlink()
    with pytest.raises(DataError, match=r"no prepared data in .* run `memtrain prepare RECIPE` first"):
        verify_shards(d)


def test_a_damaged_or_replaced_tokenizer_or_tree_is_named(clustered, tmp_path):
    """Verification, the trainer's check and the readers (`memtrain eval` / `generate` through prepared_file) name
    a tokenizer or tree that changed after prepare. Before, a truncated one failed deep inside its parser and
    another valid tokenizer loaded without a word (and decoded the model's ids into other text)."""
    from memtrain.data.tokenizer import SentencePieceTokenizer, load_tokenizer

    recipe, meta = clustered
    copy = _copy(recipe, tmp_path / "data")
    d = copy.data_dir
    fix = "prepare the data again with `memtrain prepare RECIPE --force`"
    assert prepared_file(d, meta, "tokenizer.model") == d / "tokenizer.model"  # intact: the path, unchanged

    # another valid SentencePiece model in its place: loads fine, so only the checksum can tell
    docs = [t for t in builtin_documents(0)[::7]]
    other = SentencePieceTokenizer.train(iter(docs), tmp_path / "other.model", 300, "bpe", seed=1, byte_fallback=False)
    assert (tmp_path / "other.model").read_bytes() != (d / "tokenizer.model").read_bytes()
    shutil.copyfile(tmp_path / "other.model", d / "tokenizer.model")
    assert load_tokenizer(d / "tokenizer.model").vocab_size == other.vocab_size
    problems = verify_shards(d)
    assert len(problems) == 1 and problems[0].startswith("tokenizer.model: ")
    assert ("checksum" in problems[0] or "meta.json records" in problems[0])
    with pytest.raises(DataError) as err:
        prepared_file(d, meta, "tokenizer.model")
    assert str(err.value).startswith(f"{d / 'tokenizer.model'}: ") and fix in str(err.value)

    # the tree cut short, then with the same size but other bytes, then gone
    shutil.copyfile(recipe.data_dir / "tokenizer.model", d / "tokenizer.model")
    tree = d / "tree.safetensors"
    original = tree.read_bytes()
    tree.write_bytes(original[:300])
    assert verify_shards(d) == [f"tree.safetensors: 300 bytes but meta.json records {len(original)} (truncated, "
                                "extended or replaced)"]
    with pytest.raises(DataError, match=r"tree\.safetensors: 300 bytes but meta\.json records .*--force"):
        prepared_file(d, meta, "tree.safetensors")
    flipped = bytearray(original)
    flipped[-1] ^= 0xFF
    tree.write_bytes(bytes(flipped))
    assert verify_shards(d)[0].startswith("tree.safetensors: xxh64 checksum ")
    tree.unlink()
    assert verify_shards(d) == ["tree.safetensors: missing"]
    with pytest.raises(DataError, match=r"tree\.safetensors: missing; prepare the data again"):
        prepared_file(d, meta, "tree.safetensors")

    # a tokenizer of the user's own (an absolute path) is theirs: not checked here
    assert prepared_file(d, meta, str(tmp_path / "other.model")) == tmp_path / "other.model"


def test_with_remote_data_the_tokenizer_and_tree_are_fetched_and_checked(clustered, tmp_path):
    """data.remote: the readers' data_dir is the run's cache, which holds only meta.json; prepared_file fetches the
    tokenizer and tree into it (before, `memtrain generate` and the probes stopped: the tokenizer did not exist)."""
    recipe, meta = clustered
    remote = _copy(recipe, tmp_path / "remote").data_dir
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("tokenizer.model", "tree.safetensors"):
        path = prepared_file(cache, meta, name, remote=f"{remote}/")
        assert path == cache / name and path.read_bytes() == (remote / name).read_bytes()
    tokenizer = cache / "tokenizer.model"
    stamp = tokenizer.stat().st_mtime_ns
    assert prepared_file(cache, meta, "tokenizer.model", remote=str(remote)) == tokenizer
    assert tokenizer.stat().st_mtime_ns == stamp  # an intact copy in the cache is not fetched again
    tokenizer.write_bytes(b"damaged")
    prepared_file(cache, meta, "tokenizer.model", remote=str(remote))  # a damaged copy is fetched again
    assert tokenizer.read_bytes() == (remote / "tokenizer.model").read_bytes()

    tokenizer.unlink()
    (remote / "tokenizer.model").write_bytes(b"damaged at the source")
    with pytest.raises(DataError, match=rf"^{remote}/tokenizer\.model \(fetched to {tokenizer}\): 21 bytes but "
                                        r"meta\.json records \d+ .*--force"):
        prepared_file(cache, meta, "tokenizer.model", remote=str(remote))
    (remote / "tokenizer.model").unlink()
    tokenizer.unlink()
    with pytest.raises(DataError, match=rf"^cannot fetch {remote}/tokenizer\.model \(FileNotFoundError"):
        prepared_file(cache, meta, "tokenizer.model", remote=str(remote))
    assert sorted(p.name for p in cache.iterdir()) == ["tree.safetensors"]  # no half-written file left


def _hf_tokenizer(folder: Path, documents: slice, vocab: int = 384, eos: str = "<|eos|>") -> Path:
    """A byte-level BPE Hugging Face tokenizer folder trained on ``builtin_documents(0)[documents]``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(builtin_documents(0)[documents], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<|eos|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token="<unk>").save_pretrained(folder)
    return folder


def test_meta_json_records_the_tokenizers_fingerprint(prepared):
    from memtrain.data.tokenizer import load_tokenizer, tokenizer_fingerprint
    from memtrain.data.verify import prepared_tokenizer

    recipe, meta = prepared
    on_disk = json.loads((recipe.data_dir / "meta.json").read_text())
    tokenizer = load_tokenizer(recipe.data_dir / "tokenizer.model")
    found = tokenizer_fingerprint(tokenizer)
    assert on_disk["tokenizer_fingerprint"] == meta["tokenizer_fingerprint"] == found
    assert found["vocab_size"] == on_disk["vocab_size"] == 300 and found["eot_id"] == on_disk["eot_id"]
    assert prepared_tokenizer(recipe.data_dir, meta).pieces() == tokenizer.pieces()


def test_a_users_own_tokenizer_is_checked_by_its_behaviour_not_its_bytes(source, tmp_path):
    """data.tokenizer.path outside the folder: its bytes are the user's (not checksummed), but a tokenizer that
    no longer gives the ids the shards hold is one line naming it. Before, eval and generate loaded whatever was
    at the path: their prompts became other ids and the model's ids other text, without a word."""
    from memtrain.data.tokenizer import load_tokenizer, tokenizer_fingerprint
    from memtrain.data.verify import prepared_tokenizer

    own = _hf_tokenizer(tmp_path / "own", slice(0, 400))
    recipe = recipe_from_dict(make_recipe(tmp_path / "data", source).to_dict(), [f"data.tokenizer.path={own}"])
    meta = prepare(recipe)
    assert meta["tokenizer"] == str(own.resolve()) and meta["checksums"] == {}  # nothing in the folder to hash
    assert meta["tokenizer_fingerprint"]["vocab_size"] == 384
    d = recipe.data_dir
    assert prepared_tokenizer(d, meta).pieces() == load_tokenizer(own).pieces()

    # written again with other bytes (as another transformers version saves it: other JSON layout, other
    # settings that do not touch encoding), the same behaviour: accepted
    before = {f.name: f.read_bytes() for f in own.iterdir()}
    (own / "tokenizer.json").write_text(json.dumps(json.loads((own / "tokenizer.json").read_text()), indent=1))
    config = json.loads((own / "tokenizer_config.json").read_text())
    (own / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 4096}))
    assert {f.name: f.read_bytes() for f in own.iterdir()} != before
    prepared_tokenizer(d, meta)

    fix = "restore the tokenizer the data was prepared with, or prepare the data again with this one"
    start = f"tokenizer {str(own.resolve())!r} is not the one {d} was prepared with: "
    cases = {  # what replaced it -> what the line says
        "merges": (lambda f: _hf_tokenizer(f, slice(400, 800)),
                   "it has the data's vocabulary size and end-of-text id but other pieces or another encoding "
                   "(fingerprint "),
        "vocab": (lambda f: _hf_tokenizer(f, slice(0, 400), vocab=400),
                  "its vocab_size is 400 where the data's is 384"),
        "eos": (lambda f: _hf_tokenizer(f, slice(0, 400), eos="<|end|>"), "its eot_id is 2 where the data's is 1"),
    }
    for name, (make, says) in cases.items():
        shutil.rmtree(own)
        make(own)
        assert tokenizer_fingerprint(load_tokenizer(own)) != meta["tokenizer_fingerprint"], name
        with pytest.raises(DataError) as err:
            prepared_tokenizer(d, meta)
        line = str(err.value)
        assert line.startswith(start + says) and fix in line and "--force" in line and "\n" not in line, line

    # a normalisation step added in front (the same pieces, so only the encoding of the probe text differs)
    shutil.rmtree(own)
    _hf_tokenizer(own, slice(0, 400))
    tokenizer = load_tokenizer(own)
    from tokenizers import normalizers

    tokenizer.tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.tok.save_pretrained(own)
    assert load_tokenizer(own).pieces() == tokenizer.pieces()
    with pytest.raises(DataError, match="other pieces or another encoding"):
        prepared_tokenizer(d, meta)

    # a folder prepared before fingerprints were recorded: loads, unchecked
    old = {k: v for k, v in meta.items() if k != "tokenizer_fingerprint"}
    assert prepared_tokenizer(d, old).vocab_size == 384


def test_ranks_share_the_files_each_exactly_once(clustered, tmp_path):
    recipe, meta = clustered
    copy = _copy(recipe, tmp_path / "data")
    d = copy.data_dir
    for path, _, _ in shard_files(d):  # damage every file: each rank's problems name the files it checked
        path.write_bytes(path.read_bytes()[:-1])
    for path in _named(copy):
        path.write_bytes(path.read_bytes()[:-1])
    lost = meta["streams"]["val"][0]["dir"]
    (d / lost / "index.json").unlink()  # a problem of the listing, which rank 0 alone reports
    checked = [_rel(d, p) for p in sorted(d.rglob("*.mds")) if not _rel(d, p).startswith(lost + "/")]
    checked += [_rel(d, p) for p in _named(copy)]
    assert len(checked) >= 4
    for world in (1, 2, 3, len(checked) + 2):
        reports = [verify_folder(d, rank, world) for rank in range(world)]
        named = [[p.split(":")[0] for p in r.problems] for r in reports]
        assert named[0][0] == f"{lost}/index.json" and all(f"{lost}/index.json" not in n for n in named[1:])
        files = Counter(name for n in named for name in n if not name.endswith("index.json"))
        assert files == Counter(checked)  # every file, each exactly once
        assert [r.files for r in reports] == [len(range(rank, len(checked), world)) for rank in range(world)]
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        verify_folder(d, 2, 2)


def test_a_folder_without_checksums_loads_and_is_size_checked_only(plain, tmp_path):
    recipe, _ = plain
    copy = _copy(recipe, tmp_path / "data")
    d = copy.data_dir
    for index in _indexes(d):  # as prepared before checksums were recorded
        obj = json.loads(index.read_text())
        for shard in obj["shards"]:
            shard["hashes"], shard["raw_data"]["hashes"] = [], {}
        index.write_text(json.dumps(obj))
    meta = json.loads((d / "meta.json").read_text())
    del meta["checksums"]  # nor the tokenizer's
    (d / "meta.json").write_text(json.dumps(meta))
    files = shard_files(d)
    assert all(algo is None and digest is None for _, algo, digest in files)
    report = verify_folder(d)
    assert report.problems == [] and report.bytes == 0
    assert sorted(report.unchecked) == sorted([_rel(d, p) for p, _, _ in files] + ["tokenizer.model"])
    assert prepared_file(d, meta, "tokenizer.model") == d / "tokenizer.model"  # nothing recorded to check against
    batch = next(LoaderIterator(build_loader(copy, "train", 2)))  # still loads
    assert batch["input_ids"].shape == (2, SEQ)

    shard = _largest_shard(d)
    shard.write_bytes(shard.read_bytes()[:100])
    (d / "tokenizer.model").unlink()
    assert [p.split(":")[0] for p in verify_shards(d)] == [_rel(d, shard), "tokenizer.model"]


# --------------------------------------------------------------------------------------------------
# memtrain prepare RECIPE --verify


def test_prepare_verify_command(plain, tmp_path, capsys):
    recipe, _ = plain
    copy = _copy(recipe, tmp_path / "data")
    path = tmp_path / "recipe.yaml"
    path.write_text(copy.to_yaml())
    before = sorted((p, p.stat().st_mtime_ns) for p in copy.data_dir.rglob("*"))

    assert main(["prepare", str(path), "--verify"]) == 0
    out, err = capsys.readouterr()
    n = len(shard_files(copy.data_dir)) + 1  # and the tokenizer
    assert out.startswith(f"verified {copy.data_dir}: {n} files, ") and "; 0 without checksum" in out
    assert err == ""
    assert sorted((p, p.stat().st_mtime_ns) for p in copy.data_dir.rglob("*")) == before  # prepares nothing

    shard = _largest_shard(copy.data_dir)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = os.urandom(4096)
    shard.write_bytes(bytes(data))
    assert main(["prepare", str(path), "--verify"]) == 2
    out, err = capsys.readouterr()
    assert out.rstrip().endswith("; 1 damaged")
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"memtrain: 1 damaged file(s) in {copy.data_dir}: {_rel(copy.data_dir, shard)}: xxh64 ")
    assert lines[0].endswith(f"prepare the data again with `memtrain prepare {path} --force`, or restore the folder "
                             "from a good copy")
    # given with overrides, the fix repeats them (before, `memtrain prepare RECIPE --force` without data.dir= would
    # have prepared the recipe's own folder and left the damaged one as it was)
    other = _copy(recipe, tmp_path / "other data dir")
    other_shard = _largest_shard(other.data_dir)
    other_shard.write_bytes(bytes(data))
    assert main(["prepare", str(path), f"data.dir={other.data_dir}", "--verify"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"`memtrain prepare {path} 'data.dir={other.data_dir}' --force`, or restore the folder from "
                        "a good copy"), err

    empty = tmp_path / "nothing"
    assert main(["prepare", str(path), f"data.dir={empty}", "--verify"]) == 2
    assert "no prepared data in" in capsys.readouterr().err and not empty.exists()
    with pytest.raises(SystemExit, match="2"):
        main(["prepare", str(path), "--verify", "--force"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_prepare_on_a_full_disk_is_one_line_and_leaves_nothing(plain, tmp_path, capsys, monkeypatch):
    """The disk fills while the shards are written: one line and exit 2 (before, a traceback and exit 1), and
    neither data.dir nor the temporary build folder beside it is left."""
    import errno

    from memtrain.data import shards

    recipe, _ = plain
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_from_dict(recipe.to_dict(), [f"data.dir={tmp_path / 'full'}"]).to_yaml())

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "write_mds", full)
    assert main(["prepare", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == ("memtrain: a write failed: No space left on device; free space on the file system it writes to "
                   "(data.dir for prepare, run.dir for train, --out for eval and generate) or write elsewhere, and "
                   "run the command again\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_prepare_where_this_user_may_not_write_is_one_line(plain, tmp_path, capsys, monkeypatch):
    """data.dir in a folder this user may not write in: one line naming the folder and exit 2 (before, a
    PermissionError traceback from the build folder's mkdir and exit 1)."""
    import errno
    import getpass

    recipe, _ = plain
    locked = tmp_path / "locked"
    locked.mkdir()
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_from_dict(recipe.to_dict(), [f"data.dir={locked / 'data'}"]).to_yaml())
    real = os.mkdir

    def refuse(target, *args, **kwargs):
        if str(target).startswith(str(locked)):
            raise PermissionError(errno.EACCES, "Permission denied", str(target))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    assert main(["prepare", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"memtrain: cannot create {locked}/.data.tmp-"), err
    assert err.endswith(f": Permission denied (user {getpass.getuser()} may not write in {locked}); fix the "
                        "permissions or choose a location this user may use (data.dir for prepare, run.dir for "
                        "train, --out for eval, generate and scaling), and run the command again\n")
    assert list(locked.iterdir()) == []
    # a data.dir through a file: one line naming it (before, a FileExistsError traceback)
    monkeypatch.setattr(os, "mkdir", real)
    file = tmp_path / "file"
    file.write_text("")
    path.write_text(recipe_from_dict(recipe.to_dict(), [f"data.dir={file / 'data'}"]).to_yaml())
    assert main(["prepare", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"memtrain: cannot create the folder {file}: a file of that "
                                                         "name is in the way; choose another location"), err


# --------------------------------------------------------------------------------------------------
# the recipe against the prepared data


def _quickstart_memory(*overrides: str):
    return load_recipe(REPO / "recipes" / "quickstart-memory.yaml", list(overrides))


def _tree_meta(k: int, p: int) -> dict:
    return {"clustering": {"branching": k, "depth": p, "prefix": True},
            "streams": {"train": [{"subtree": s, "dir": f"train/subtree-{s}", "samples": 10} for s in range(k)]}}


def _tree_only(meta: dict) -> dict:
    """``meta`` without its recorded settings: the tree checks alone (the settings are another recipe's)."""
    return {k: v for k, v in meta.items() if k != "settings"}


def test_memory_on_unclustered_data_is_refused(plain):
    _, meta = plain  # prepared without clustering
    meta = _tree_only(meta)
    assert "clustering" not in meta
    with pytest.raises(DataError, match=r"was prepared without clustering, but memory.type 'ffn' fetches memories by "
                                        r"cluster id; prepare it again .*--force.*or set memory.type: none"):
        check_recipe_data(_quickstart_memory(), meta)
    with pytest.raises(DataError, match=r"prepared without clustering, but data.placement 'affine'.*data.placement: "
                                        "global"):
        check_recipe_data(_quickstart_memory("memory.type=none", "memory.levels=[]", "data.placement=affine"), meta)
    # nothing needs the tree: no complaint
    check_recipe_data(_quickstart_memory("memory.type=none", "memory.levels=[]"), meta)
    check_recipe_data(plain[0], meta)


def test_another_tree_is_refused(clustered):
    recipe, meta = clustered
    check_recipe_data(recipe, meta)
    meta = _tree_only(meta)
    check_recipe_data(_quickstart_memory(), _tree_meta(4, 2))
    with pytest.raises(DataError, match=r"holds a cluster tree with branching 2 but data.clustering.branching is 4; set "
                                        r"data.clustering.branching: 2, or prepare the data again"):
        check_recipe_data(_quickstart_memory(), meta)
    with pytest.raises(DataError, match=r"holds a cluster tree with depth 3 but data.clustering.depth is 2; set "
                                        r"data.clustering.depth: 3"):
        check_recipe_data(_quickstart_memory(), _tree_meta(4, 3))
    # a memory without a bank reads no cluster ids, but the tree must still be the recipe's
    with pytest.raises(DataError, match="holds a cluster tree with branching 3 but data.clustering.branching is 4"):
        check_recipe_data(_quickstart_memory("memory.type=none", "memory.levels=[]"), _tree_meta(3, 2))


def test_a_recipe_whose_data_settings_are_not_the_folders_is_refused(plain, clustered, tmp_path):
    """Training refuses what `memtrain prepare` refuses: a recipe whose data settings (sources, validation fraction,
    tokenizer, clustering, ...) are not those the folder was prepared with. Before, the run trained on the folder and
    its recipe.yaml recorded settings the data was not made with. The seed and a tokenizer named by path may
    differ; a folder that records no settings is not compared."""
    from memtrain.data.verify import settings_difference

    fix = "prepare the data for this recipe (`memtrain prepare RECIPE --force`, or another data.dir)"
    for recipe, meta in (plain, clustered):
        check_recipe_data(recipe, meta)
        where = str(recipe.data_dir)
        for override, key, was, has in (
                ("data.val_fraction=0.1", "data.val_fraction", 0.05, 0.1),
                ("data.tokenizer.vocab_size=256", "data.tokenizer.vocab_size", 300, 256),
                ("data.tokenizer.model_type=unigram", "data.tokenizer.model_type", "bpe", "unigram"),
                ("data.text_field=body", "data.text_field", "text", "body"),
                ("data.sources=[builtin]", "data.sources", [str(recipe.data.sources[0])], ["builtin"])):
            other = recipe_from_dict(recipe.to_dict(), [override])
            assert settings_difference(other, meta) == (key, was, has)
            with pytest.raises(DataError) as err:
                check_recipe_data(other, meta)
            assert str(err.value) == (f"{where} was prepared with {key}={was!r} but the recipe has {has!r}; set "
                                      f"{key}: {was!r} to train on it, or {fix}")
        assert settings_difference(recipe_from_dict(recipe.to_dict(), ["run.seed=99"]), meta) is None
        assert settings_difference(recipe, _tree_only(meta)) is None
    recipe, meta = clustered
    steps = recipe_from_dict(recipe.to_dict(), ["data.clustering.kmeans_samples=128"])
    assert settings_difference(steps, meta) == ("data.clustering.kmeans_samples", 256, 128)
    off = recipe_from_dict(recipe.to_dict(), ["data.clustering.enabled=false"])
    assert settings_difference(off, meta) == ("data.clustering.enabled", True, False)
    recipe, meta = plain
    on = recipe_from_dict(recipe.to_dict(), ["data.clustering.enabled=true"])
    assert settings_difference(on, meta) == ("data.clustering.enabled", False, True)
    old = {**meta, "settings": {**meta["settings"], "format_version": 0}}
    with pytest.raises(DataError, match=r"was prepared by another memtrain \(format_version 0, this one's is 1\); "
                                        r"prepare the data for this recipe"):
        check_recipe_data(recipe, old)
    # a tokenizer of the user's own, named by another path (a job started in another working directory)
    own = {**meta, "settings": {**meta["settings"], "tokenizer": {"path": "/elsewhere/tok"}}}
    assert settings_difference(recipe_from_dict(recipe.to_dict(), [f"data.tokenizer.path={tmp_path}"]), own) is None
    assert settings_difference(recipe, own) == ("data.tokenizer.path", "/elsewhere/tok", None)


def test_leaves_that_do_not_index_the_memory_rows_are_refused():
    recipe = _quickstart_memory()
    recipe.memory.levels = [64, 32, 16]  # past validation: 4^3 rows for a tree of 4^2 leaves
    with pytest.raises(DataError, match=r"has 16 leaf clusters \(branching 4, depth 2\) but the memory has 64 rows at its "
                                        r"deepest level .*one memory.levels entry per tree level \(2\)"):
        check_recipe_data(recipe, _tree_meta(4, 2))
    meta = _tree_meta(4, 2)
    meta["streams"]["train"].append({"subtree": 7, "dir": "train/subtree-7", "samples": 1})
    with pytest.raises(DataError, match=r"lists train streams of level-1 subtrees \[7\], outside \[0, 4\) for branching "
                                        "4; the folder is inconsistent"):
        check_recipe_data(_quickstart_memory(), meta)
