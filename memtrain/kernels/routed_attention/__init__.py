"""Routed memory attention over shared chapter storage (crossattn-memory-banks paper, Section 4): the Triton
kernels (:mod:`.triton_kernels`, forward and backward) beside their PyTorch references (:mod:`.reference`),
and the dispatch between them.

``impl``: ``"auto"`` runs the kernels on CUDA tensors (when Triton imports) and the reference elsewhere;
``"triton"`` forces the kernels (on CPU only under ``TRITON_INTERPRET=1``; the tests do); ``"torch"`` forces
the reference. Keys and values are cast to the queries' dtype.
"""

from __future__ import annotations

import os

import torch

from memtrain.kernels.routed_attention import reference

IMPLS = ("auto", "triton", "torch")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(impl: str, q: torch.Tensor) -> bool:
    """Whether ``impl`` runs the kernels for tensors like ``q`` (ValueError for an unknown ``impl``; a
    RuntimeError when ``triton`` is asked for where it cannot run)."""
    if impl not in IMPLS:
        raise ValueError(f"routed attention implementation must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "auto":
        return q.is_cuda and triton_available()
    if not triton_available():
        raise RuntimeError("routed attention: impl 'triton' needs the triton package")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("routed attention: impl 'triton' on CPU tensors needs TRITON_INTERPRET=1 (the Triton "
                           "interpreter); use 'auto' or 'torch' on CPU")
    return True


def sequence_routed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                              log_w: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """``q`` ``[B, T, H, D]`` to the chapters ``slots`` ``[B, k]`` (indices into ``keys`` / ``values``
    ``[U, N_c, H, D]``) of its sequence, logits biased by ``log_w`` ``[B, k]``
    (:func:`.reference.sequence_routed_attention`)."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if use_triton(impl, q):
        from memtrain.kernels.routed_attention import triton_kernels

        return triton_kernels.sequence_routed_attention(q, keys, values, slots, log_w)
    return reference.sequence_routed_attention(q, keys, values, slots, log_w)


def token_routed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                           log_w: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """``q`` ``[N, H, D]`` (one row per token) to its chapters ``slots`` ``[N, k]`` with ``log_w`` ``[N, k]``
    (:func:`.reference.token_routed_attention`)."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if use_triton(impl, q):
        from memtrain.kernels.routed_attention import triton_kernels

        return triton_kernels.token_routed_attention(q, keys, values, slots, log_w)
    return reference.token_routed_attention(q, keys, values, slots, log_w)


__all__ = ["IMPLS", "sequence_routed_attention", "token_routed_attention", "triton_available", "use_triton"]
