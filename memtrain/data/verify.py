"""Integrity of a prepared data folder: the shards against their recorded checksums, and the recipe
against the data it is about to train on.

``memtrain prepare`` has Streaming record every shard file's size and xxh64 checksum in its stream's
``index.json`` (``raw_data.bytes`` and ``raw_data.hashes``; :data:`memtrain.data.shards.HASHES`).
Streaming checks them only when it downloads a shard from a remote, never for shards read in place,
so a damaged shard (a bad block, an interrupted copy, a stray write) would otherwise surface only at
the training step that reads one of its samples. This module owns

- :func:`shard_files`: every shard file that ``meta.json`` and the ``index.json`` files it implies list
  (plain ``train/`` and ``val/``, or one stream per level-1 subtree per split; merged distributed
  indexes name their files ``part-<r>/shard.<i>.mds``), with the recorded algorithm and digest;
- :func:`verify_folder` / :func:`verify_shards`: one rank's share of those files and of the tokenizer
  and cluster tree the folder holds (file ``i`` when ``i % world == rank``) checked for size and hashed
  in chunks; every damaged or missing file is one problem line (``memtrain prepare RECIPE --verify``, and
  the trainer before any engine starts). The tokenizer's and tree's sizes and xxh64 are in meta.json
  (:data:`memtrain.data.prepare.CHECKSUMS`), since Streaming's indexes list only shards;
- :func:`prepared_file`: the same check of the tokenizer or tree alone, by the commands that read it
  (``memtrain eval``, ``memtrain generate``), so a damaged or replaced file is one error naming it rather
  than a parse error or, for another valid tokenizer, silently wrong text;
- :func:`prepared_tokenizer`: the tokenizer loaded through :func:`prepared_file` and compared with the
  behaviour fingerprint meta.json records, which also covers a tokenizer of the user's own outside the folder
  (its bytes are not checked: a Hugging Face folder saved again by another transformers changes them, not
  the ids);
- :func:`check_recipe_data`: the recipe's memory and clustering settings against the prepared tree.

Folders prepared before checksums were recorded (the data format is unchanged) still load: their
shards are checked for size only, and their tokenizer and tree for existence, and counted as having no
checksum recorded.

Imports stay light (the standard library, numpy through :mod:`memtrain.data.prepare`, xxhash when
hashing): neither Streaming nor torch (Streaming only when :func:`prepared_file` fetches from ``data.remote``).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from memtrain.data.prepare import CHECKSUMS, META, TOKENIZER_FINGERPRINT, named_files
from memtrain.errors import DataError

if TYPE_CHECKING:
    from memtrain.config import Recipe
    from memtrain.data.tokenizer import Tokenizer

SPLITS = ("train", "val")
INDEX = "index.json"
CHUNK = 8 << 20  # bytes read and hashed at a time
# Preferred when a shard records several algorithms: the fastest first.
_PREFERRED = ("xxh3_64", "xxh64", "xxh128", "xxh32")


@dataclass(frozen=True)
class ShardFile:
    """One shard file as its stream's index.json records it."""

    rel: str  # path relative to the data folder, e.g. "train/subtree-1/part-00000/shard.00003.mds"
    path: Path
    size: Optional[int]  # raw_data.bytes
    algo: Optional[str]  # None: no checksum recorded
    digest: Optional[str]
    record: str = INDEX  # where size and digest are recorded: index.json, or meta.json (the tokenizer and tree)


@dataclass
class VerifyReport:
    """What :func:`verify_folder` checked on this rank."""

    files: int = 0  # files of this rank's share (shards, and the tokenizer and tree)
    bytes: int = 0  # bytes hashed
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)  # one line per damaged or missing file
    unchecked: list[str] = field(default_factory=list)  # files with no checksum recorded (size checked only)


def shard_files(data_dir: str | Path) -> list[tuple[Path, Optional[str], Optional[str]]]:
    """``(path, algorithm, hex digest)`` of every shard file of the prepared folder, in a fixed order
    (split, stream, index order); algorithm and digest are None where no checksum was recorded.

    Raises :class:`DataError` when meta.json or an index.json it implies is missing or unreadable."""
    data_dir = Path(data_dir)
    files, problems = _listing(data_dir, _read_meta(data_dir))
    if problems:
        raise DataError(f"the prepared data in {data_dir} is damaged: {problems[0]}; prepare it again with "
                        "`memtrain prepare RECIPE --force` or restore the folder")
    return [(f.path, f.algo, f.digest) for f in files]


