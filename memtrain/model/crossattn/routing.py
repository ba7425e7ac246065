"""Chapter routing and routed memory attention (crossattn-memory-banks paper, Section 4).

The router (eq. 8) scores the ``C`` chapters, ``s = softmax(W_r h + b_r)``, from the mean-pooled
sequence (``sequence`` routing: one choice per sequence; it sees the whole sequence, so it is not
causal) or from each token (``token`` routing, Section 4.4: causal) and keeps the ``top_k``. In a
packed row of several documents "the sequence" is each document (:class:`DocumentSegments`): every
document is pooled and routed on its own, so a document's routing, like its attention, does not
depend on the documents packed beside it. The
routing weights enter the attention as a bias ``log s_c`` on the logits of chapter ``c``'s tokens, so

    out_t = sum_c s_c Z_c o_c / sum_c s_c Z_c,   Z_c = sum_{j in c} exp(q_t . k_j / sqrt(D)),

with ``o_c`` the attention over chapter ``c`` alone: full-bank attention restricted to the routed
chapters, each chapter's share scaled by its router score; the router gets gradients through it.
A Switch-style load-balancing loss ``C * sum_c f_c P_c`` (``f_c`` the share of routing decisions that
picked ``c``, ``P_c`` its mean router probability) keeps chapters in use.

:func:`routed_attention` projects the keys and values of the *unique* routed chapters once and hands
them to :mod:`memtrain.kernels.routed_attention`: Triton kernels on CUDA, and their PyTorch reference
elsewhere, which never materialises per-token gathered keys either (the (token, chapter) pairs are
grouped by chapter, each group's attention is computed against its chapter with its log-sum-exp, and
every token's chapters are merged by their log-sum-exps plus log weights, as split-K attention merges
partial softmaxes). Memory is ``O(unique chapters x chapter size)`` plus one small row per pair.
:func:`dense_routed_attention` is the same function written as masked attention over the whole bank,
for tests.

With ``top_k = 1`` a token reads one chapter, whose log weight shifts every logit of that read alike and
cancels in its softmax: the language-model loss then gives the router no gradient (as the paper's hard
top-k selection gives it none at any ``k``), and only the load-balancing loss trains it (the trainer says
so at the start of such a run: :func:`memtrain.launcher.train.routing_notes`).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.kernels import routed_attention as routed_kernels


class Routing(NamedTuple):
    """A routing decision: ``chapters`` ``[B, T, k]`` (long), ``log_weights`` ``[B, T, k]`` (log router
    scores of those chapters), ``probs`` ``[N, C]`` the router probabilities of every decision (N = B
    for sequence routing, the documents of the batch when its rows are packed, B*T for token routing),
    ``loss`` the load-balancing loss (unweighted), ``decisions`` ``[N, k]`` the chapters each decision
    picked, ``per_row`` whether every token of row ``b`` reads ``decisions[b]`` (sequence routing of
    rows that hold one document each)."""

    chapters: torch.Tensor
    log_weights: torch.Tensor
    probs: torch.Tensor
    loss: torch.Tensor
    decisions: torch.Tensor
    per_row: bool


class DocumentSegments(NamedTuple):
    """The documents of a packed batch, for sequence routing: ``index`` ``[B*T]`` the document (0 ..
    ``count - 1``, numbered row by row) of each position, ``sizes`` ``[count]`` their lengths."""

    index: torch.Tensor
    sizes: torch.Tensor
    count: int

    @classmethod
    def of(cls, doc_ids: Optional[torch.Tensor]) -> Optional["DocumentSegments"]:
        """The documents of ``doc_ids`` ``[B, T]`` (:func:`memtrain.data.loader.document_ids`); None when
        every row holds one document (or ``doc_ids`` is None), where a row is its own sequence. Reads one
        number back from the device."""
        if doc_ids is None or doc_ids.shape[1] < 2:
            return None
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        index = starts.reshape(-1).cumsum(0) - 1
        count = int(index[-1]) + 1
        if count == doc_ids.shape[0]:
            return None
        return cls(index, torch.bincount(index, minlength=count), count)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, d]`` -> ``[count, d]``: each document's mean."""
        flat = x.reshape(-1, x.shape[-1])
        total = flat.new_zeros(self.count, flat.shape[-1]).index_add_(0, self.index, flat)
        return total / self.sizes[:, None].to(flat.dtype)


