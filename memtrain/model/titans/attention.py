"""Attention for the Titans blocks: causal attention with a persistent prefix, sliding-window or
segment-local, document-masked.

Every Titans attention call has keys ``[prefix | context]``:

- the **prefix** is the block's N_p persistent tokens (Titans Section 3.3), visible to every query and
  never rotated by RoPE (as in titans-pytorch, whose persistent keys/values join after the rotary
  embedding); for MAC the retrieved long-term-memory tokens ``h_t`` follow the persistent tokens;
- the **context** keys are rotated with their positions and masked causally, by document (a query sees
  a key only inside its own document, as the anchor's attention does) and, for MAG / MAL, by a
  sliding window: query i sees context key j iff ``i - window < j <= i`` (``window`` keys, itself
  included).

Mask building reuses :mod:`memtrain.model.attention`: the backend is resolved by
:func:`~memtrain.model.attention.resolve_backend` (``auto``: flex on CUDA, sdpa elsewhere; flex on CPU
with gradients falls back to sdpa) and the call is :func:`~memtrain.model.attention.attend`, so the
same dense-mask sdpa reference and block-sparse flex paths serve both models. MAC's per-segment masks
are small (``segment_len x (N_p + 2 segment_len)``) and always dense.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch
from torch import nn

from memtrain.model.anchor import Attention, apply_rope
from memtrain.model.attention import AttentionMask, attend, resolve_backend

try:
    from torch.nn.attention.flex_attention import create_block_mask
except ImportError:  # pragma: no cover - resolve_backend never picks flex then
    create_block_mask = None  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------------
# Masks


def window_allowed(doc_ids: Optional[torch.Tensor], seq_len: int, window: Optional[int],
                   device: torch.device) -> torch.Tensor:
    """Boolean ``[B or 1, T, T]``: query i may see context key j (causal, same document, within the
    window when ``window`` is not None)."""
    i = torch.arange(seq_len, device=device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    allowed = allowed[None]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return allowed


def with_prefix(allowed: torch.Tensor, prefix: int) -> torch.Tensor:
    """Prepend ``prefix`` always-visible key columns: ``[B, Tq, Tk]`` -> dense sdpa mask
    ``[B, 1, Tq, prefix + Tk]``."""
    if prefix:
        ones = allowed.new_ones(*allowed.shape[:-1], prefix)
        allowed = torch.cat([ones, allowed], dim=-1)
    return allowed[:, None]


@functools.lru_cache(maxsize=None)
def _create_block_mask_accepts_compile() -> bool:
    return "_compile" in inspect.signature(create_block_mask).parameters


def sliding_window_mask(doc_ids: Optional[torch.Tensor], seq_len: int, prefix: int, window: int,
                        backend: str, device: torch.device) -> AttentionMask:
    """The MAG / MAL mask for queries ``[0, T)`` over keys ``[prefix | 0..T)`` (module docstring).

    ``backend`` is ``model.attention``; built once per forward and shared by all layers.
    """
    resolved = resolve_backend(backend, device)
    if doc_ids is not None and doc_ids.shape[-1] != seq_len:
        raise ValueError(f"doc_ids has length {doc_ids.shape[-1]}, expected {seq_len}")
    if resolved == "sdpa":
        return AttentionMask("sdpa", dense=with_prefix(window_allowed(doc_ids, seq_len, window, device), prefix))

    def context(b, q_idx, kv_idx):
        j = (kv_idx - prefix).clamp(min=0)
        ok = (j <= q_idx) & (q_idx - j < window)
        if doc_ids is not None:
            ok = ok & (doc_ids[b, q_idx] == doc_ids[b, j])
        return ok

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | context(b, q_idx, kv_idx)

    batch = None if doc_ids is None else doc_ids.shape[0]
    kwargs = {"_compile": True} if device.type == "cuda" and _create_block_mask_accepts_compile() else {}
    block_mask = create_block_mask(mask_mod, batch, None, seq_len, prefix + seq_len, device=device, **kwargs)
    return AttentionMask("flex", block_mask=block_mask)


def segment_mask(doc_ids: Optional[torch.Tensor], seg_len: int, prefix: int, device: torch.device) -> AttentionMask:
    """The MAC mask of one segment: queries = the segment's tokens, keys ``[prefix | h | S]`` where
    ``h`` (retrieved memory tokens) and ``S`` (the segment) are both causal and document-masked
    (``h_j`` is computed from token j, so a later ``h_j`` would leak the future). ``doc_ids`` is the
    segment's slice ``[B, seg_len]`` or None. Always dense sdpa."""
    allowed = window_allowed(doc_ids, seg_len, None, device)
    return AttentionMask("sdpa", dense=with_prefix(torch.cat([allowed, allowed], dim=-1), prefix))


