"""The memory layer's prologue as two fused Triton kernels, forward and backward: the elementwise work between
its projections and the inner loop, one launch per call each way where PyTorch issues a dozen ops.

:meth:`memtrain.model.titans.memory.NeuralMemory.write` (Titans, Sections 3.1-3.2 and 4.4) turns the convolved
projections and the gate projection into what the scan kernels read:

- :func:`qkv_heads` -- ``q, k, v`` ``[B, H, T, head_dim]`` from the convolution's ``[B, T, 3 * H * head_dim]``:
  SiLU, L2 normalisation per head (q and k; v too with ``norm_v``), one contiguous copy per head in the
  activations' half precision. PyTorch's form (``NeuralMemory._qkv_heads``): 6 ops forward (SiLU, cast,
  vector norm, clamp, division, the layout copy), about 16 backward.
- :func:`gates` -- ``theta = max_lr * sigmoid(g_0)``, ``log eta = logsigmoid(g_1) + log(max_momentum)``,
  ``log(1 - alpha) = logsigmoid(-g_2)`` ``[B, H, T]`` in float32 from the gate projection's ``[B, T, 3 * H]``.
  PyTorch's form (``NeuralMemory._gates``, per-token gates): 8 ops forward, about 8 backward.

Each is one custom operator (:mod:`torch.library`) with three separate outputs and a registered backward operator
that reads the three gradients, so eager autograd issues one launch each way (no stack joins the outputs'
gradients) and a compiled block's graph keeps it as one node (eager and compiled blocks compute the same). Eager
``titans-170m-mac`` runs the pair 96 times per forward (12 blocks x 8 segments): 3,264 fewer device ops per
sequence, 14,515 -> 11,251 (``benchmarks/op_count.py``).

Precision: the arithmetic is float32 (inputs upcast). SiLU's output is rounded to the input's dtype before the
norm, as ``F.silu`` on a half-precision tensor returns it, so the forward matches PyTorch's form to float32
rounding; the backward stays in float32 where PyTorch's rounds SiLU's gradient to half precision, so it is the
more precise of the two. ``logsigmoid(u) = min(u, 0) - log1p(exp(-|u|))`` with ``log1p`` from its series below
``1e-4`` (absolute error under 1e-12 there). Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # tokens per program
# Unlike the scan kernels (triton_kernels._RUNTIME_INTS), these leave Triton's specialisation of integer arguments
# on: they compile in under a second, a call length adds at most a variant or two (divisible by 16 or not), and
# with the lengths and strides known divisible by 16 and the stride between tokens known to be 1 (the
# convolution's output is ``[B, C, T]`` transposed) the loads along the tokens are 16-byte vectors (sm_90 PTX:
# ``ld.global.v4``; scalar 2-byte loads with them unspecialised).


@triton.jit
def _silu_rounded(X, x):
    """SiLU of float32 ``x`` rounded to ``X``'s element type (as ``F.silu`` returns it), and the sigmoid."""
    s = tl.sigmoid(x)
    return (x * s).to(X.dtype.element_ty).to(tl.float32), s


@triton.jit
def _qkv_rows(X, n, part, h, t0, T, sxb, sxt, sxc, INNER, HD, BT: tl.constexpr, BD: tl.constexpr):
    """Rows ``t0 .. t0+BT`` of head ``h`` of part ``part`` (q, k, v) of sequence ``n``: float32 ``x``, the mask,
    the offsets."""
    offs_t = t0 + tl.arange(0, BT)
    offs_d = tl.arange(0, BD)
    m = (offs_t[:, None] < T) & (offs_d[None, :] < HD)
    ch = part * INNER + h * HD + offs_d
    x = tl.load(X + n * sxb + offs_t[:, None] * sxt + ch[None, :] * sxc, mask=m, other=0.0).to(tl.float32)
    return x, m, offs_t, offs_d


@triton.jit
def _store_part(Q, K, V, part, off, val, m):
    """``val`` at ``off`` of whichever of ``Q``, ``K``, ``V`` part 0, 1, 2 is (one store runs, two are masked off)."""
    tl.store(Q + off, val.to(Q.dtype.element_ty), mask=m & (part == 0))
    tl.store(K + off, val.to(K.dtype.element_ty), mask=m & (part == 1))
    tl.store(V + off, val.to(V.dtype.element_ty), mask=m & (part == 2))