def verify_folder(data_dir: str | Path, rank: int = 0, world: int = 1, progress: bool = False,
                  splits: Optional[tuple[str, ...]] = None) -> VerifyReport:
    """Check this rank's share of the shard files of ``data_dir`` and of its tokenizer and tree (file ``i``
    when ``i % world == rank``): its size against the index's ``raw_data.bytes`` (meta.json's record for the
    tokenizer and tree), then its recorded checksum, read in chunks of :data:`CHUNK` bytes. Problems with
    the index files themselves are reported by rank 0 only, so that the ranks' problems together name each
    once. ``progress``: a tqdm bar (on a terminal). ``splits`` (e.g. ``("val",)``): only those splits' shards,
    without the tokenizer and tree.

    Raises :class:`DataError` only when meta.json is missing or unreadable (the same on every rank)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    from tqdm.auto import tqdm

    start = time.perf_counter()
    data_dir = Path(data_dir)
    meta = _read_meta(data_dir)
    files, listing_problems = _listing(data_dir, meta)
    if splits is None:
        files += _named(data_dir, meta)
    else:  # the shards and index problems of these splits only (memtrain eval: "val"; it checks the tokenizer and
        # tree as it reads them, prepared_file)
        files = [f for f in files if f.rel.split("/")[0] in splits]
        listing_problems = [p for p in listing_problems if p.split("/")[0] in splits or p.startswith(META)]
    report = VerifyReport(problems=list(listing_problems) if rank == 0 else [])
    mine = files[rank::world]
    report.files = len(mine)
    with tqdm(total=sum(f.size or 0 for f in mine), desc="verifying shards", unit="B", unit_scale=True,
              disable=None if progress else True) as bar:
        for f in mine:
            hashed, problem = _check(f, bar)
            report.bytes += hashed
            if problem:
                report.problems.append(f"{f.rel}: {problem}")
            elif f.algo is None:
                report.unchecked.append(f.rel)
    report.seconds = time.perf_counter() - start
    return report


def damaged(data_dir: str | Path, problems: list[str]) -> DataError:
    """The one-line error for :func:`verify_folder`'s problems (the first, and how many more), with the fixes."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return DataError(f"the prepared data in {data_dir} is damaged: {problems[0]}{more}; prepare it again with "
                     "`memtrain prepare RECIPE --force` or restore the folder (check it with `memtrain prepare "
                     "RECIPE --verify`)")


def verify_shards(data_dir: str | Path, rank: int = 0, world: int = 1, progress: bool = False) -> list[str]:
    """:func:`verify_folder`'s problems: one line per damaged or missing file of this rank's share,
    ``"<path relative to data_dir>: <what is wrong>"``; empty when the share is intact."""
    return verify_folder(data_dir, rank, world, progress).problems


def prepared_file(data_dir: str | Path, meta: dict[str, Any], ref: str, remote: Optional[str] = None) -> Path:
    """The path of ``ref`` (meta.json's tokenizer or tree entry) after checking the file against the size
    and checksum meta.json records for it: :class:`DataError` (one line: the file, what is wrong and the
    fix) when it is missing, truncated or changed. A name meta.json records no checksum for (a folder
    prepared before they were, or the user's own tokenizer at an absolute path) is returned unchecked.

    ``remote`` (``data.remote``; ``data_dir`` is then the run's cache holding the fetched meta.json): the file
    is fetched from there into the cache unless the cache already holds it intact."""
    data_dir = Path(data_dir)
    path = Path(ref).expanduser()
    if path.is_absolute():
        return path
    path = data_dir / path
    named = [f for f in _named(data_dir, meta) if f.rel == ref]
    recorded = [f for f in named if f.algo is not None]

    def problem() -> Optional[str]:
        return _check(recorded[0], _NoBar())[1] if recorded else None

    where, found = str(path), problem()
    if remote is not None and named:
        where = f"{remote.rstrip('/')}/{ref} (fetched to {path})"
        if found or not path.is_file():
            from memtrain.data.loader import fetch_file

            fetch_file(remote, ref, data_dir)
            found = problem()
    if found:
        raise DataError(f"{where}: {found}; prepare the data again with `memtrain prepare RECIPE --force` (the same "
                        "recipe writes the same file) or restore the folder from a good copy")
    return path


