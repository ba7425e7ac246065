"""What every evaluation shares: the memory argument of a batch, prompt encoding, right-padded
batches, result cells and the JSON report file.

Used by :mod:`memtrain.eval.hierarchical` (perplexity, fact probes), :mod:`memtrain.eval.longctx`
(S-NIAH, BABILong) and :mod:`memtrain.eval.evaluate` (the command), so none of them imports another
for a helper. Imports torch only.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch

from memtrain.parallel.checkpoint_folder import write_json_atomic


def batch_memory(bank: Any, mode: str, batch_size: int, ids: Optional[torch.Tensor], device: torch.device):
    """The ``memory`` argument of the model for one batch: the bank's rows for ``ids [B, p]``
    (fetched, blocked, corrupted; evaluation fetches are not counted), the generic memory for every
    sequence (``generic``, Section 4), or None (``none``: the anchor alone)."""
    if mode == "none":
        return None
    from memtrain.model.hierarchical import FetchedMemory

    if mode == "generic":
        return FetchedMemory.all_generic(batch_size, bank.layout.depth, device)
    if ids is None:
        raise ValueError(f"memory mode {mode!r} needs cluster ids")
    return bank.fetch(ids.to(device), count=False)


def padding_changes_logits(model: Any) -> bool:
    """Whether right padding changes the logits of the sequence it pads: a cross-attention memory with
    sequence routing, whose router mean-pools every position of a row, padding included
    (crossattn-memory-banks paper, eq. 8; :attr:`memtrain.model.crossattn.CrossAttnMemory.pools_sequence`).
    Every other model is causal, so padding after a sequence never changes its logits. The evaluations
    batch such a model's sequences by equal length (no padding), so that a sequence's result does not
    depend on what else shares its batch."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()  # also inside a wrapper
    return any(getattr(m, "pools_sequence", False) is True for m in modules)


def length_batches(order: Sequence[int], lengths: Sequence[int], batch_size: int, same_length: bool,
                   max_rows: Optional[Callable[[int], int]] = None) -> list[list[int]]:
    """``order`` cut into batches of consecutive items, at most ``batch_size`` each (and ``max_rows(length of the
    batch's first item)`` when given); ``same_length``: a batch also ends where the length changes, so nothing in
    it is padded (streamed models, and those whose logits padding changes: :func:`padding_changes_logits`)."""
    out: list[list[int]] = []
    for i in order:
        cur = out[-1] if out else None
        if (cur is not None and len(cur) < batch_size and (not same_length or lengths[cur[0]] == lengths[i])
                and (max_rows is None or len(cur) < max_rows(lengths[cur[0]]))):
            cur.append(i)
        else:
            out.append([i])
    return out


def answer_start(full: Sequence[int], prompt: Sequence[int]) -> int:
    """The first answer position in ``full`` = ``encode(prompt + answer)``: the length of its common prefix with
    ``prompt`` = ``encode(prompt)``. A tokenizer may merge across the boundary, so the answer is whatever the
    full encoding adds to the prompt's; encoding the answer alone would not give the tokens the model reads
    in context (memtrain's SentencePiece keeps whitespace as written and starts every encoding with its
    word-start piece, so ``" 4721"`` alone is ``▁ ▁ 4 7 2 1`` where ``is 4721`` has ``▁is ▁ 4 7 2 1``)."""
    c = 0
    for a, b in zip(full, prompt):
        if a != b:
            break
        c += 1
    return c


def right_padded(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of token lists, right-padded with ``pad_id``: (tokens ``[B, T]`` long, lengths ``[B]``).
    Padding after a sequence never changes its logits unless :func:`padding_changes_logits`."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    tokens = torch.full((len(seqs), int(lengths.max()) if len(seqs) else 0), pad_id, dtype=torch.long)
    for row, s in enumerate(seqs):
        tokens[row, :len(s)] = torch.tensor(list(s), dtype=torch.long)
    return tokens, lengths


def accuracy_cell(correct: Sequence[bool], **extra: Any) -> dict[str, Any]:
    """One result cell: ``{"accuracy", "correct", "count", **extra}`` (accuracy None for an empty group)."""
    count, right = len(correct), int(sum(bool(c) for c in correct))
    return {"accuracy": right / count if count else None, "correct": right, "count": count, **extra}


class PromptEncoder:
    """Token ids of a prompt with the run's tokenizer: memtrain's SentencePiece model as the training
    data was tokenized (no BOS); a Hugging Face tokenizer gets its BOS first when it adds one by default
    (Llama's does), as pretrained models expect. ``count`` is the length without the BOS (the generator
    measures haystack units with it)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.prefix: list[int] = []
        tok = getattr(tokenizer, "tok", None)  # memtrain.data.tokenizer.HFTokenizer
        bos = getattr(tok, "bos_token_id", None)
        if tok is not None and bos is not None:
            try:
                first = tok("a").input_ids[:1]
            except Exception:  # pragma: no cover - exotic tokenizers
                first = []
            if first == [bos]:
                self.prefix = [int(bos)]
        self._count = functools.lru_cache(maxsize=1 << 16)(lambda s: len(tokenizer.encode(s)))

    def count(self, text: str) -> int:
        return self._count(text) if len(text) <= 4096 else len(self.tokenizer.encode(text))

    def encode(self, text: str) -> list[int]:
        return self.prefix + [int(t) for t in self.tokenizer.encode(text)]


__all__ = ["PromptEncoder", "accuracy_cell", "answer_start", "batch_memory", "length_batches", "padding_changes_logits",
           "right_padded", "write_json_atomic"]
