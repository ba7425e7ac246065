"""PyTorch references of routed memory attention (crossattn-memory-banks paper, Section 4): what the Triton
kernels (:mod:`.triton_kernels`) compute, with the same signatures; the fallback off CUDA.

Both take the keys and values of the ``U`` chapters read at all (``[U, N_c, H, D]``, projected once per
chapter by the caller) and, per routing decision, ``k`` slots: ``slots`` (long, indices into those ``U``
chapters) and ``log_w`` (the log router scores). A query attends to the tokens of its ``k`` chapters with
every logit of chapter slot ``j`` biased by ``log_w[j]``:

    out = sum_j exp(lse_j + log_w_j) o_j / sum_j exp(lse_j + log_w_j),

``o_j`` and ``lse_j`` the attention output and log-sum-exp over chapter ``j`` alone (scale
``1 / sqrt(D)``): full-bank attention restricted to the routed chapters, each weighted by its score.
Duplicate slots simply count twice. Accumulation in float32 (float64 stays float64).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def sequence_routed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                              log_w: torch.Tensor) -> torch.Tensor:
    """Sequence-level routing: ``q`` ``[B, T, H, D]``, every token of sequence ``b`` reads chapters
    ``slots[b]`` (``[B, k]``) with ``log_w[b]``. Gathers each sequence's ``k * N_c`` keys (eq. 10) and runs
    one attention with the log weights as a per-key bias. Returns ``[B, T, H, D]`` in ``q``'s dtype."""
    B, T, H, D = q.shape
    k, Nc = slots.shape[1], keys.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    k_seq = keys[slots].reshape(B, k * Nc, H, D).transpose(1, 2).to(acc)  # [B, H, k*Nc, D]
    v_seq = values[slots].reshape(B, k * Nc, H, D).transpose(1, 2).to(acc)
    bias = log_w.to(acc)[:, :, None].expand(B, k, Nc).reshape(B, 1, 1, k * Nc)
    out = F.scaled_dot_product_attention(q.transpose(1, 2).to(acc), k_seq, v_seq, attn_mask=bias)
    return out.transpose(1, 2).to(q.dtype)


def token_routed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                           log_w: torch.Tensor) -> torch.Tensor:
    """Token-level routing: ``q`` ``[N, H, D]`` (one row per token), token ``i`` reads chapters ``slots[i]``
    (``[N, k]``) with ``log_w[i]``. Never materialises per-token gathered keys: the (token, slot) pairs are
    grouped by chapter, each group attends to its chapter with its log-sum-exp, and every token's
    chapters are merged by log-sum-exp plus log weight (as split-K attention merges partial softmaxes).
    Memory: the unique chapters' keys and values plus one row per pair. Returns ``[N, H, D]``."""
    N, H, D = q.shape
    k = slots.shape[1]
    which = slots.reshape(N * k)
    order = torch.argsort(which, stable=True)
    sizes = torch.bincount(which, minlength=keys.shape[0]).tolist()
    token = torch.div(order, k, rounding_mode="floor")
    scale = 1.0 / math.sqrt(D)
    acc = torch.promote_types(q.dtype, torch.float32)
    lse_parts, out_parts = [], []
    for u, group in enumerate(torch.split(token, sizes)):
        if group.numel() == 0:
            continue
        logits = torch.einsum("nhd,chd->nhc", q[group].to(acc), keys[u].to(acc)) * scale  # [n_u, H, Nc]
        lse = torch.logsumexp(logits, dim=-1)  # [n_u, H]
        out_parts.append(torch.einsum("nhc,chd->nhd", torch.exp(logits - lse[..., None]), values[u].to(acc)))
        lse_parts.append(lse)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    lse = torch.cat(lse_parts)[restore].view(N, k, H)  # back to (token, slot) order
    out = torch.cat(out_parts)[restore].view(N, k, H, D)
    return merge_slots(out, lse, log_w).to(q.dtype)


def merge_slots(out: torch.Tensor, lse: torch.Tensor, log_w: torch.Tensor) -> torch.Tensor:
    """Per-chapter results ``out`` ``[N, k, H, D]`` and log-sum-exps ``lse`` ``[N, k, H]`` merged with the
    log weights ``log_w`` ``[N, k]``: ``sum_j softmax_j(lse_j + log_w_j) out_j`` (``[N, H, D]``)."""
    w = torch.softmax(lse + log_w.reshape(*log_w.shape, 1).to(lse.dtype), dim=1)
    return (w[..., None] * out).sum(dim=1)


__all__ = ["merge_slots", "sequence_routed_attention", "token_routed_attention"]