def prepared_tokenizer(data_dir: str | Path, meta: dict[str, Any], remote: Optional[str] = None) -> "Tokenizer":
    """The tokenizer the folder was prepared with (meta.json's ``tokenizer`` entry: a file in the folder, checked
    by :func:`prepared_file`, or the user's own at an absolute path), loaded and compared with the
    :func:`~memtrain.data.tokenizer.tokenizer_fingerprint` meta.json records: :class:`DataError` (one line) when
    it is another tokenizer than the one the shards' ids came from. A folder prepared before fingerprints were
    recorded loads unchecked."""
    from memtrain.data.tokenizer import load_tokenizer, tokenizer_fingerprint

    path = prepared_file(data_dir, meta, meta["tokenizer"], remote)
    tokenizer = load_tokenizer(path)
    recorded = meta.get(TOKENIZER_FINGERPRINT)
    if recorded is None:
        return tokenizer
    found = tokenizer_fingerprint(tokenizer)
    if found != recorded:
        what = next((f"its {key} is {found.get(key)} where the data's is {recorded.get(key)}"
                     for key in ("vocab_size", "eot_id") if found.get(key) != recorded.get(key)),
                    "it has the data's vocabulary size and end-of-text id but other pieces or another encoding "
                    f"(fingerprint {found['xxh64']}, recorded {recorded.get('xxh64')})")
        where = remote or str(data_dir)
        raise DataError(f"tokenizer {str(path)!r} is not the one {where} was prepared with: {what}, so the "
                        "text it would read or write does not match the data's token ids; restore the tokenizer the "
                        "data was prepared with, or prepare the data again with this one (`memtrain prepare RECIPE "
                        "--force`)")
    return tokenizer


def check_recipe_data(recipe: "Recipe", meta: dict[str, Any]) -> None:
    """Raise :class:`DataError` (one line: the problem and the fix) when the prepared data (its
    ``meta``) cannot serve the recipe: memories fetched by cluster id, or cluster-affine placement,
    on data prepared without clustering; a cluster tree whose branching or depth is not the recipe's;
    leaf cluster ids that do not index the memory's rows; any other data setting the folder was prepared
    with that is not the recipe's (:func:`settings_difference`). Reads nothing but ``meta``."""
    _check_tree(recipe, meta)
    found = settings_difference(recipe, meta)
    if found is None:
        return
    key, was, has = found
    where = recipe.data.remote or str(recipe.data_dir)
    fix = "prepare the data for this recipe (`memtrain prepare RECIPE --force`, or another data.dir)"
    if key.startswith("data."):
        raise DataError(f"{where} was prepared with {key}={was!r} but the recipe has {has!r}; set {key}: {was!r} to "
                        f"train on it, or {fix}")
    raise DataError(f"{where} was prepared by another memtrain ({key} {was!r}, this one's is {has!r}); {fix}")


# Data settings a run may differ in from the folder it trains on: the seed (run.seed also seeds the model's
# initialisation and the data order, and a run may vary it on the same data) and a tokenizer named by path (a
# relative path resolves against the working directory, which a job need not share with prepare; the commands
# that read text check the tokenizer's fingerprint, and training reads token ids only).
_SETTINGS_RUN_MAY_CHANGE = ("seed",)
# meta.json's settings keys that are not recipe keys under data. (the folder's format and corpus versions)
_VERSION_KEYS = ("format_version", "builtin_version", "longtail_version", "tasks_version")


def settings_difference(recipe: "Recipe", meta: dict[str, Any]) -> Optional[tuple[str, Any, Any]]:
    """``(key, prepared value, recipe value)`` of the first data setting (:func:`memtrain.data.prepare.data_settings`:
    sources, text field, sequence length, validation fraction, tokenizer, clustering) in which the recipe differs
    from the settings meta.json records; None when it does not, or for a folder that records none. ``prepare``
    refuses the same differences; before 2026-11-29 training did not, so a run's recipe.yaml could record a
    validation fraction, tokenizer or tree the data was not made with."""
    from memtrain.data.prepare import data_settings

    saved = meta.get("settings")
    if not isinstance(saved, dict):
        return None
    now = data_settings(recipe)
    for key in sorted(set(now) | set(saved), key=lambda k: (k in _VERSION_KEYS, k)):  # recipe keys first
        if key in _SETTINGS_RUN_MAY_CHANGE:
            continue
        a, b = now.get(key), saved.get(key)
        name = key if key in _VERSION_KEYS else f"data.{key}"
        if key == "clustering":  # recorded only when enabled
            a, b = a or {"enabled": False}, b or {"enabled": False}
        if isinstance(a, dict) and isinstance(b, dict):
            if key == "tokenizer" and "path" in a and "path" in b:
                continue
            # clustering on or off, or a tokenizer of one's own against a trained one, before the rest
            for sub in sorted(set(a) | set(b), key=lambda k: (k not in ("enabled", "path"), k)):
                if a.get(sub) != b.get(sub):
                    return f"{name}.{sub}", b.get(sub), a.get(sub)
        elif a != b:
            return name, b, a
    return None


