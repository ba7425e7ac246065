"""MAC's retrieval from the memory as one fused Triton kernel each way: ``h_t = M*_{t-1}(q_t)`` (Titans, Section 4.1,
eq. 21), the memory MLP applied to a segment's queries with the weights it had before the segment.

:meth:`memtrain.model.titans.memory.NeuralMemory.read` computes, for queries ``q`` ``[B, H, T, d]`` and the weights
of each memory layer ``W_l`` ``[B or 1, H, d_out, d_in]`` (float32: the state's, or the initial weights broadcast over
the batch)::

    y = W_2 silu(W_1 q)          # depth 2 (every paper recipe); depth 1: y = W_1 q

In PyTorch that is two batched matrix products and a SiLU forward (about 3 device ops, and casts) and about 7
backward (four products, SiLU's backward, the sums over the batch of broadcast weights), all float32 on the CUDA cores:
eager ``titans-170m-mac`` reads once per segment and block, 96 times per sequence. Here it is one custom operator
(:mod:`torch.library`) with a registered backward operator: one launch forward (one program per sequence, head and
``BLOCK_T`` tokens) and one backward (one program per sequence and head, looping over the tokens, which accumulates
the weights' gradients in registers and writes the queries' gradient as it goes; broadcast weights' gradients are
summed over the batch after it).

Precision. ``dot``: 0 runs IEEE float32 products (what the tests compare with float64; the PyTorch form's arithmetic);
1 rounds both operands of every product to bfloat16 and 2 to float16, accumulating in float32 -- what the scan
kernels do with the same weights when the activations are half precision (their reads, ``_mm``), so a model reads its
memory at one precision whether through the scan or here. Outputs and gradients are float32 (the inner dtype), as the
PyTorch form's. Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (tests/test_titans_kernel.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from memtrain.kernels.launch import cdiv
from memtrain.kernels.op import kernel_op
from memtrain.kernels.titans.triton_kernels import _block, _mm

BLOCK_T = 64  # tokens per program (forward) and per step of the backward's loop
BWD_WARPS = 8  # the backward holds both layers' weights and their gradients (128 KiB in float32 at 64 x 128)
DOTS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the products' operand type -> ``dot``


@triton.jit
def _load_w(W, b, h, swb, swh, swo, swi, O, I, BO: tl.constexpr, BI: tl.constexpr):
    """Layer weight ``[O, I]`` of sequence ``b`` (stride 0: broadcast) and head ``h``, float32, zeros outside."""
    offs_o = tl.arange(0, BO)
    offs_i = tl.arange(0, BI)
    m = (offs_o[:, None] < O) & (offs_i[None, :] < I)
    return tl.load(W + b * swb + h * swh + offs_o[:, None] * swo + offs_i[None, :] * swi, mask=m, other=0.0)


@triton.jit
def _operand(w, DOT: tl.constexpr):
    """A weight tile as ``_mm`` rounds its operands (``DOT`` 1: bfloat16, 2: float16), rounded once for all its
    products: half the registers where the backward holds it through its loop."""
    if DOT == 1:
        return w.to(tl.bfloat16)
    elif DOT == 2:
        return w.to(tl.float16)
    else:
        return w


@triton.jit
def _rows(X, b, h, t0, T, D, sxb, sxh, sxt, sxd, BT: tl.constexpr, BD: tl.constexpr):
    """Rows ``t0 .. t0+BT`` of ``X[b, h]`` ``[T, D]``, float32 (zeros outside), their offsets and mask."""
    offs_t = t0 + tl.arange(0, BT)
    offs_d = tl.arange(0, BD)
    m = (offs_t[:, None] < T) & (offs_d[None, :] < D)
    x = tl.load(X + b * sxb + h * sxh + offs_t[:, None] * sxt + offs_d[None, :] * sxd, mask=m, other=0.0)
    return x.to(tl.float32), offs_t, offs_d, m


@triton.jit
def _read_fwd_kernel(Q, W1, W2, Y, T, H, D, H1, sqb, sqh, sqt, sqd, s1b, s1h, s1o, s1i, s2b, s2h, s2o, s2i,
                     DEPTH: tl.constexpr, DOT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr):
    """One program per (sequence, head) and ``BT`` tokens: ``Y[b, h, t]`` (``[B, H, T, D]`` contiguous, float32)."""
    pid = tl.program_id(0)
    b, h = pid // H, pid % H
    q, offs_t, offs_d, m = _rows(Q, b, h, tl.program_id(1) * BT, T, D, sqb, sqh, sqt, sqd, BT, BD)
    if DEPTH == 1:
        y = _mm(q, tl.trans(_load_w(W1, b, h, s1b, s1h, s1o, s1i, D, D, BD, BD)), DOT)
    else:
        z = _mm(q, tl.trans(_load_w(W1, b, h, s1b, s1h, s1o, s1i, H1, D, BH, BD)), DOT)  # [BT, BH]
        a = z * tl.sigmoid(z)
        y = _mm(a, tl.trans(_load_w(W2, b, h, s2b, s2h, s2o, s2i, D, H1, BD, BH)), DOT)
    tl.store(Y + ((b * H + h) * T + offs_t[:, None]) * D + offs_d[None, :], y, mask=m)


@triton.jit
def _read_bwd_kernel(Q, W1, W2, DY, DQ, DW1, DW2, T, H, D, H1, sqb, sqh, sqt, sqd, s1b, s1h, s1o, s1i, s2b, s2h, s2o,
                     s2i, syb, syh, syt, syd, DEPTH: tl.constexpr, DOT: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr, BH: tl.constexpr):
    """One program per (sequence, head), over its tokens ``BT`` at a time: ``DQ[b, h]`` (``[B, H, T, D]``
    contiguous) and this sequence's part of each layer's weight gradient, ``DW1[b, h]`` / ``DW2[b, h]`` (``[B, H,
    d_out, d_in]`` contiguous, float32)."""
    pid = tl.program_id(0)
    b, h = pid // H, pid % H
    if DEPTH == 1:
        w1 = _operand(_load_w(W1, b, h, s1b, s1h, s1o, s1i, D, D, BD, BD), DOT)
        dw1 = tl.zeros((BD, BD), dtype=tl.float32)
        for t0 in range(0, T, BT):
            q, offs_t, offs_d, m = _rows(Q, b, h, t0, T, D, sqb, sqh, sqt, sqd, BT, BD)
            dy, _, _, _ = _rows(DY, b, h, t0, T, D, syb, syh, syt, syd, BT, BD)
            tl.store(DQ + ((b * H + h) * T + offs_t[:, None]) * D + offs_d[None, :], _mm(dy, w1, DOT), mask=m)
            dw1 += _mm(tl.trans(dy), q, DOT)
        offs_o = tl.arange(0, BD)
        offs_i = tl.arange(0, BD)
        tl.store(DW1 + (pid * D + offs_o[:, None]) * D + offs_i[None, :], dw1,
                 mask=(offs_o[:, None] < D) & (offs_i[None, :] < D))
    else:
        w1 = _operand(_load_w(W1, b, h, s1b, s1h, s1o, s1i, H1, D, BH, BD), DOT)  # [H1, D]
        w2 = _operand(_load_w(W2, b, h, s2b, s2h, s2o, s2i, D, H1, BD, BH), DOT)  # [D, H1]
        dw1 = tl.zeros((BH, BD), dtype=tl.float32)
        dw2 = tl.zeros((BD, BH), dtype=tl.float32)
        for t0 in range(0, T, BT):
            q, offs_t, offs_d, m = _rows(Q, b, h, t0, T, D, sqb, sqh, sqt, sqd, BT, BD)
            dy, _, _, _ = _rows(DY, b, h, t0, T, D, syb, syh, syt, syd, BT, BD)
            z = _mm(q, tl.trans(w1), DOT)  # [BT, BH]
            s = tl.sigmoid(z)
            dz = _mm(dy, w2, DOT) * (s * (1.0 + z * (1.0 - s)))  # silu'(z) = s (1 + z (1 - s))
            tl.store(DQ + ((b * H + h) * T + offs_t[:, None]) * D + offs_d[None, :], _mm(dz, w1, DOT), mask=m)
            dw2 += _mm(tl.trans(dy), z * s, DOT)
            dw1 += _mm(tl.trans(dz), q, DOT)
        offs_h = tl.arange(0, BH)
        offs_d = tl.arange(0, BD)
        tl.store(DW1 + (pid * H1 + offs_h[:, None]) * D + offs_d[None, :], dw1,
                 mask=(offs_h[:, None] < H1) & (offs_d[None, :] < D))
        tl.store(DW2 + (pid * D + offs_d[:, None]) * H1 + offs_h[None, :], dw2,
                 mask=(offs_d[:, None] < D) & (offs_h[None, :] < H1))


def _empty(*shape, device, dtype) -> torch.Tensor:
    """Every buffer the kernels write (the tests replace this with a NaN fill: unwritten elements show)."""
    return torch.empty(*shape, device=device, dtype=dtype)


def _wstrides(w: torch.Tensor) -> tuple[int, int, int, int]:
    """A layer weight's strides, the batch's 0 where it is broadcast (one weight for every sequence)."""
    sb, sh, so, si = w.stride()
    return (0 if w.shape[0] == 1 else sb), sh, so, si


def _launch_args(q: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, depth: int, dot: int) -> tuple[list, dict]:
    """The kernels' shared arguments: lengths and strides, and the constexprs. At depth 1 ``w2`` is not read."""
    B, H, T, D = q.shape
    w2 = w1 if depth == 1 else w2
    return ([T, H, D, w1.shape[-2], *q.stride(), *_wstrides(w1), *_wstrides(w2)],
            {"DEPTH": depth, "DOT": dot, "BT": BLOCK_T, "BD": _block(D), "BH": _block(w1.shape[-2])})