@triton.jit
def _load_part(Q, K, V, part, off, m):
    """``_store_part``'s read: float32 of whichever of ``Q``, ``K``, ``V`` part 0, 1, 2 is."""
    q = tl.load(Q + off, mask=m & (part == 0), other=0.0).to(tl.float32)
    k = tl.load(K + off, mask=m & (part == 1), other=0.0).to(tl.float32)
    v = tl.load(V + off, mask=m & (part == 2), other=0.0).to(tl.float32)
    return q + k + v


@triton.jit
def _qkv_fwd_kernel(X, Q, K, V, T, sxb, sxt, sxc, H, HD, NORM_V: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr):
    """One program per (sequence, part, head) and ``BT`` tokens: ``Q``, ``K`` or ``V`` ``[n, h, t, :]``."""
    pid = tl.program_id(0)
    n, part, h = pid // (3 * H), (pid // H) % 3, pid % H
    x, m, offs_t, offs_d = _qkv_rows(X, n, part, h, tl.program_id(1) * BT, T, sxb, sxt, sxc, H * HD, HD, BT, BD)
    a, _ = _silu_rounded(X, x)
    norm = tl.sqrt(tl.sum(a * a, axis=1))
    scale = tl.where((part < 2) | NORM_V, 1.0 / tl.maximum(norm, 1e-12), 1.0)
    off = ((n * H + h) * T + offs_t[:, None]) * HD + offs_d[None, :]
    _store_part(Q, K, V, part, off, a * scale[:, None], m)


@triton.jit
def _qkv_bwd_kernel(X, DQ, DK, DV, DX, T, sxb, sxt, sxc, H, HD, NORM_V: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr):
    """The gradient of ``X`` from those of ``Q``, ``K``, ``V``, recomputing the forward; ``DX`` has ``X``'s
    strides."""
    pid = tl.program_id(0)
    n, part, h = pid // (3 * H), (pid // H) % 3, pid % H
    x, m, offs_t, offs_d = _qkv_rows(X, n, part, h, tl.program_id(1) * BT, T, sxb, sxt, sxc, H * HD, HD, BT, BD)
    a, s = _silu_rounded(X, x)
    dy = _load_part(DQ, DK, DV, part, ((n * H + h) * T + offs_t[:, None]) * HD + offs_d[None, :], m)
    norm = tl.sqrt(tl.sum(a * a, axis=1))
    # y = a / max(|a|, eps), eps = 1e-12 (F.normalize's): (dy - u (u . dy)) / |a| above eps, dy / eps at or
    # below it (the clamp holds the norm constant there)
    inv = 1.0 / tl.maximum(norm, 1e-12)
    u = a * inv[:, None]
    proj = tl.where(norm > 1e-12, tl.sum(u * dy, axis=1), 0.0)
    da = tl.where((part < 2) | NORM_V, (dy - u * proj[:, None]) * inv[:, None], dy)
    dx = da * (s * (1.0 + x * (1.0 - s)))  # silu'(x)
    ch = part * H * HD + h * HD + offs_d
    tl.store(DX + n * sxb + offs_t[:, None] * sxt + ch[None, :] * sxc, dx.to(DX.dtype.element_ty), mask=m)


@triton.jit
def _log_sigmoid(u):
    e = tl.exp(-tl.abs(u))
    log1p = tl.where(e < 1e-4, e * (1.0 - e * (0.5 - e / 3.0)), tl.log(1.0 + e))
    return tl.minimum(u, 0.0) - log1p


@triton.jit
def _gate_rows(G, n, t0, T, sgb, sgt, H, BT: tl.constexpr, BG: tl.constexpr):
    """``BT`` tokens' ``3 * H`` gate pre-activations of sequence ``n`` (float32; ``G``'s strides between sequences
    and tokens ``sgb``, ``sgt``, columns adjacent), the mask, which gate (0 theta, 1 eta, 2 alpha) and head each
    column is, the token offsets."""
    offs_t = t0 + tl.arange(0, BT)
    col = tl.arange(0, BG)
    m = (offs_t[:, None] < T) & (col[None, :] < 3 * H)
    g = tl.load(G + n * sgb + offs_t[:, None] * sgt + col[None, :], mask=m, other=0.0).to(tl.float32)
    return g, m, col // H, col % H, offs_t