def _check_tree(recipe: "Recipe", meta: dict[str, Any]) -> None:
    """:func:`check_recipe_data`'s checks of the cluster tree against the recipe's memory and placement."""
    where = recipe.data.remote or str(recipe.data_dir)
    cl, want, mem = meta.get("clustering") or {}, recipe.data.clustering, recipe.memory
    again = "prepare it again (`memtrain prepare RECIPE --force`) or point data.dir at clustered data"
    if not cl:
        if mem.enabled:
            raise DataError(f"{where} was prepared without clustering, but memory.type {mem.type!r} fetches memories "
                            f"by cluster id; {again}, or set memory.type: none")
        if recipe.data.placement == "affine":
            raise DataError(f"{where} was prepared without clustering, but data.placement 'affine' places ranks by "
                            f"cluster subtree; {again}, or set data.placement: global")
        return
    try:
        k, p = int(cl["branching"]), int(cl["depth"])
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{where}/{META} has a malformed clustering entry {cl!r}; prepare the data again with "
                        "`memtrain prepare RECIPE --force`") from None
    if want.enabled:
        for key, found in (("branching", k), ("depth", p)):
            if found != getattr(want, key):
                raise DataError(f"{where} holds a cluster tree with {key} {found} but data.clustering.{key} is "
                                f"{getattr(want, key)}; set data.clustering.{key}: {found}, or prepare the data again "
                                "for the recipe's tree (`memtrain prepare RECIPE --force`, or another data.dir)")
    if mem.enabled:
        # The bank holds k^l rows at level l (l = 1..len(levels)); a sample's leaf id must index the last.
        rows = want.branching ** len(mem.levels)
        if k**p != rows:
            raise DataError(f"{where} has {k**p} leaf clusters (branching {k}, depth {p}) but the memory has {rows} "
                            f"rows at its deepest level (branching {want.branching}, {len(mem.levels)} memory.levels); "
                            f"give one memory.levels entry per tree level ({p}), or prepare the data again")
    for split, entries in (meta.get("streams") or {}).items():
        bad = [e.get("subtree") for e in entries if not (isinstance(e.get("subtree"), int) and 0 <= e["subtree"] < k)]
        if bad:
            raise DataError(f"{where}/{META} lists {split} streams of level-1 subtrees {bad}, outside [0, {k}) for "
                            f"branching {k}; the folder is inconsistent: prepare it again with "
                            "`memtrain prepare RECIPE --force`")


# -- listing and hashing ---------------------------------------------------------------------------


def _read_meta(data_dir: Path) -> dict[str, Any]:
    path = data_dir / META
    if not path.is_file():
        raise DataError(f"no prepared data in {data_dir} (no {META}); run `memtrain prepare RECIPE` first")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}); run `memtrain prepare RECIPE --force`") from None


def _streams(data_dir: Path, meta: dict[str, Any]) -> list[tuple[str, Optional[int]]]:
    """(stream folder relative to data_dir, samples meta.json records for it or None) for every split."""
    if meta.get("streams"):
        return [(str(e["dir"]), e.get("samples")) for split in SPLITS for e in meta["streams"].get(split, [])]
    out = []
    for split in SPLITS:
        samples = meta.get(f"{split}_samples")
        if samples or (data_dir / split / INDEX).is_file():
            out.append((split, samples))
    return out


def _listing(data_dir: Path, meta: dict[str, Any]) -> tuple[list[ShardFile], list[str]]:
    """Every shard file of the folder, and problems with the index files (missing, unreadable, or
    disagreeing with meta.json)."""
    files: list[ShardFile] = []
    problems: list[str] = []
    try:
        streams = _streams(data_dir, meta)
    except (KeyError, TypeError, AttributeError) as e:
        return [], [f"{META}: malformed streams entry ({type(e).__name__}: {e})"]
    for stream, expected in streams:
        rel_index = f"{stream}/{INDEX}"
        try:
            index = json.loads((data_dir / stream / INDEX).read_text(encoding="utf-8"))
            shards = index["shards"]
            listed = sum(int(s["samples"]) for s in shards)
            found = [_shard_file(data_dir, stream, s) for s in shards]
        except FileNotFoundError:
            problems.append(f"{rel_index}: missing ({META} lists this stream)")
            continue
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{rel_index}: unreadable or malformed ({type(e).__name__}: {e})")
            continue
        if expected is not None and listed != expected:
            problems.append(f"{rel_index}: lists {listed} samples but {META} records {expected}")
        files += found
    return files, problems


