"""Tokenizers: a small protocol and its two implementations.

:class:`SentencePieceTokenizer` wraps a SentencePiece ``.model`` file and can train one
reproducibly (:meth:`SentencePieceTokenizer.train`); :class:`HFTokenizer` wraps a local Hugging Face
tokenizer folder. :func:`load_tokenizer` picks one by path. The end-of-text id (``eot_id``) that
separates packed documents is the tokenizer's end-of-sequence token.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol, runtime_checkable

from memtrain.errors import DataError

# SentencePiece skips training sentences longer than this many bytes; longer lines are cut into pieces.
_MAX_SENTENCE_BYTES = 4096
# The trainer samples at most this many sentences (seeded), which bounds its memory and time.
_MAX_TRAIN_SENTENCES = 2_000_000
# Threads the trainer runs, the same on every machine. The model depends on this number: the unigram trainer
# splits the sentences into one part per thread and adds the parts' expected piece counts in floating point, so
# 1, 2, 4 and 16 threads gave four different models of the built-in corpus (measured 2026-11-29). It used to be
# the host's CPU count, so one recipe gave other data on another machine. 2 is what every result recorded in
# the README was prepared with (on 2-core machines). The cost is small: 348K sentences took 14.6 s with 2
# threads and 12.6 s with 16 on 2 cores; at the 2M-sentence cap, about a minute more than 16 threads would take
# on a many-core host, once per prepared folder.
TRAIN_THREADS = 2
# Encoding gives the same ids on any number of threads; it uses the CPUs this process may run on, up to 16.
_MAX_ENCODE_THREADS = 16


@runtime_checkable
class Tokenizer(Protocol):
    """What packing and evaluation need from a tokenizer."""

    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def pieces(self) -> list[str]: ...


class SentencePieceTokenizer:
    """A SentencePiece model; ``eot_id`` is its EOS id. No BOS/EOS are added by :meth:`encode`."""

    def __init__(self, model_path: str | Path):
        import sentencepiece as spm

        self.path = Path(model_path)
        if not self.path.is_file():
            raise DataError(f"tokenizer model {str(self.path)!r} does not exist; set data.tokenizer.path to a "
                            "SentencePiece .model file or leave it unset to train one")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise DataError(f"{self.path} is not a SentencePiece model ({e}); check data.tokenizer.path") from None
        self.vocab_size: int = self.sp.get_piece_size()
        self.eot_id: int = self.sp.eos_id()
        if self.eot_id < 0:
            raise DataError(f"SentencePiece model {self.path} has no end-of-sequence piece; memtrain needs "
                            "one to separate documents (train it with eos_id >= 0)")
        from memtrain.parallel.dist import cpu_threads

        self._threads = min(cpu_threads(1), _MAX_ENCODE_THREADS)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=self._threads)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def pieces(self) -> list[str]:
        """Every id's piece, in id order."""
        return [self.sp.id_to_piece(i) for i in range(self.vocab_size)]

    @classmethod
    def train(cls, texts: Iterable[str], model_path: str | Path, vocab_size: int,
              model_type: str = "unigram", seed: int = 0, byte_fallback: bool = False) -> "SentencePieceTokenizer":
        """Train on ``texts`` and write ``model_path``.

        Documents are split into lines (newlines become the user-defined piece ``"\\n"`` at encode
        time, so text round-trips); the random generator is seeded and the trainer always runs
        :data:`TRAIN_THREADS` threads, so equal inputs give equal models on any machine.
        """
        import sentencepiece as spm

        model_path = Path(model_path)
        if model_path.suffix != ".model":
            raise ValueError(f"model_path must end in .model, got {model_path}")
        model_path.parent.mkdir(parents=True, exist_ok=True)
        spm.set_random_generator_seed(seed)
        sentences = list(_training_sentences(texts))
        if not sentences:
            raise DataError("no text to train the tokenizer on; add documents to data.sources")
        # Write the model through a buffer rather than a model_prefix, which the model file would
        # record: equal inputs then give byte-identical files wherever they are written.
        buffer = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences),
                model_writer=buffer,
                vocab_size=vocab_size,
                model_type=model_type,
                # Keep text as written: no NFKC folding or whitespace squeezing, so decode(encode(x)) == x.
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                byte_fallback=byte_fallback,
                # Without byte fallback an unseen character would become <unk>; keep all of them.
                character_coverage=0.9995 if byte_fallback else 1.0,
                user_defined_symbols=["\n"],
                unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                input_sentence_size=_MAX_TRAIN_SENTENCES,
                shuffle_input_sentence=True,
                max_sentence_length=_MAX_SENTENCE_BYTES,
                num_threads=TRAIN_THREADS,
                minloglevel=2,
            )
        except RuntimeError as e:
            m = re.search(r"Vocabulary size (?:is )?too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e))
            if m:
                raise DataError(f"the corpus is too small to train a tokenizer with {m.group(1)} tokens (at most "
                                f"{m.group(2)} are possible); set data.tokenizer.vocab_size to {m.group(2)} or "
                                "less, or add more text to data.sources") from None
            m = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(e))
            if m:
                fix = ("raise data.tokenizer.vocab_size or set data.tokenizer.byte_fallback: false" if byte_fallback
                       else "raise data.tokenizer.vocab_size")
                raise DataError(f"data.tokenizer.vocab_size {m.group(1)} cannot hold the {m.group(2)} pieces the "
                                "corpus needs (its characters, special tokens and, with byte fallback, 256 byte "
                                f"pieces); {fix}") from None
            raise DataError(f"training the SentencePiece tokenizer failed: {e}; check data.tokenizer "
                            "settings") from None
        model_path.write_bytes(buffer.getvalue())
        return cls(model_path)


