"""Rotary position embedding (RoPE, rotate-half convention) as one fused Triton kernel each way.

:func:`memtrain.model.anchor.apply_rope` is ``(x * cos + rotate_half(x) * sin)`` computed in float32 and
rounded to ``x``'s dtype: in PyTorch that is 7 device ops forward (two casts, two products, the negation and
concatenation of ``rotate_half``, the sum) and as many backward, for every query and key tensor of every
layer. Eager Titans MAC applies it to each segment's retrieved keys as well (12 blocks x 8 segments in
``titans-170m-mac``), so RoPE alone was about 1,400 of the 11,251 device ops of a sequence's forward and
backward (``benchmarks/op_count.py``). Here it is one custom operator (:mod:`torch.library`, so a compiled
graph could hold it as one node) with a registered backward operator: one launch forward, one backward.

With ``x = [x1 | x2]`` (halves of the head dimension) and ``cos = [c1 | c2]``, ``sin = [s1 | s2]``:

    y1 = x1 c1 - x2 s1        dx1 = dy1 c1 + dy2 s2
    y2 = x2 c2 + x1 s2        dx2 = dy2 c2 - dy1 s1

(the backward is the transpose of the rotation; no assumption that the halves of ``cos``/``sin`` repeat).
Precision is PyTorch's form's: float32 arithmetic, the output and the input's gradient rounded to ``x``'s dtype
(the incoming gradient has it too). The backward needs only ``cos``/``sin`` (tables without gradient), not ``x``.

``cos``/``sin`` are ``[B or 1, T, 1, D]`` (:class:`memtrain.model.anchor.RotaryEmbedding`; MAC passes
non-contiguous slices of them), ``x`` and the incoming gradient any strides (the gradient comes back from
attention transposed); the outputs are contiguous. Under ``TRITON_INTERPRET=1`` the same kernels run on CPU
tensors (tests/test_rope_kernel.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memtrain.kernels.launch import block, cdiv
from memtrain.kernels.op import kernel_op

BLOCK_T = 32  # tokens per program


@triton.jit
def _rope_kernel(X, COS, SIN, Y, T, H, HALF, sxb, sxt, sxh, sxd, scb, sct, scd, ssb, sst, ssd,
                 INVERSE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """One program per (sequence, head) and ``BT`` tokens: ``Y = rope(X)`` (``INVERSE`` false), or the input's
    gradient ``Y`` from the output's ``X`` (``INVERSE``); float32 arithmetic, stored in ``Y``'s dtype."""
    pid = tl.program_id(0)
    n, h = pid // H, pid % H
    offs_t = tl.program_id(1) * BT + tl.arange(0, BT)
    offs_d = tl.arange(0, BD)
    m = (offs_t[:, None] < T) & (offs_d[None, :] < HALF)
    x_row = X + n * sxb + h * sxh + offs_t[:, None] * sxt + offs_d[None, :] * sxd
    x1 = tl.load(x_row, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF * sxd, mask=m, other=0.0).to(tl.float32)
    c_row = COS + n * scb + offs_t[:, None] * sct + offs_d[None, :] * scd
    s_row = SIN + n * ssb + offs_t[:, None] * sst + offs_d[None, :] * ssd
    c1 = tl.load(c_row, mask=m, other=0.0)
    c2 = tl.load(c_row + HALF * scd, mask=m, other=0.0)
    s1 = tl.load(s_row, mask=m, other=0.0)
    s2 = tl.load(s_row + HALF * ssd, mask=m, other=0.0)
    if INVERSE:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_row = Y + ((n * T + offs_t[:, None]) * H + h) * (2 * HALF) + offs_d[None, :]
    tl.store(y_row, y1.to(Y.dtype.element_ty), mask=m)
    tl.store(y_row + HALF, y2.to(Y.dtype.element_ty), mask=m)


def _empty(*shape, device, dtype) -> torch.Tensor:
    """Every buffer the kernels write (the tests replace this with a NaN fill: unwritten elements show)."""
    return torch.empty(*shape, device=device, dtype=dtype)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    B, T, H, D = x.shape
    y = _empty(B, T, H, D, device=x.device, dtype=x.dtype)
    cos, sin = cos.expand(B, T, 1, D), sin.expand(B, T, 1, D)  # a broadcast batch gets stride 0
    half = D // 2
    grid = (B * H, cdiv(T, BLOCK_T))
    _rope_kernel[grid](x, cos, sin, y, T, H, half, *x.stride(), cos.stride(0), cos.stride(1), cos.stride(3),
                       sin.stride(0), sin.stride(1), sin.stride(3), INVERSE=inverse, BT=BLOCK_T,
                       BD=block(half))
    return y


@kernel_op("memtrain::rope")
def _rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(x, cos, sin, inverse=False)


@_rope_fwd.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


@kernel_op("memtrain::rope_bwd")
def _rope_bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(dy, cos, sin, inverse=True)


@_rope_bwd.register_fake
def _(dy, cos, sin):
    return dy.new_empty(dy.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1:])  # cos, sin: the backward does not need x


def _backward(ctx, dy):
    return _rope_bwd(dy, *ctx.saved_tensors), None, None


_rope_fwd.register_autograd(_backward, setup_context=_setup)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, T, H, D]`` (float32 / bf16 / fp16, any strides, ``D`` even) rotated by float32 ``cos`` /
    ``sin`` ``[B or 1, T, 1, D]`` (no gradient flows to them): :func:`memtrain.model.anchor.apply_rope`'s result,
    contiguous, in ``x``'s dtype."""
    return _rope_fwd(x, cos, sin)


__all__ = ["rope"]
