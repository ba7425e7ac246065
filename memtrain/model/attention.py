"""Document-masked causal self-attention: mask construction and the attention call.

A packed training sequence holds several documents separated by EOT tokens; a query may attend to a
key only if the key is not in the future *and* belongs to the same document (hierarchical-memories
paper, Appendix A.1: sequences are built with dataset decomposition, where no attention crosses
document boundaries). This module owns that rule for every attention path:

- ``sdpa``: :func:`torch.nn.functional.scaled_dot_product_attention`. Without document ids it uses
  ``is_causal=True`` (FlashAttention on GPU); with document ids it takes a dense boolean mask
  ``[B, 1, T, T]``. The dense mask is the reference path and the one that runs everywhere.
- ``flex``: :func:`torch.nn.attention.flex_attention.flex_attention` with a block-sparse
  ``BlockMask`` built by ``create_block_mask`` from the same rule; fully masked blocks are skipped,
  which is what makes long packed sequences cheap on GPU. It is compiled on CUDA and runs eagerly
  (unfused, for checking) elsewhere; flex has no CPU backward, so on CPU with gradients enabled the
  dense-mask sdpa path stands in for it.
- ``auto``: flex on CUDA when it can be imported, sdpa otherwise.

With a sliding window of ``w`` keys (``model.attention_window``; the SWA baseline of Titans Section 5.2,
Table 2), a query at t additionally sees only keys s with ``t - s < w`` (itself included); plain causal
sdpa then takes the dense mask, and the flex ``mask_mod`` adds the same condition.

Masks are built once per forward by :func:`build_attention_mask` and shared by all layers (the flex
``BlockMask`` too: one ``create_block_mask`` per batch, compiled on CUDA, outside the compiled blocks).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

try:  # flex attention appeared in torch 2.5; keep sdpa working if an older or trimmed build lacks it
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _FLEX_IMPORT_ERROR: Optional[str] = None
except ImportError as e:  # pragma: no cover - depends on the torch build
    create_block_mask = flex_attention = None  # type: ignore[assignment]
    _FLEX_IMPORT_ERROR = str(e)

BACKENDS = ("auto", "sdpa", "flex")


def flex_available() -> bool:
    """Whether ``torch.nn.attention.flex_attention`` can be imported in this torch build."""
    return flex_attention is not None


def resolve_backend(backend: str, device: torch.device, grad: Optional[bool] = None) -> str:
    """Map ``auto`` to the concrete path for ``device``; return ``"sdpa"`` or ``"flex"``.

    Flex attention has no CPU backward, so ``flex`` on CPU with gradients enabled (``grad``, default
    ``torch.is_grad_enabled()``) falls back to the equivalent dense-mask sdpa, with a warning once.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "flex" if device.type == "cuda" and flex_available() else "sdpa"
    if backend == "flex" and not flex_available():
        raise RuntimeError(f"attention 'flex' needs torch.nn.attention.flex_attention, which failed to import "
                           f"({_FLEX_IMPORT_ERROR}); set model.attention to 'sdpa'")
    if backend == "flex" and device.type == "cpu" and (torch.is_grad_enabled() if grad is None else grad):
        _warn_flex_cpu_backward()
        return "sdpa"
    return backend


@functools.lru_cache(maxsize=None)
def _warn_flex_cpu_backward() -> None:
    warnings.warn("flex attention has no backward on CPU; using the dense-mask sdpa path (same result) "
                  "while gradients are enabled", stacklevel=4)