def _training_sentences(texts: Iterable[str]) -> Iterable[str]:
    for text in texts:
        for line in text.split("\n"):
            if not line.strip():
                continue
            data = line.encode("utf-8")
            if len(data) <= _MAX_SENTENCE_BYTES:
                yield line
                continue
            # cut at character boundaries (errors="ignore" drops a split character's partial bytes)
            for start in range(0, len(data), _MAX_SENTENCE_BYTES):
                piece = data[start:start + _MAX_SENTENCE_BYTES].decode("utf-8", errors="ignore")
                if piece.strip():
                    yield piece


class HFTokenizer:
    """A local Hugging Face tokenizer folder; ``eot_id`` is its ``eos_token_id``."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.path = Path(path)
        if not any(self.path.iterdir()):
            raise DataError(f"Hugging Face tokenizer folder {self.path} is empty; point data.tokenizer.path at a "
                            "folder save_pretrained wrote, or leave it unset to train a tokenizer")
        try:
            self.tok = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
            # transformers' errors here can be long (every model type it knows) or odd (an AttributeError for a
            # folder without a config): the first line, cut short, and what the folder needs
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            first = first if len(first) <= 200 else first[:200] + " ..."
            raise DataError(f"could not load a Hugging Face tokenizer from {self.path} ({type(e).__name__}: {first}); "
                            "the folder must hold what save_pretrained writes (tokenizer.json with "
                            "tokenizer_config.json, or the slow tokenizer's files)") from None
        if self.tok.eos_token_id is None:
            raise DataError(f"Hugging Face tokenizer {self.path} has no eos_token; memtrain needs one to "
                            "separate documents (set eos_token in its tokenizer_config.json)")
        self.eot_id: int = int(self.tok.eos_token_id)
        self.vocab_size: int = len(self.tok)  # includes added tokens, unlike tok.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(i) for i in ids])

    def pieces(self) -> list[str]:
        """Every id's token, in id order (an id the vocabulary skips: the empty string)."""
        return [t or "" for t in self.tok.convert_ids_to_tokens(list(range(self.vocab_size)))]


# Encoded by tokenizer_fingerprint: words, digits, punctuation, runs of spaces and newlines, accents, CJK, an emoji,
# so that a change to a tokenizer's normalisation, pre-tokenisation or merges shows even where its pieces do not.
_PROBE = ("The quick brown fox jumps over the lazy dog. 0123456789 3.14159 -42 +7% $1,000.00 (a) [b] {c} <d>\n"
          "  two spaces,\tand a tab;  \n\nblank lines: e-mail foo@example.com, https://example.org/a?b=c#d\n"
          "caf\u00e9 na\u00efve \u00dcber \u00c5ngstr\u00f6m \u03b1\u03b2\u03b3 \u4e2d\u6587 \u65e5\u672c\u8a9e "
          "\ud55c\uad6d\uc5b4 \u0440\u0443\u0441\u0441\u043a\u0438\u0439 \U0001f600 "
          "def f(x):\n    return x ** 2  # comment")


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    """What identifies a tokenizer's behaviour, not its files: its vocabulary size, end-of-text id, and the
    xxh64 of every id's piece and of a fixed text's ids (:data:`_PROBE`). ``memtrain prepare`` records it in
    meta.json; the commands that read text through the tokenizer of a prepared folder compare it
    (:func:`memtrain.data.verify.prepared_tokenizer`). The same tokenizer written again with other bytes (another
    JSON layout, settings that do not touch encoding) keeps it; another vocabulary, end-of-text token,
    normalisation or merge table changes it (tests/test_data_integrity.py)."""
    import xxhash

    h = xxhash.xxh64()
    for piece in tokenizer.pieces():
        h.update(piece.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    h.update(b"\1" + ",".join(str(i) for i in tokenizer.encode(_PROBE)).encode())
    return {"vocab_size": int(tokenizer.vocab_size), "eot_id": int(tokenizer.eot_id), "xxh64": h.hexdigest()}


def load_tokenizer(path: str | Path, base: Optional[str | Path] = None) -> Tokenizer:
    """A ``.model`` file -> :class:`SentencePieceTokenizer`; a folder -> :class:`HFTokenizer`.

    A relative ``path`` is taken relative to ``base`` when given (meta.json stores it that way).
    """
    p = Path(path).expanduser()
    if base is not None and not p.is_absolute():
        p = Path(base) / p
    if p.is_dir():
        return HFTokenizer(p)
    if p.is_file():
        if p.suffix == ".model":
            return SentencePieceTokenizer(p)
        raise DataError(f"tokenizer {str(p)!r} is neither a SentencePiece .model file nor a Hugging Face "
                        "tokenizer folder; fix data.tokenizer.path")
    raise DataError(f"tokenizer {str(p)!r} does not exist; set data.tokenizer.path to a SentencePiece .model "
                    "file or a local Hugging Face tokenizer folder, or leave it unset to train one")


__all__ = ["HFTokenizer", "SentencePieceTokenizer", "Tokenizer", "load_tokenizer", "tokenizer_fingerprint"]