def _named(data_dir: Path, meta: dict[str, Any]) -> list[ShardFile]:
    """The tokenizer and tree the folder holds (:func:`memtrain.data.prepare.named_files`), with the size and
    checksum meta.json records for each (None where it records none: prepared before it did)."""
    recorded = meta.get(CHECKSUMS)
    recorded = recorded if isinstance(recorded, dict) else {}
    out = []
    for name in named_files(meta):
        entry = recorded.get(name)
        entry = entry if isinstance(entry, dict) else {}
        algo = next((a for a in (*_PREFERRED, *sorted(entry)) if a != "bytes" and a in entry
                     and _hasher(a) is not None), None)
        size = entry.get("bytes")
        out.append(ShardFile(rel=name, path=data_dir / name, size=int(size) if isinstance(size, int) else None,
                             algo=algo, digest=str(entry[algo]).lower() if algo else None, record=META))
    return out


class _NoBar:
    """A progress bar that shows nothing (:func:`_check` advances one)."""

    def update(self, n: int) -> None:
        pass


def _shard_file(data_dir: Path, stream: str, shard: dict[str, Any]) -> ShardFile:
    info = shard["raw_data"]
    if shard.get("compression") and shard.get("zip_data"):
        # A compressed stream may keep only the compressed file locally.
        if not (data_dir / stream / info["basename"]).exists():
            info = shard["zip_data"]
    rel = f"{stream}/{info['basename']}"
    hashes = info.get("hashes") or {}
    algo = next((a for a in (*_PREFERRED, *sorted(hashes)) if a in hashes and _hasher(a) is not None), None)
    size = info.get("bytes")
    return ShardFile(rel=rel, path=data_dir / rel, size=int(size) if size is not None else None, algo=algo,
                     digest=str(hashes[algo]).lower() if algo else None)


def _hasher(algo: str) -> Any:
    """A fresh incremental hash object for one of Streaming's algorithm names (``streaming.base.hashing``:
    xxhash's and hashlib's), or None for a name neither knows. Its ``hexdigest()`` after ``update`` over a
    whole file equals Streaming's ``get_hash(algo, file_bytes)``."""
    import xxhash

    if algo in xxhash.algorithms_available:
        return getattr(xxhash, algo)()
    if algo in hashlib.algorithms_available and not algo.startswith("shake_"):
        return hashlib.new(algo)
    return None


def file_digest(path: str | Path, algo: str = "xxh64", progress: Any = None) -> str:
    """Hex digest of a whole file, read in chunks of :data:`CHUNK` bytes; ``progress`` (a tqdm bar) is
    advanced by the bytes read."""
    h = _hasher(algo)
    if h is None:
        raise ValueError(f"unknown hash algorithm {algo!r}")
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            if progress is not None:
                progress.update(n)
    return h.hexdigest()


def _check(f: ShardFile, bar: Any) -> tuple[int, Optional[str]]:
    """(bytes hashed, problem or None) for one shard file."""
    try:
        size = f.path.stat().st_size
    except FileNotFoundError:
        bar.update(f.size or 0)
        return 0, "missing"
    except OSError as e:
        bar.update(f.size or 0)
        return 0, f"unreadable ({type(e).__name__}: {e})"
    if f.size is not None and size != f.size:
        bar.update(f.size)
        return 0, f"{size} bytes but {f.record} records {f.size} (truncated, extended or replaced)"
    if f.algo is None:
        bar.update(f.size or 0)
        return 0, None
    try:
        digest = file_digest(f.path, f.algo, bar)
    except OSError as e:
        return 0, f"unreadable ({type(e).__name__}: {e})"
    if digest != f.digest:
        return size, (f"{f.algo} checksum {digest} does not match the recorded {f.digest} (the file changed after "
                      "`memtrain prepare`)")
    return size, None


__all__ = ["CHUNK", "ShardFile", "VerifyReport", "check_recipe_data", "damaged", "file_digest", "prepared_file",
           "prepared_tokenizer", "settings_difference", "shard_files", "verify_folder",
           "verify_shards"]