@kernel_op("memtrain::titans_read")
def _read_fwd(q: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, depth: int, dot: int) -> torch.Tensor:
    B, H, T, D = q.shape
    y = _empty(B, H, T, D, device=q.device, dtype=torch.float32)
    ints, consts = _launch_args(q, w1, w2, depth, dot)
    _read_fwd_kernel[(B * H, cdiv(T, BLOCK_T))](q, w1, w2, y, *ints, **consts)
    return y


@_read_fwd.register_fake
def _(q, w1, w2, depth, dot):
    return q.new_empty(q.shape, dtype=torch.float32)


@kernel_op("memtrain::titans_read_bwd")
def _read_bwd(q: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, dy: torch.Tensor, depth: int,
              dot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    dq = _empty(B, H, T, D, device=q.device, dtype=torch.float32)
    dw1 = _empty(B, H, *w1.shape[-2:], device=q.device, dtype=torch.float32)
    dw2 = _empty(B, H, *w2.shape[-2:], device=q.device, dtype=torch.float32) if depth == 2 else dw1
    ints, consts = _launch_args(q, w1, w2, depth, dot)
    _read_bwd_kernel[(B * H,)](q, w1, w2, dy, dq, dw1, dw2, *ints, *dy.stride(), num_warps=BWD_WARPS, **consts)
    if w1.shape[0] == 1 and B > 1:  # broadcast weights: their gradient sums the sequences'
        dw1 = dw1.sum(0, keepdim=True)
    if depth == 1:
        return dq.to(q.dtype), dw1.to(w1.dtype), torch.zeros_like(w2)
    if w2.shape[0] == 1 and B > 1:
        dw2 = dw2.sum(0, keepdim=True)
    return dq.to(q.dtype), dw1.to(w1.dtype), dw2.to(w2.dtype)


@_read_bwd.register_fake
def _(q, w1, w2, dy, depth, dot):
    return q.new_empty(q.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape)


def _setup(ctx, inputs, output):
    q, w1, w2, ctx.depth, ctx.dot = inputs
    ctx.save_for_backward(q, w1, w2)


def _backward(ctx, dy):
    q, w1, w2 = ctx.saved_tensors
    dq, dw1, dw2 = _read_bwd(q, w1, w2, dy, ctx.depth, ctx.dot)
    return dq, dw1, (dw2 if ctx.depth == 2 else None), None, None


_read_fwd.register_autograd(_backward, setup_context=_setup)


def read(weights: Sequence[torch.Tensor], q: torch.Tensor, dot: int = 0) -> torch.Tensor:
    """``M(q)`` ``[B, H, T, d]`` float32 for queries ``q`` ``[B, H, T, d]`` (any strides; float32) and the weights of a
    depth-1 or depth-2 memory, each ``[B or 1, H, d_out, d_in]`` float32 (1: the same for every sequence); ``dot``:
    the products' operand precision (module docstring). The PyTorch form is
    :func:`memtrain.kernels.titans.reference.mlp_forward`."""
    B, H, T, D = q.shape
    if len(weights) not in (1, 2):
        raise ValueError(f"read: a memory of depth 1 or 2, got {len(weights)} layers")
    if q.dtype != torch.float32 or any(w.dtype != torch.float32 for w in weights):
        raise ValueError(f"read: float32 queries and weights (the inner dtype), got {q.dtype} and "
                         f"{[w.dtype for w in weights]}")
    w1 = weights[0]
    w2 = weights[-1]
    hidden = w1.shape[-2]
    shapes = [(H, D, D)] if len(weights) == 1 else [(H, hidden, D), (H, D, hidden)]
    if any(w.dim() != 4 or w.shape[0] not in (1, B) or tuple(w.shape[1:]) != s for w, s in zip(weights, shapes)):
        raise ValueError(f"read: queries {tuple(q.shape)} and weights {[tuple(w.shape) for w in weights]} do not match "
                         "([B, H, T, d]; [B or 1, H, d_out, d_in] per layer)")
    return _read_fwd(q, w1, w2, len(weights), dot)


__all__ = ["BLOCK_T", "DOTS", "read"]
