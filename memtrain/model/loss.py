"""The language-model loss without the micro-batch's logits: a chunked linear + cross-entropy.

``F.cross_entropy(lm_head(h).float(), labels)`` materialises ``[N, V]`` logits in the activation dtype,
an fp32 copy, the fp32 log-softmax it saves for backward and the gradients of both: for N = 32K tokens
and V = 50K that is about 20 GB. :func:`linear_cross_entropy` computes the same token losses
``logsumexp(h W^T) - (h W^T)[label]`` a chunk of ``chunk_tokens`` tokens at a time:

- each chunk's logits ``h_c W^T`` are computed in the activation dtype (what ``lm_head`` returns), their
  log-sum-exp and the label's logit in fp32 (float64 inputs stay float64), exactly as the unfused path
  upcasts the logits before ``cross_entropy``;
- with ``reduction="sum"`` (training) the gradients are computed in the forward, chunk by chunk, while
  the chunk's logits are at hand: ``dL/dlogits = softmax - onehot`` (zero rows for ignored tokens), cast
  to the activation dtype, gives ``dh_c = dlogits_c W`` and ``dW += dlogits_c^T h_c`` (accumulated in
  fp32 over the chunks); backward only scales them by the incoming gradient. One head matmul in the
  forward and two in the backward, as unfused, and at most one chunk's logits alive at a time;
- with ``reduction="none"`` (per-token losses, e.g. for evaluation) the forward keeps only the fp32
  log-sum-exp per token and backward recomputes each chunk's logits (one more head matmul).

Ignored tokens (``ignore_index``) score nothing and get zero gradient, as in ``F.cross_entropy``. A tied
head passes the embedding matrix as ``weight``: autograd adds ``dW`` to the embedding's gradient, so the
tied gradient is exact. Labels outside ``[0, V)`` that are not ignored fail in ``gather`` (an error on CPU,
a device assert on CUDA), as in ``F.cross_entropy``.
Imports torch only.
"""

from __future__ import annotations

from typing import Optional

import torch

IGNORE_INDEX = -100


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    # Shapes only: a range check of the labels would wait for the device at every call.
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, d] and weight [V, d] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [N] = [{hidden.shape[0]}], got {tuple(labels.shape)}")


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, ignore_index: int):
    """One chunk: logits (activation dtype), fp32 log-sum-exp, token losses (0 where ignored), valid mask."""
    logits = h @ weight.t()
    acc = logits.to(_accum_dtype(logits.dtype))
    lse = torch.logsumexp(acc, dim=-1)
    valid = y != ignore_index
    safe = torch.where(valid, y, torch.zeros_like(y))
    target = acc.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target, torch.zeros_like(lse))
    return acc, lse, loss, valid, safe


def _dlogits(acc: torch.Tensor, lse: torch.Tensor, valid: torch.Tensor, safe: torch.Tensor,
             scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``softmax - onehot`` in the accumulation dtype, rows of ignored tokens zero, times ``scale`` [n]."""
    grad = torch.exp(acc - lse[:, None])
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    w = valid.to(grad.dtype)
    if scale is not None:
        w = w * scale.to(grad.dtype)
    return grad * w[:, None]


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, ignore_index, grad_enabled):
        needs_h, needs_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=_accum_dtype(hidden.dtype), device=hidden.device)
        grad_h = torch.empty_like(hidden) if needs_h else None
        grad_w = torch.zeros(weight.shape, dtype=_accum_dtype(weight.dtype), device=weight.device) if needs_w else None
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            acc, lse, loss, valid, safe = _chunk_stats(h, weight, y, ignore_index)
            total = total + loss.sum()
            if needs_h or needs_w:
                d = _dlogits(acc, lse, valid, safe).to(hidden.dtype)
                del acc
                if needs_h:
                    grad_h[start:start + chunk] = d @ weight
                if needs_w:
                    grad_w += (d.t() @ h).to(grad_w.dtype)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if needs_w else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None


class _LinearCrossEntropyNone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, ignore_index):
        losses, lses = [], []
        for start in range(0, hidden.shape[0], chunk):
            _, lse, loss, _, _ = _chunk_stats(hidden[start:start + chunk], weight, labels[start:start + chunk],
                                              ignore_index)
            losses.append(loss)
            lses.append(lse)
        ctx.save_for_backward(hidden, weight, labels, torch.cat(lses))
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return torch.cat(losses)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels, lse_all = ctx.saved_tensors
        needs_h, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if needs_h else None
        grad_w = torch.zeros(weight.shape, dtype=_accum_dtype(weight.dtype), device=weight.device) if needs_w else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            h, y = hidden[sl], labels[sl]
            acc = (h @ weight.t()).to(_accum_dtype(hidden.dtype))
            valid = y != ctx.ignore_index
            safe = torch.where(valid, y, torch.zeros_like(y))
            d = _dlogits(acc, lse_all[sl], valid, safe, grad_out[sl]).to(hidden.dtype)
            del acc
            if needs_h:
                grad_h[sl] = d @ weight
            if needs_w:
                grad_w += (d.t() @ h).to(grad_w.dtype)
        return grad_h, grad_w.to(weight.dtype) if needs_w else None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 4096,
                         ignore_index: int = IGNORE_INDEX, reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` without the full logits (module docstring).

    ``hidden [..., d]`` (any leading shape, flattened to N tokens), ``weight [V, d]`` (the LM head, or the
    tied embedding), ``labels [...]`` (``ignore_index`` = not scored). ``reduction``: ``"sum"`` (a scalar in
    the accumulation dtype, fp32 for bf16/fp32 inputs: ``F.cross_entropy(..., reduction="sum")`` of the
    upcast logits), ``"mean"`` (over the scored tokens; NaN when none, like ``F.cross_entropy``) or
    ``"none"`` (the per-token losses, shape of ``labels``, 0 at ignored tokens)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    _check(h, weight, y)
    if weight.dtype != h.dtype:
        weight = weight.to(h.dtype)  # autocast would run the head in the activation dtype too
    if reduction == "none":
        return _LinearCrossEntropyNone.apply(h, weight, y, chunk_tokens, ignore_index).reshape(shape)
    total = _LinearCrossEntropySum.apply(h, weight, y, chunk_tokens, ignore_index, torch.is_grad_enabled())
    if reduction == "mean":
        return total / (y != ignore_index).sum()
    return total


__all__ = ["IGNORE_INDEX", "linear_cross_entropy"]