def causal_mask(seq_len: int, device: torch.device | str, window: Optional[int] = None) -> torch.Tensor:
    """Dense boolean mask ``[T, T]``: True where query t may attend key s (s <= t, and t - s < ``window``
    when one is given)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if window is not None:
        causal = causal.triu(-(window - 1))
    return causal


def document_mask(doc_ids: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """Dense boolean mask ``[B, 1, T, T]``: True where query t may attend key s (s <= t, same doc, and
    t - s < ``window`` when one is given)."""
    causal = causal_mask(doc_ids.shape[-1], doc_ids.device, window)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


@dataclass
class AttentionMask:
    """Everything the layers of one forward need to apply the mask; build with
    :func:`build_attention_mask`. ``dense`` and ``block_mask`` are both None for plain causal sdpa."""

    backend: str  # "sdpa" or "flex"
    dense: Optional[torch.Tensor] = None  # [B, 1, T, T] bool, sdpa with documents
    block_mask: Any = None  # flex BlockMask
    _additive: dict = field(default_factory=dict, repr=False, compare=False)  # dtype -> sdpa_mask(dtype)

    def sdpa_mask(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """``dense`` as the additive mask SDPA applies, in the queries' ``dtype``: 0 where visible, -inf elsewhere.
        SDPA converts a boolean mask to exactly this (``where(~mask, -inf, 0)``) inside every call; converted here
        once per mask and dtype, every layer (and MAC segment) of a forward reuses it, the same values without the
        conversion's ops per call. Inside a compiled region the boolean mask is passed on (the compiler fuses its
        conversion; no tensor is cached across graphs)."""
        if self.dense is None or self.dense.dtype != torch.bool or torch.compiler.is_compiling():
            return self.dense
        mask = self._additive.get(dtype)
        if mask is None:
            mask = torch.zeros(self.dense.shape, dtype=dtype, device=self.dense.device)
            mask = self._additive[dtype] = mask.masked_fill_(~self.dense, float("-inf"))
        return mask


@functools.lru_cache(maxsize=None)
def _create_block_mask_accepts_compile() -> bool:
    return "_compile" in inspect.signature(create_block_mask).parameters


def _flex_block_mask(doc_ids: Optional[torch.Tensor], batch: int, seq_len: int, device: torch.device,
                     window: Optional[int] = None) -> Any:
    if window is None:
        def visible(q_idx, kv_idx):
            return q_idx >= kv_idx
    else:
        def visible(q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    if doc_ids is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return visible(q_idx, kv_idx)

        batch_dim = None  # the same causal pattern for every sequence
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return visible(q_idx, kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

        batch_dim = batch
    kwargs = {}
    # Uncompiled, create_block_mask materialises the whole [B, T, T] mask; compiled it works block
    # by block, which is what keeps 8k-token packed batches cheap on GPU.
    if device.type == "cuda" and _create_block_mask_accepts_compile():
        kwargs["_compile"] = True
    return create_block_mask(mask_mod, batch_dim, None, seq_len, seq_len, device=device, **kwargs)


def build_attention_mask(doc_ids: Optional[torch.Tensor], seq_len: int, backend: str,
                         device: torch.device, window: Optional[int] = None) -> AttentionMask:
    """Build the mask for one forward pass (shared by all layers).

    ``doc_ids``: ``[B, T]`` document index per position (non-decreasing along T) or None for one
    document per sequence (plain causal attention). ``window``: keys per query, itself included
    (sliding-window attention); None for full causal attention.
    """
    if window is not None and window < 1:
        raise ValueError(f"attention window must be >= 1, got {window}")
    if window is not None and window >= seq_len:
        window = None  # every causal key is within the window: plain causal attention
    resolved = resolve_backend(backend, device)
    if doc_ids is not None and doc_ids.shape[-1] != seq_len:
        raise ValueError(f"doc_ids has length {doc_ids.shape[-1]}, expected {seq_len}")
    if resolved == "flex":
        batch = 1 if doc_ids is None else doc_ids.shape[0]
        return AttentionMask("flex", block_mask=_flex_block_mask(doc_ids, batch, seq_len, device, window))
    if doc_ids is None:
        if window is None:
            return AttentionMask("sdpa")
        return AttentionMask("sdpa", dense=causal_mask(seq_len, device, window)[None, None])
    return AttentionMask("sdpa", dense=document_mask(doc_ids, window))


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    # Eager flex_attention is an unfused reference implementation; the fused kernel needs compile.
    return torch.compile(flex_attention, dynamic=False)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, KV, T, D] -> [B, KV*n_rep, T, D], query head i reading kv head i // n_rep."""
    if n_rep == 1:
        return x
    B, KV, T, D = x.shape
    return x[:, :, None].expand(B, KV, n_rep, T, D).reshape(B, KV * n_rep, T, D)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Masked attention. ``q``: ``[B, H, T, D]``; ``k``, ``v``: ``[B, KV, T, D]`` with KV dividing H
    (grouped-query attention: query head i uses kv head ``i // (H // KV)``). Returns ``[B, H, T, D]``."""
    H, KV = q.shape[1], k.shape[1]
    if H % KV:
        raise ValueError(f"{H} query heads are not a multiple of {KV} key/value heads")
    if mask.backend == "flex":
        # Inside a compiled region (regional compilation of the blocks) Dynamo traces flex itself.
        fn = _compiled_flex_attention() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
        return fn(q, k, v, block_mask=mask.block_mask, enable_gqa=KV != H)
    if mask.dense is None:
        # enable_gqa keeps FlashAttention usable without materialising repeated k/v.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
    # With an explicit mask, the memory-efficient kernel is the fast one, and it does not take
    # enable_gqa; repeating k/v keeps it eligible.
    n_rep = H // KV
    return F.scaled_dot_product_attention(q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep),
                                          attn_mask=mask.sdpa_mask(q.dtype))


__all__ = [
    "AttentionMask", "BACKENDS", "attend", "build_attention_mask", "causal_mask", "document_mask", "flex_available",
    "resolve_backend",
]
