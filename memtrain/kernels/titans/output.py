"""The memory layer's output stage as one fused Triton kernel each way: per-head RMSNorm of the retrievals, the
learnable gain, the cast to the activations' dtype and the sigmoid gate.

:meth:`memtrain.model.titans.memory.NeuralMemory.gated_output` (Titans, Section 4.4: the retrieved values are
normalised and gated before the output projection) computes, for retrievals ``y`` ``[B, H, T, d]`` (the inner
dtype, float32), the gain ``w`` (``out_norm``, ``[H, d]``) and the gate ``g = sigmoid(x W_G)`` ``[B, T, H*d]``::

    z = (rms_norm(y) * w).to(dtype) * g          # [B, T, H*d], then the output projection

In PyTorch that is 5 device ops forward (the norm, the gain's cast, two products, the cast) and about 9
backward (two products and a reduction per product, casts, the norm's backward), per call: eager
``titans-170m-mac`` makes 108 calls per forward (each MAC segment's read, and the writes' outputs after the loop).
Here it is one custom operator (:mod:`torch.library`) with a registered backward operator: one launch forward;
one launch and the sum of the gain's per-program partial gradients backward (deterministic, no atomics).

Precision: the forward rounds where PyTorch's form does (the norm's output and its product with the gain to
``y``'s dtype, that product to the gate's, the gated result to it again), with float32 arithmetic between, so it
matches to float32 rounding. ``eps`` is ``F.rms_norm``'s default, the machine epsilon of its float32 arithmetic
(also for half-precision ``y``: CPU's and CUDA's implementations both take the accumulation type's). The
backward is float32 throughout and rounds only its outputs, where PyTorch's form rounds the gradient of the
pre-gate product to the activations' bf16: it is the more precise of the two. The output has the gate's dtype
(``gated_output`` takes this path only where that is its ``dtype``). Under ``TRITON_INTERPRET=1`` the same kernels
run on CPU tensors (tests/test_titans_kernel.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memtrain.kernels.launch import cdiv
from memtrain.kernels.op import kernel_op
from memtrain.kernels.titans.prologue import BLOCK_T, _block


@triton.jit
def _out_rows(Y, W, G, n, h, t0, T, H, HD, syb, syh, syt, syd, sgb, sgt, sgc, eps, BT: tl.constexpr,
              BD: tl.constexpr):
    """Rows ``t0 .. t0+BT`` of head ``h`` of sequence ``n``, float32: the retrievals ``y``, their reciprocal RMS
    ``r``, the rounded norm ``nr``, the gain ``w`` (in ``y``'s dtype), the gated input ``a`` as the output's
    dtype rounds it, the gate ``g``; the mask and offsets."""
    offs_t = t0 + tl.arange(0, BT)
    offs_d = tl.arange(0, BD)
    m = (offs_t[:, None] < T) & (offs_d[None, :] < HD)
    y = tl.load(Y + n * syb + h * syh + offs_t[:, None] * syt + offs_d[None, :] * syd, mask=m, other=0.0)
    y = y.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) / HD + eps)
    nr = (y * r[:, None]).to(Y.dtype.element_ty).to(tl.float32)  # F.rms_norm's output, in y's dtype
    w = tl.load(W + h * HD + offs_d, mask=offs_d < HD, other=0.0).to(Y.dtype.element_ty).to(tl.float32)
    a = (nr * w[None, :]).to(Y.dtype.element_ty).to(G.dtype.element_ty).to(tl.float32)
    ch = h * HD + offs_d
    g = tl.load(G + n * sgb + offs_t[:, None] * sgt + ch[None, :] * sgc, mask=m, other=0.0).to(tl.float32)
    return y, r, nr, w, a, g, m, offs_t, ch


@triton.jit
def _out_fwd_kernel(Y, W, G, Z, T, H, HD, syb, syh, syt, syd, sgb, sgt, sgc, eps, BT: tl.constexpr,
                    BD: tl.constexpr):
    """One program per (sequence, head) and ``BT`` tokens: ``Z[n, t, h*HD:(h+1)*HD]`` (contiguous)."""
    pid = tl.program_id(0)
    n, h = pid // H, pid % H
    y, r, nr, w, a, g, m, offs_t, ch = _out_rows(Y, W, G, n, h, tl.program_id(1) * BT, T, H, HD, syb, syh, syt,
                                                 syd, sgb, sgt, sgc, eps, BT, BD)
    tl.store(Z + (n * T + offs_t[:, None]) * (H * HD) + ch[None, :], (a * g).to(Z.dtype.element_ty), mask=m)


@triton.jit
def _out_bwd_kernel(Y, W, G, DZ, DY, DG, DW, T, H, HD, syb, syh, syt, syd, sgb, sgt, sgc, szb, szt, szc, eps,
                    BT: tl.constexpr, BD: tl.constexpr):
    """The gradients of ``Y`` (``[B, H, T, HD]`` contiguous), ``G`` (``[B, T, H*HD]`` contiguous) and this
    program's part of the gain's, ``DW[n * cdiv(T, BT) + block, h, :]`` (float32), from ``DZ``'s."""
    pid = tl.program_id(0)
    n, h = pid // H, pid % H
    blk = tl.program_id(1)
    y, r, nr, w, a, g, m, offs_t, ch = _out_rows(Y, W, G, n, h, blk * BT, T, H, HD, syb, syh, syt, syd, sgb, sgt,
                                                 sgc, eps, BT, BD)
    dz = tl.load(DZ + n * szb + offs_t[:, None] * szt + ch[None, :] * szc, mask=m, other=0.0).to(tl.float32)
    tl.store(DG + (n * T + offs_t[:, None]) * (H * HD) + ch[None, :], (dz * a).to(DG.dtype.element_ty), mask=m)
    da = dz * g
    offs_d = tl.arange(0, BD)
    tl.store(DW + ((n * tl.num_programs(1) + blk) * H + h) * HD + offs_d, tl.sum(da * nr, axis=0), mask=offs_d < HD)
    # rms_norm's backward: with u = y r, dy = r (du - u mean(du u)), du = da w
    du = da * w[None, :]
    u = y * r[:, None]
    dy = r[:, None] * (du - u * (tl.sum(du * u, axis=1) / HD)[:, None])
    tl.store(DY + ((n * H + h) * T + offs_t[:, None]) * HD + offs_d[None, :], dy.to(DY.dtype.element_ty), mask=m)


def _empty(*shape, device, dtype) -> torch.Tensor:
    """Every buffer the kernels write (the tests replace this with a NaN fill: unwritten elements show)."""
    return torch.empty(*shape, device=device, dtype=dtype)


def _grid(y: torch.Tensor) -> tuple[int, int]:
    B, H, T, _ = y.shape
    return B * H, cdiv(T, BLOCK_T)


@kernel_op("memtrain::titans_gated_norm")
def _out_fwd(y: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    B, H, T, HD = y.shape
    z = _empty(B, T, H * HD, device=y.device, dtype=gate.dtype)
    _out_fwd_kernel[_grid(y)](y, weight.contiguous(), gate, z, T, H, HD, *y.stride(), *gate.stride(), eps,
                              BT=BLOCK_T, BD=_block(HD))
    return z


@_out_fwd.register_fake
def _(y, weight, gate, eps):
    B, H, T, HD = y.shape
    return gate.new_empty(B, T, H * HD)


@kernel_op("memtrain::titans_gated_norm_bwd")
def _out_bwd(y: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, dz: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, T, HD = y.shape
    grid = _grid(y)
    dy = _empty(B, H, T, HD, device=y.device, dtype=y.dtype)
    dg = _empty(B, T, H * HD, device=y.device, dtype=gate.dtype)
    dw = _empty(B * grid[1], H, HD, device=y.device, dtype=torch.float32)
    _out_bwd_kernel[grid](y, weight.contiguous(), gate, dz, dy, dg, dw, T, H, HD, *y.stride(), *gate.stride(),
                          *dz.stride(), eps, BT=BLOCK_T, BD=_block(HD))
    return dy, dw.sum(0).to(weight.dtype), dg


@_out_bwd.register_fake
def _(y, weight, gate, dz, eps):
    B, H, T, HD = y.shape
    return y.new_empty(B, H, T, HD), weight.new_empty(H, HD), gate.new_empty(B, T, H * HD)


def _setup(ctx, inputs, output):
    y, weight, gate, ctx.eps = inputs
    ctx.save_for_backward(y, weight, gate)


def _backward(ctx, dz):
    dy, dw, dg = _out_bwd(*ctx.saved_tensors, dz, ctx.eps)
    return dy, dw, dg, None


_out_fwd.register_autograd(_backward, setup_context=_setup)


def gated_norm(y: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``(F.rms_norm(y.transpose(1, 2), (d,)) * weight.to(y.dtype)).flatten(2).to(gate.dtype) * gate``:
    ``[B, T, H*d]`` in ``gate``'s dtype (contiguous) from retrievals ``y`` ``[B, H, T, d]`` (any strides), the
    gain ``weight`` ``[H, d]`` and the gate ``[B, T, H*d]`` (any strides)."""
    B, H, T, HD = y.shape
    if weight.shape != (H, HD) or gate.shape != (B, T, H * HD):
        raise ValueError(f"gated_norm: y {tuple(y.shape)}, weight {tuple(weight.shape)} and gate {tuple(gate.shape)} "
                         "do not match ([B, H, T, d], [H, d], [B, T, H*d])")
    return _out_fwd(y, weight, gate, torch.finfo(torch.float32).eps)  # F.rms_norm's default, any input dtype


__all__ = ["gated_norm"]