@triton.jit
def _gates_fwd_kernel(G, LR, LOG_ETA, LOG_KEEP, T, sgb, sgt, H, max_lr, log_max_momentum, BT: tl.constexpr,
                      BG: tl.constexpr):
    """One program per sequence and ``BT`` tokens: ``[n, h, t]`` of theta, log eta and log(1 - alpha)."""
    n = tl.program_id(0)
    g, m, j, h, offs_t = _gate_rows(G, n, tl.program_id(1) * BT, T, sgb, sgt, H, BT, BG)
    j2 = j[None, :]
    out = tl.where(j2 == 0, max_lr * tl.sigmoid(g),
                   tl.where(j2 == 1, _log_sigmoid(g) + log_max_momentum, _log_sigmoid(-g)))
    _store_part(LR, LOG_ETA, LOG_KEEP, j2, (n * H + h[None, :]) * T + offs_t[:, None], out, m)


@triton.jit
def _gates_bwd_kernel(G, DLR, DLOG_ETA, DLOG_KEEP, DG, T, sgb, sgt, H, max_lr, BT: tl.constexpr,
                      BG: tl.constexpr):
    """The gradient of ``G`` (written contiguous ``[B, T, 3 * H]``) from those of the three gates [B, H, T]."""
    n = tl.program_id(0)
    g, m, j, h, offs_t = _gate_rows(G, n, tl.program_id(1) * BT, T, sgb, sgt, H, BT, BG)
    j2 = j[None, :]
    dout = _load_part(DLR, DLOG_ETA, DLOG_KEEP, j2, (n * H + h[None, :]) * T + offs_t[:, None], m)
    s = tl.sigmoid(g)
    # d theta / dg = max_lr s (1 - s); d logsigmoid(g) / dg = 1 - s; d logsigmoid(-g) / dg = -s
    dg = dout * tl.where(j2 == 0, max_lr * s * (1.0 - s), tl.where(j2 == 1, 1.0 - s, -s))
    col = tl.arange(0, BG)
    tl.store(DG + (n * T + offs_t[:, None]) * (3 * H) + col[None, :], dg.to(DG.dtype.element_ty), mask=m)


def _empty(*shape, device, dtype) -> torch.Tensor:
    """Every buffer the kernels write (the tests replace this with a NaN fill: unwritten elements show)."""
    return torch.empty(*shape, device=device, dtype=dtype)


def _empty_strided(shape, stride, device, dtype) -> torch.Tensor:
    """:func:`_empty` with given strides (a dense permutation)."""
    order = sorted(range(len(shape)), key=lambda d: stride[d], reverse=True)
    return _empty(*(shape[d] for d in order), device=device, dtype=dtype).permute(
        *(order.index(d) for d in range(len(shape))))


def _grid(B: int, T: int, per_seq: int) -> tuple[int, int]:
    return B * per_seq, triton.cdiv(T, BLOCK_T)