class ChapterRouter(nn.Module):
    """Eq. 8: ``softmax(W_r h + b_r)`` over ``chapters``; top-``top_k`` per sequence or per token."""

    def __init__(self, d_model: int, chapters: int, top_k: int, mode: str = "sequence"):
        super().__init__()
        if mode not in ("sequence", "token"):
            raise ValueError(f"routing must be 'sequence' or 'token', got {mode!r}")
        if not 1 <= top_k <= chapters:
            raise ValueError(f"top_k must lie in [1, {chapters}], got {top_k}")
        self.chapters, self.top_k, self.mode = chapters, top_k, mode
        self.proj = nn.Linear(d_model, chapters)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.proj.weight.is_meta:
            return
        nn.init.normal_(self.proj.weight, std=1.0 / math.sqrt(self.proj.in_features))
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor, documents: Optional[DocumentSegments] = None) -> Routing:
        """``h`` ``[B, T, d]`` (the layer's normalised input); ``documents`` the rows' documents when they
        are packed (sequence routing then routes each document; token routing ignores it)."""
        B, T, _ = h.shape
        acc = torch.promote_types(h.dtype, torch.float32)  # the router in fp32 (float64 stays float64)
        per_row = self.mode == "sequence" and documents is None
        if self.mode == "token":
            x = h.to(acc).reshape(B * T, -1)
        else:
            x = h.to(acc).mean(dim=1) if per_row else documents.mean(h.to(acc))
        logits = F.linear(x, self.proj.weight.to(acc), self.proj.bias.to(acc))
        probs = torch.softmax(logits, dim=-1)  # [N, C]
        top, ids = probs.topk(self.top_k, dim=-1)
        counts = torch.zeros(self.chapters, device=h.device, dtype=acc)
        counts.scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), device=h.device, dtype=acc))
        share = counts / ids.numel()  # f_c
        loss = self.chapters * (share * probs.mean(dim=0)).sum()
        log_w = torch.log(top.clamp_min(1e-30))
        if per_row:
            chapters, log_w = ids[:, None].expand(B, T, self.top_k), log_w[:, None].expand(B, T, self.top_k)
        elif self.mode == "sequence":  # each position reads its document's chapters
            chapters, log_w = ids[documents.index].view(B, T, self.top_k), log_w[documents.index].view(B, T, self.top_k)
        else:
            chapters, log_w = ids.view(B, T, self.top_k), log_w.view(B, T, self.top_k)
        return Routing(chapters, log_w, probs, loss, ids, per_row)


# --------------------------------------------------------------------------------------------------
# Routed attention


def routed_attention(q: torch.Tensor, kv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                     chapters: torch.Tensor, log_weights: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Attention of every query to its routed chapters (module docstring), grouped by chapter.

    ``q`` ``[B, T, H, D]``; ``kv(ids)`` returns the keys and values of chapters ``ids`` (``[U]``) as
    ``[U, N_c, H, D]`` each; ``chapters`` / ``log_weights`` ``[B, T, k]``. Returns ``[B, T, H, D]``. The
    keys and values of the unique routed chapters are projected once; the attention itself is
    :func:`memtrain.kernels.routed_attention.token_routed_attention` (``impl``: the Triton kernel on CUDA
    with ``auto``, else the grouped PyTorch reference)."""
    B, T, H, D = q.shape
    k = chapters.shape[-1]
    unique, which = torch.unique(chapters.reshape(-1), return_inverse=True)  # the chapters read at all
    keys, values = kv(unique)  # [U, Nc, H, D]: projected once per unique chapter
    out = routed_kernels.token_routed_attention(q.reshape(B * T, H, D), keys, values, which.view(B * T, k),
                                                log_weights.reshape(B * T, k), impl)
    return out.view(B, T, H, D)


def sequence_routed_attention(q: torch.Tensor, kv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                              chapters: torch.Tensor, log_weights: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """:func:`routed_attention` for sequence routing (every token of a sequence reads the same ``k``
    chapters: ``chapters`` / ``log_weights`` ``[B, k]``):
    :func:`memtrain.kernels.routed_attention.sequence_routed_attention` (the kernel reads the chapters from
    the shared storage; the reference gathers each sequence's ``k * N_c`` keys, eq. 10, for one fused
    attention with the log weights as a per-key bias)."""
    unique, which = torch.unique(chapters, return_inverse=True)
    keys, values = kv(unique)  # [U, Nc, H, D]
    return routed_kernels.sequence_routed_attention(q, keys, values, which, log_weights, impl)


def full_bank_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Unrouted memory attention (eq. 4): ``q`` ``[B, T, H, D]`` to the whole bank's ``keys`` /
    ``values`` ``[N_m, H, D]``."""
    B = q.shape[0]
    k = keys.transpose(0, 1)[None].expand(B, -1, -1, -1).to(q.dtype)  # [B, H, N_m, D], no copy
    v = values.transpose(0, 1)[None].expand(B, -1, -1, -1).to(q.dtype)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v).transpose(1, 2)


def dense_routed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chapter_tokens: int,
                           chapters: torch.Tensor, log_weights: torch.Tensor) -> torch.Tensor:
    """The definition, for tests: masked attention over the whole bank (``keys`` / ``values``
    ``[N_m, H, D]``) where token ``t`` sees the tokens of its routed chapters, each logit biased by its
    chapter's log weight, all others masked out. Materialises ``[B, T, H, N_m]``."""
    B, T, H, D = q.shape
    C = keys.shape[0] // chapter_tokens
    bias = torch.full((B, T, C), float("-inf"), dtype=torch.float64, device=q.device)
    bias.scatter_(-1, chapters, log_weights.double())
    bias = bias.repeat_interleave(chapter_tokens, dim=-1)  # [B, T, N_m]
    logits = torch.einsum("bthd,nhd->bthn", q.double(), keys.double()) / math.sqrt(D) + bias[:, :, None]
    return torch.einsum("bthn,nhd->bthd", torch.softmax(logits, dim=-1), values.double())


__all__ = ["ChapterRouter", "DocumentSegments", "Routing", "dense_routed_attention", "full_bank_attention",
           "routed_attention", "sequence_routed_attention"]
