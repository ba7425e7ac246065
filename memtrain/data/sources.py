"""Reading raw documents from the recipe's ``data.sources``.

A source is ``"builtin"`` (the generated corpus of :mod:`memtrain.data.builtin`), ``"builtin:longtail"``
(the Zipf-frequency corpus of :mod:`memtrain.data.longtail`), ``"builtin:tasks"`` (the built-in corpus
mixed with S-NIAH and BABILong-style training examples that fit ``data.seq_len``,
:func:`memtrain.data.tasks.task_documents`; Titans Sections 5.3-5.4) or a local path or
glob of files: ``.txt`` (one document per file), ``.jsonl`` / ``.json`` (one document per record, in
the field ``data.text_field``) or ``.parquet`` (one document per row, same field). Files are read with
Hugging Face ``datasets`` in streaming mode, one file at a time, so nothing is cached under
``~/.cache`` and every error can name the file at fault.

Documents that are empty or whitespace-only are skipped and counted in :class:`ReadStats`
(``skipped_empty``); they would only add end-of-text tokens to the packed stream.
"""

from __future__ import annotations

import codecs
import glob
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from memtrain.errors import DataError

BUILTIN = "builtin"
LONGTAIL = "builtin:longtail"
TASKS = "builtin:tasks"
BUILTINS = (BUILTIN, LONGTAIL, TASKS)
# extension -> (datasets builder, extra builder arguments)
_FORMATS: dict[str, tuple[str, dict]] = {
    ".txt": ("text", {"sample_by": "document", "encoding": "utf-8"}),
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
}


@dataclass
class ReadStats:
    """What :func:`read_documents` saw; filled in while its iterator is consumed."""

    documents: int = 0  # yielded, i.e. non-empty
    skipped_empty: int = 0
    files: list[str] = field(default_factory=list)


def resolve_sources(sources: list[str], missing_ok: bool = False) -> list[str]:
    """Expand each source into ``"builtin"`` or a sorted list of existing files, checking extensions.
    ``missing_ok``: a source that matches no file adds nothing, instead of a DataError."""
    out: list[str] = []
    for source in sources:
        if source in BUILTINS:
            out.append(source)
            continue
        if source.startswith(BUILTIN + ":"):
            raise DataError(f"unknown built-in corpus {source!r} in data.sources; use {BUILTIN!r}, {LONGTAIL!r} "
                            f"or {TASKS!r}")
        pattern = os.path.expanduser(source)
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        elif os.path.isdir(pattern):
            raise DataError(f"data source {source!r} is a folder; name its files with a glob such as "
                            f"'{source.rstrip('/')}/*.jsonl' in data.sources")
        else:
            matches = [pattern] if os.path.isfile(pattern) else []
        if not matches and not missing_ok:
            raise DataError(f"no files match data source {source!r} (relative paths start at "
                            f"{os.getcwd()}); check data.sources")
        for path in matches:
            if Path(path).suffix.lower() not in _FORMATS:
                raise DataError(f"data source file {path!r} has an unsupported extension; use "
                                f"{', '.join(_FORMATS)} files or 'builtin' in data.sources")
        out.extend(matches)
    # A file (or built-in corpus) named twice, by repeated or overlapping sources, would be read twice: its
    # documents would count double and, split apart, land in both the training and the validation split.
    seen: dict[str, str] = {}
    for item in out:
        key = item if item in BUILTINS else os.path.realpath(item)
        if key in seen:
            also = f" (also as {seen[key]!r})" if seen[key] != item else ""
            raise DataError(f"data source {item!r}{also} is named twice by data.sources (a repeated entry or "
                            "overlapping globs); its documents would be read twice and land in both splits: name "
                            "each file once")
        seen[key] = item
    return out