# --------------------------------------------------------------------------------------------------
# The attention module


class PrefixAttention(Attention):
    """Multi-head attention of the anchor's layout (bias-free ``wq``/``wk``/``wv``/``wo``, optional
    grouped-query heads, qk-norm over the full projection width, RoPE) with an unrotated key prefix.

    ``forward(x_q, x_kv, cos_q, sin_q, cos_kv, sin_kv, n_unrotated, mask)``: queries from ``x_q``
    ``[B, Tq, d]`` rotated by ``cos_q``/``sin_q`` ``[B, Tq, 1, hd]``; keys/values from ``x_kv``
    ``[B, Tk, d]`` whose first ``n_unrotated`` rows keep no rotation and the rest are rotated by
    ``cos_kv``/``sin_kv`` ``[B, Tk - n_unrotated, 1, hd]``. Returns ``[B, Tq, d]``.
    """

    def forward(self, x_q: torch.Tensor, x_kv: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor,
                cos_kv: torch.Tensor, sin_kv: torch.Tensor, n_unrotated: int, mask: AttentionMask) -> torch.Tensor:
        q = self.queries(x_q, cos_q, sin_q)
        k, v = self.keys_values(x_kv)
        rotated = apply_rope(k[:, n_unrotated:], cos_kv, sin_kv)
        k = torch.cat([k[:, :n_unrotated], rotated], dim=1) if n_unrotated else rotated
        return self.attend_heads(q, k, v, mask)

    # The pieces of forward, for callers that project rows once and attend over them several times (MAC's
    # segments: the queries and the segment's own keys for all segments at once, per segment only the
    # retrieved rows'). Projections, norms and RoPE act row by row, so the pieces give forward's result.

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Normalised, RoPE-rotated queries ``[B, T, H, hd]`` of ``x`` ``[B, T, d]``."""
        B, T, _ = x.shape
        return apply_rope(self.q_norm(self.wq(x)).view(B, T, self.n_heads, self.head_dim), cos, sin)

    def kv_weight(self) -> torch.Tensor:
        """``wk``'s and ``wv``'s weights stacked ``[2 * kv_width, d]``, for :meth:`keys_values` over many inputs
        (MAC's segments): one GEMM per call each way instead of two, and one weight gradient to accumulate."""
        return torch.cat([self.wk.weight, self.wv.weight])

    def keys_values(self, x: torch.Tensor, cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                    kv_proj: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                    k_gain: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised keys and values ``[B, T, KV, hd]`` of ``x``; the keys rotated by ``cos``/``sin`` if given;
        ``kv_proj``: the projection by :meth:`kv_weight` (keys and values side by side), made once by the caller
        (MAC: a :class:`~memtrain.model.grouped_linear.GroupedLinear` of it); None: ``wk`` and ``wv``. ``k_gain``:
        an alias of ``k_norm``'s gain to normalise with (an :class:`~memtrain.model.anchor.RMSNorm` ``k_norm``;
        MAC: one per call from :func:`~memtrain.model.grouped_linear.fan_out`)."""
        B, T, _ = x.shape
        if kv_proj is None:
            k, v = self.wk(x), self.wv(x)
        else:
            k, v = kv_proj(x).split(self.n_kv_heads * self.head_dim, dim=-1)
        k = (self.k_norm(k) if k_gain is None else self.k_norm(k, k_gain)).view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        return (k if cos is None else apply_rope(k, cos, sin)), v

    def attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                     out_proj: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """Attention of ``q`` over ``k``, ``v`` (``[B, T, heads, hd]``) under ``mask``, then ``wo`` (or ``out_proj``,
        the same projection made by the caller): ``[B, Tq, d]``. Under autocast the norms return fp32 while ``v`` is
        bf16; attention runs in ``v``'s dtype."""
        B, Tq = q.shape[:2]
        out = attend(q.to(v.dtype).transpose(1, 2), k.to(v.dtype).transpose(1, 2), v.transpose(1, 2), mask)
        # `is None`, not `or`: torch 2.11's Dynamo cannot take the truth value of a function (a compiled MAC block's
        # `wo` is one) and fell back to eager for the whole segment loop
        proj = self.wo if out_proj is None else out_proj
        return proj(out.transpose(1, 2).reshape(B, Tq, self.n_heads * self.head_dim))


__all__ = ["PrefixAttention", "segment_mask", "sliding_window_mask", "window_allowed", "with_prefix"]