def _block(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


# -- q, k, v -----------------------------------------------------------------------------------------


@torch.library.custom_op("memtrain::titans_qkv_heads", mutates_args=())
def _qkv_fwd(x: torch.Tensor, heads: int, norm_v: bool,
             out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, C = x.shape
    hd = C // (3 * heads)
    q, k, v = (_empty(B, heads, T, hd, device=x.device, dtype=out_dtype) for _ in range(3))
    _qkv_fwd_kernel[_grid(B, T, 3 * heads)](x, q, k, v, T, *x.stride(), heads, hd, NORM_V=norm_v, BT=BLOCK_T,
                                            BD=_block(hd))
    return q, k, v


@_qkv_fwd.register_fake
def _(x, heads, norm_v, out_dtype):
    B, T, C = x.shape
    return tuple(x.new_empty(B, heads, T, C // (3 * heads), dtype=out_dtype) for _ in range(3))


def _dense_like(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if its elements are dense in memory in some order of its dimensions (the convolution's
    transposed output is), else a contiguous copy: the gradient is written with the same strides, so it reaches
    the convolution's backward in the layout it computes in (no copy there)."""
    order = sorted(range(x.dim()), key=lambda d: x.stride(d))
    size = 1
    for d in order:
        if x.stride(d) != size:
            return x.contiguous()
        size *= x.shape[d]
    return x


@torch.library.custom_op("memtrain::titans_qkv_heads_bwd", mutates_args=())
def _qkv_bwd(x: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, heads: int,
             norm_v: bool) -> torch.Tensor:
    B, T, C = x.shape
    x = _dense_like(x)
    dx = _empty_strided(x.shape, x.stride(), device=x.device, dtype=x.dtype)
    _qkv_bwd_kernel[_grid(B, T, 3 * heads)](x, dq.contiguous(), dk.contiguous(), dv.contiguous(), dx, T,
                                            *x.stride(), heads, C // (3 * heads), NORM_V=norm_v, BT=BLOCK_T,
                                            BD=_block(C // (3 * heads)))
    return dx


@_qkv_bwd.register_fake
def _(x, dq, dk, dv, heads, norm_v):
    x = _dense_like(x)
    return x.new_empty_strided(x.shape, x.stride())


def _register_backward(fwd, bwd) -> None:
    """``fwd(x, a, b, c)``'s autograd (three outputs): ``x`` saved, ``a`` and ``b`` kept, the gradient of ``x`` is
    ``bwd(x, grad_0, grad_1, grad_2, a, b)`` (the other arguments are not differentiable). The three outputs are
    separate tensors, so their gradients reach the backward operator as autograd delivers them: no stack joins
    them (a gradient the loss does not reach arrives as zeros)."""
    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.args = inputs[1:3]

    def backward(ctx, g0, g1, g2):
        (x,) = ctx.saved_tensors
        return bwd(x, g0, g1, g2, *ctx.args), None, None, None

    fwd.register_autograd(backward, setup_context=setup)


_register_backward(_qkv_fwd, _qkv_bwd)  # kept: heads, norm_v


def qkv_heads(x: torch.Tensor, heads: int, norm_v: bool, out_dtype: torch.dtype):
    """``q, k, v`` ``[B, heads, T, head_dim]`` (contiguous, ``out_dtype``) from ``x`` ``[B, T, 3 * heads *
    head_dim]`` (any strides): ``normalize(silu(x_part))`` per head, v unnormalised unless ``norm_v``."""
    return _qkv_fwd(x, heads, norm_v, out_dtype)


# -- gates -------------------------------------------------------------------------------------------


def _rows(g: torch.Tensor) -> torch.Tensor:
    """``g`` ``[B, T, 3 * heads]`` as the gate kernels read it: any strides between sequences and tokens (MAC's gate
    projection is a column slice of a wider one), adjacent columns."""
    return g if g.stride(-1) == 1 else g.contiguous()


@torch.library.custom_op("memtrain::titans_gates", mutates_args=())
def _gates_fwd(g: torch.Tensor, heads: int, max_lr: float,
               log_max_momentum: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, _ = g.shape
    lr, log_eta, log_keep = (_empty(B, heads, T, device=g.device, dtype=torch.float32) for _ in range(3))
    g = _rows(g)
    _gates_fwd_kernel[_grid(B, T, 1)](g, lr, log_eta, log_keep, T, g.stride(0), g.stride(1), heads, max_lr,
                                      log_max_momentum, BT=BLOCK_T, BG=_block(3 * heads))
    return lr, log_eta, log_keep


@_gates_fwd.register_fake
def _(g, heads, max_lr, log_max_momentum):
    B, T, _ = g.shape
    return tuple(g.new_empty(B, heads, T, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("memtrain::titans_gates_bwd", mutates_args=())
def _gates_bwd(g: torch.Tensor, dlr: torch.Tensor, dlog_eta: torch.Tensor, dlog_keep: torch.Tensor, heads: int,
               max_lr: float) -> torch.Tensor:
    B, T, _ = g.shape
    dg = _empty(*g.shape, device=g.device, dtype=g.dtype)
    g = _rows(g)
    _gates_bwd_kernel[_grid(B, T, 1)](g, *(d.float().contiguous() for d in (dlr, dlog_eta, dlog_keep)), dg, T,
                                      g.stride(0), g.stride(1), heads, max_lr, BT=BLOCK_T, BG=_block(3 * heads))
    return dg


@_gates_bwd.register_fake
def _(g, dlr, dlog_eta, dlog_keep, heads, max_lr):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


_register_backward(_gates_fwd, _gates_bwd)  # kept: heads, max_lr


def gates(g: torch.Tensor, heads: int, max_lr: float, max_momentum: float):
    """``(theta, log eta, log(1 - alpha))``, each ``[B, heads, T]`` float32, from the gate projection ``g``
    ``[B, T, 3 * heads]`` (``[theta | eta | alpha]`` pre-activations, one per head)."""
    return _gates_fwd(g, heads, max_lr, math.log(max_momentum))


__all__ = ["gates", "qkv_heads"]