def read_documents(sources: list[str], text_field: str = "text", stats: Optional[ReadStats] = None,
                   cache_dir: Optional[str | Path] = None, seq_len: int = 2048) -> Iterator[str]:
    """Yield the non-empty documents of ``sources`` in order (sources, then sorted files, then rows).

    ``stats``, when given, is updated as documents are read. ``cache_dir`` is where ``datasets`` may
    put scratch files (``prepare`` passes a folder inside its temporary build directory); by default
    a temporary directory removed when the iterator finishes. ``seq_len`` (``data.seq_len``) sizes the
    ``builtin:tasks`` examples.
    Raises :class:`DataError` for missing files, unsupported extensions, bytes that are not UTF-8 and
    files whose records lack ``text_field``. (JSON lines are read in blocks: a record without the field
    in a block where others have it reads as null, and counts as an empty document.)
    """
    stats = stats if stats is not None else ReadStats()
    files = resolve_sources(sources)  # fail on a bad source before reading anything
    # datasets writes lock files even when streaming; keep them out of ~/.cache
    with tempfile.TemporaryDirectory(prefix="memtrain-datasets-") as scratch:
        for path in files:
            stats.files.append(path)
            docs = _builtin(path, seq_len) if path in BUILTINS else _read_file(path, text_field, cache_dir or scratch)
            for text in docs:
                if text.strip():
                    stats.documents += 1
                    yield text
                else:
                    stats.skipped_empty += 1


def _builtin(name: str = BUILTIN, seq_len: int = 2048) -> Iterator[str]:
    if name == TASKS:
        import random

        from memtrain.data.builtin import builtin_documents
        from memtrain.data.tasks import task_documents

        docs = builtin_documents(seed=0) + task_documents(seq_len)
        random.Random("builtin:tasks").shuffle(docs)  # tasks spread over the packed samples
        yield from docs
        return
    if name == LONGTAIL:
        from memtrain.data.longtail import longtail_documents

        yield from longtail_documents(seed=0)
        return
    from memtrain.data.builtin import builtin_documents

    yield from builtin_documents(seed=0)


def _read_file(path: str, text_field: str, cache_dir: str | Path) -> Iterator[str]:
    import datasets

    builder, kwargs = _FORMATS[Path(path).suffix.lower()]
    column = "text" if builder == "text" else text_field
    if _holds_nothing(path, builder):  # as an empty .txt: no documents (the JSON and parquet readers raised
        return                          # StopIteration / ArrowInvalid on an empty file)
    # Progress bars per file would flood the terminal; prepare draws its own.
    datasets.disable_progress_bars()
    # Each load_dataset call otherwise sends a download-count request to the Hub (3 s timeout),
    # per file, even for local files; clusters' compute nodes often have no network at all.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        ds = datasets.load_dataset(builder, data_files=[os.path.abspath(path)], split="train", streaming=True,
                                   cache_dir=str(cache_dir), **kwargs)
        for row in ds:
            if column not in row:
                raise DataError(f"{path} has a record without the field {text_field!r}; set data.text_field "
                                f"to the field holding the text (this record has: {', '.join(map(str, row))})")
            text = row[column]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise DataError(f"{path}: field {text_field!r} holds {type(text).__name__}, not text; set "
                                "data.text_field to a field of strings")
            yield text
    except DataError:
        raise
    except Exception as e:  # the loaders raise assorted pyarrow/json/unicode errors
        bad = _first_invalid_utf8(path) if builder != "parquet" else None
        if bad is not None:
            raise DataError(f"{path} is not valid UTF-8 (first bad byte at offset {bad}); re-encode it "
                            "as UTF-8 or remove it from data.sources") from None
        if isinstance(e, UnicodeDecodeError):
            raise DataError(f"{path} is not valid UTF-8 ({e}); re-encode it as UTF-8") from None
        raise DataError(f"could not read {path} as {builder}: {type(e).__name__}: {e}; check the file or "
                        "remove it from data.sources") from e


def _holds_nothing(path: str, builder: str) -> bool:
    """Whether ``path`` is empty: no bytes (or only whitespace, for JSON), or a parquet file of no rows."""
    size = os.path.getsize(path)
    if size == 0:
        return True
    if builder == "json" and size <= 1 << 16:
        with open(path, "rb") as f:
            return not f.read().strip()
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows == 0
        except Exception:  # noqa: BLE001 - not a parquet file: the reader's own error names it
            return False
    return False


def _first_invalid_utf8(path: str, chunk: int = 1 << 20) -> Optional[int]:
    """Byte offset of the first invalid UTF-8 sequence in ``path``, or None if it decodes cleanly."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            pending = len(decoder.getstate()[0])  # bytes of a split character carried from the last block
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                return offset - pending + e.start
            if not block:
                return None
            offset += len(block)
