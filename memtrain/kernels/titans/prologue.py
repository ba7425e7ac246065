"""The memory layer's prologue as fused Triton kernels, forward and backward: the work between its projections
and the inner loop, one launch per call each way (two backward with the convolution) where PyTorch issues a dozen
ops.

:meth:`memtrain.model.titans.memory.NeuralMemory.write` (Titans, Sections 3.1-3.2 and 4.4) turns the projections
and the gate projection into what the scan kernels read:

- :func:`conv_qkv_heads` -- ``q, k, v`` ``[B, H, T, head_dim]`` from the projection ``[B, T, 3 * H * head_dim]``
  and the state's convolution cache: the causal depthwise convolution (Section 4.4), SiLU, L2 normalisation per
  head (q and k; v too with ``norm_v``), one contiguous copy per head in the activations' half precision.
  :func:`qkv_heads` is the same after a convolution run elsewhere (``MEMTRAIN_TITANS_FUSED_CONV=0``). PyTorch's
  form (``NeuralMemory._conv``, ``NeuralMemory._qkv_heads``): the cache's concatenation and the convolution, then
  6 ops forward (SiLU, cast, vector norm, clamp, division, the layout copy), about 16 backward.
- :func:`conv_queries` -- MAC's retrieval queries (``NeuralMemory.segment_queries``): the same kernels with the
  query part alone, no cache, the convolution restarting with zero left context every segment, float32 out.
- :func:`gates` -- ``theta = max_lr * sigmoid(g_0)``, ``log eta = logsigmoid(g_1) + log(max_momentum)``,
  ``log(1 - alpha) = logsigmoid(-g_2)`` ``[B, H, T]`` in float32 from the gate projection's ``[B, T, 3 * H]``.
  PyTorch's form (``NeuralMemory._gates``, per-token gates): 8 ops forward, about 8 backward.

Each is one custom operator (:mod:`torch.library`) with separate outputs and a registered backward operator that
reads their gradients, so eager autograd issues one launch each way (no stack joins the outputs' gradients) and a
compiled block's graph keeps it as one node (eager and compiled blocks compute the same). Eager
``titans-170m-mac`` runs the q/k/v and gate pair 96 times per forward (12 blocks x 8 segments): without the
convolution 3,264 fewer device ops per sequence, 14,515 -> 11,251 (``benchmarks/op_count.py``); the convolution
and the retrieval queries 660 fewer since (5,925 -> 5,265, the next segment's cache an output of its own whose
gradient the backward kernel adds: no zero-filled gradient of the projection and add per segment).

The convolution's backward (:func:`_qkv_bwd_kernel`) recomputes the forward in tiles overlapping by the width - 1
rows, takes each input row's gradient from the tile shifted in registers (``tl.gather``), and writes each
program's part of the weight's and bias's gradients to a float32 buffer that :func:`_conv_grad_kernel` sums in
order (deterministic; no atomics).

Precision: the arithmetic is float32 (inputs upcast). The convolution's output is rounded to the input's dtype as
``F.conv1d`` returns it, and SiLU's output before the norm, as ``F.silu`` on a half-precision tensor returns it,
so the forward matches PyTorch's form to float32 rounding; the backward stays in float32 where PyTorch's rounds
SiLU's and the convolution's gradients to half precision, so it is the more precise of the two.
``logsigmoid(u) = min(u, 0) - log1p(exp(-|u|))`` with ``log1p`` from its series below ``1e-4`` (absolute error
under 1e-12 there). Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from memtrain.kernels.launch import block as _block
from memtrain.kernels.launch import cdiv
from memtrain.kernels.op import kernel_op

BLOCK_T = 32  # tokens per program
# The q/k/v backward with the convolution launches 8 warps: at head size 64 in bf16 (sm_90, Triton 3.6) it keeps
# its tiles in 255 registers without spilling; 4 warps spill about 800 bytes per thread (aot.compile_kernel).
CONV_BWD_WARPS = 8
# Unlike the scan kernels (triton_kernels._RUNTIME_INTS), these leave Triton's specialisation of integer arguments
# on: they compile in under a second, a call length adds at most a variant or two (divisible by 16 or not), and
# with the lengths and strides known divisible by 16 and the stride along the contiguous dimension known to be 1
# (the channels of a projection; the tokens of a convolution's output, ``[B, C, T]`` transposed) the loads are
# 16-byte vectors (sm_90 PTX: ``ld.global.v4``; scalar 2-byte loads with them unspecialised).


@triton.jit
def _silu_rounded(X, x):
    """SiLU of float32 ``x`` rounded to ``X``'s element type (as ``F.silu`` returns it), and the sigmoid."""
    s = tl.sigmoid(x)
    return (x * s).to(X.dtype.element_ty).to(tl.float32), s


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
def _src_rows(X, CACHE, n, ch, rows, lo, T, sxb, sxt, sxc, scb, sct, scc, md, PAD: tl.constexpr):
    """Float32 rows ``rows`` (``[BT]``) of the convolution's input along ``ch``, each where ``lo <= row < T`` (zero
    elsewhere; ``lo >= -PAD``): ``X``'s row for rows from 0, the cache's row ``PAD + row`` (the left context) below."""
    ok = (rows >= lo) & (rows < T)
    v = tl.load(X + n * sxb + rows[:, None] * sxt + ch[None, :] * sxc,
                mask=(ok & (rows >= 0))[:, None] & md[None, :], other=0.0).to(tl.float32)
    if PAD > 0:
        v += tl.load(CACHE + n * scb + (rows + PAD)[:, None] * sct + ch[None, :] * scc,
                     mask=(ok & (rows < 0))[:, None] & md[None, :], other=0.0).to(tl.float32)
    return v


@triton.jit
def _first_src(t, SEG, CACHED):
    """The first input row the convolution's output row ``t`` reads: its segment's start (segments of ``SEG`` rows
    restart with zero left context), or ``-CACHED`` in the first segment (the cache's rows, 0 without a cache)."""
    start = (t // SEG) * SEG
    return tl.where(start <= 0, -CACHED, start)


@triton.jit
def _pre_rows(X, CACHE, W, BIAS, n, ch, rows, T, SEG, CACHED, sxb, sxt, sxc, scb, sct, scc, md,
              CONV_K: tl.constexpr):
    """Float32 rows ``rows`` of what SiLU takes along channels ``ch``: ``X`` itself (``CONV_K`` 0), or the causal
    depthwise convolution ``bias + sum_k W[c, k] src[t + k - (CONV_K - 1)]`` over ``X`` after its cache
    (:func:`_src_rows`, :func:`_first_src`), accumulated in float32 from the bias up and rounded to ``X``'s dtype
    (as ``F.conv1d`` returns it)."""
    if CONV_K == 0:
        pre = _src_rows(X, CACHE, n, ch, rows, 0, T, sxb, sxt, sxc, scb, sct, scc, md, 0)
    else:
        lo = _first_src(rows, SEG, CACHED)
        w = tl.load(W + ch * CONV_K, mask=md, other=0.0).to(tl.float32)
        pre = tl.load(BIAS + ch, mask=md, other=0.0).to(tl.float32)[None, :] + w[None, :] * _src_rows(
            X, CACHE, n, ch, rows - (CONV_K - 1), lo, T, sxb, sxt, sxc, scb, sct, scc, md, CONV_K - 1)
        for k in tl.static_range(1, CONV_K):
            w = tl.load(W + ch * CONV_K + k, mask=md, other=0.0).to(tl.float32)
            pre += w[None, :] * _src_rows(X, CACHE, n, ch, rows + (k - (CONV_K - 1)), lo, T, sxb, sxt, sxc, scb,
                                          sct, scc, md, CONV_K - 1)
        pre = pre.to(X.dtype.element_ty).to(tl.float32)
    return pre


@triton.jit
def _qkv_fwd_kernel(X, CACHE, W, BIAS, Q, K, V, NEWC, T, SEG, CACHED, sxb, sxt, sxc, scb, sct, scc, H, HD,
                    NORM_V: tl.constexpr, CONV_K: tl.constexpr, PARTS: tl.constexpr, NEW_CACHE: tl.constexpr,
                    BT: tl.constexpr, BD: tl.constexpr):
    """One program per (sequence, part, head) and ``BT`` tokens: ``Q``, ``K`` or ``V`` ``[n, h, t, :]`` (``PARTS``
    3; 1: ``Q`` alone). ``NEW_CACHE``: the first program along T also copies its channels of the convolution's
    next left context, the last ``CONV_K - 1`` rows of the cache and ``X`` together, to ``NEWC`` (contiguous)."""
    pid = tl.program_id(0)
    n, part, h = pid // (PARTS * H), (pid // H) % PARTS, pid % H
    offs_t = tl.program_id(1) * BT + tl.arange(0, BT)
    offs_d = tl.arange(0, BD)
    md = offs_d < HD
    ch = part * H * HD + h * HD + offs_d
    x = _pre_rows(X, CACHE, W, BIAS, n, ch, offs_t, T, SEG, CACHED, sxb, sxt, sxc, scb, sct, scc, md, CONV_K)
    a, _ = _silu_rounded(X, x)
    norm = tl.sqrt(tl.sum(a * a, axis=1))
    scale = tl.where((part < 2) | NORM_V, 1.0 / tl.maximum(norm, 1e-12), 1.0)
    off = ((n * H + h) * T + offs_t[:, None]) * HD + offs_d[None, :]
    _store_part(Q, K, V, part, off, a * scale[:, None], (offs_t < T)[:, None] & md[None, :])
    if NEW_CACHE:
        if tl.program_id(1) == 0:
            r = tl.arange(0, BT)
            tail = _src_rows(X, CACHE, n, ch, T - (CONV_K - 1) + r, -CACHED, T, sxb, sxt, sxc, scb, sct, scc, md,
                             CONV_K - 1)
            tl.store(NEWC + (n * (CONV_K - 1) + r)[:, None] * (PARTS * H * HD) + ch[None, :],
                     tail.to(NEWC.dtype.element_ty), mask=(r < CONV_K - 1)[:, None] & md[None, :])


@triton.jit
def _dpre_rows(X, CACHE, W, BIAS, DQ, DK, DV, n, part, h, ch, offs_d, rows, T, SEG, CACHED, sxb, sxt, sxc, scb,
               sct, scc, H, HD, md, NORM_V: tl.constexpr, CONV_K: tl.constexpr):
    """The gradient of :func:`_pre_rows`' rows ``rows`` from those of ``Q``, ``K``, ``V``, recomputing the forward:
    float32, zero at rows outside ``0 .. T``."""
    x = _pre_rows(X, CACHE, W, BIAS, n, ch, rows, T, SEG, CACHED, sxb, sxt, sxc, scb, sct, scc, md, CONV_K)
    a, s = _silu_rounded(X, x)
    m = ((rows >= 0) & (rows < T))[:, None] & md[None, :]
    dy = _load_part(DQ, DK, DV, part, ((n * H + h) * T + rows[:, None]) * HD + offs_d[None, :], m)
    norm = tl.sqrt(tl.sum(a * a, axis=1))
    # y = a / max(|a|, eps), eps = 1e-12 (F.normalize's): (dy - u (u . dy)) / |a| above eps, dy / eps at or
    # below it (the clamp holds the norm constant there)
    inv = 1.0 / tl.maximum(norm, 1e-12)
    u = a * inv[:, None]
    proj = tl.where(norm > 1e-12, tl.sum(u * dy, axis=1), 0.0)
    da = tl.where((part < 2) | NORM_V, (dy - u * proj[:, None]) * inv[:, None], dy)
    return da * (s * (1.0 + x * (1.0 - s)))  # silu'(x)


@triton.jit
def _qkv_bwd_kernel(X, CACHE, W, BIAS, DQ, DK, DV, DNEWC, DX, DCACHE, PW, T, SEG, CACHED, sxb, sxt, sxc, scb, sct,
                    scc, sdb, sdt, sdc, H, HD, NORM_V: tl.constexpr, CONV_K: tl.constexpr, PARTS: tl.constexpr,
                    PAD: tl.constexpr, NEW_CACHE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """The gradient of ``X`` (``DX``, strides ``sdb, sdt, sdc``) from those of ``Q``, ``K``, ``V``, recomputing the
    forward; with the convolution (``CONV_K`` > 0) also its cache's (``DCACHE``, contiguous; with ``CACHED`` rows)
    and this program's part of its weight's and bias's (``PW[n * programs along T + this one, k, c]``, the bias's
    at ``k = CONV_K``). ``NEW_CACHE``: the gradient of the next left context (``DNEWC``, contiguous ``[B, PAD, C]``:
    the rows ``T - PAD .. T`` of the cache and ``X`` together) is added where those rows lie.

    With the convolution an input row ``i`` feeds the outputs ``i + s``, ``s = 0 .. PAD`` (``PAD = CONV_K - 1``)
    of its segment: ``d src[i] = sum_s W[c, PAD - s] dpre[i + s]``. So the programs' tiles of ``BT`` rows overlap
    by ``PAD``: program ``p`` recomputes ``dpre`` at rows ``p S - PAD .. p S - PAD + BT`` (``S = BT - PAD``),
    gives the input gradient of the first ``S`` of them (rows from ``-PAD``: the cache's first) from the tile
    shifted by ``s`` rows (``tl.gather``), and the weight's and bias's from its last ``S`` (each row of ``dpre`` in
    one program)."""
    pid = tl.program_id(0)
    n, part, h = pid // (PARTS * H), (pid // H) % PARTS, pid % H
    r = tl.arange(0, BT)
    rows = tl.program_id(1) * (BT - PAD) - PAD + r
    offs_d = tl.arange(0, BD)
    md = offs_d < HD
    ch = part * H * HD + h * HD + offs_d
    dpre = _dpre_rows(X, CACHE, W, BIAS, DQ, DK, DV, n, part, h, ch, offs_d, rows, T, SEG, CACHED, sxb, sxt, sxc,
                      scb, sct, scc, H, HD, md, NORM_V, CONV_K)
    if CONV_K == 0:
        dsrc = dpre
    else:
        C = PARTS * H * HD
        pw = PW + ((n * tl.num_programs(1) + tl.program_id(1)) * (CONV_K + 1)) * C + ch
        own = tl.where(r >= PAD, 1.0, 0.0)[:, None] * dpre
        lo = _first_src(rows, SEG, CACHED)
        for k in tl.static_range(CONV_K):
            src = _src_rows(X, CACHE, n, ch, rows + (k - PAD), lo, T, sxb, sxt, sxc, scb, sct, scc, md, PAD)
            tl.store(pw + k * C, tl.sum(own * src, axis=0), mask=md)
        tl.store(pw + CONV_K * C, tl.sum(own, axis=0), mask=md)
        dsrc = tl.load(W + ch * CONV_K + PAD, mask=md, other=0.0).to(tl.float32)[None, :] * dpre
        for s in tl.static_range(1, CONV_K):
            shifted = tl.gather(dpre, tl.minimum(r + s, BT - 1)[:, None] + tl.zeros((BT, BD), tl.int32), 0)
            same = rows >= _first_src(rows + s, SEG, CACHED)  # output row i + s reads row i (its segment's)
            dsrc += tl.where(same[:, None], tl.load(W + ch * CONV_K + (PAD - s), mask=md, other=0.0).to(
                tl.float32)[None, :] * shifted, 0.0)
        if NEW_CACHE:
            j = rows - (T - PAD)
            dsrc += tl.load(DNEWC + (n * PAD + j)[:, None] * C + ch[None, :],
                            mask=((j >= 0) & (j < PAD))[:, None] & md[None, :], other=0.0).to(tl.float32)
        tl.store(DCACHE + (n * PAD + rows + PAD)[:, None] * C + ch[None, :], dsrc.to(DCACHE.dtype.element_ty),
                 mask=((r < BT - PAD) & (rows < 0) & (rows >= -CACHED))[:, None] & md[None, :])
    tl.store(DX + n * sdb + rows[:, None] * sdt + ch[None, :] * sdc, dsrc.to(DX.dtype.element_ty),
             mask=((r < BT - PAD) & (rows >= 0) & (rows < T))[:, None] & md[None, :])


@triton.jit
def _conv_grad_kernel(PW, DW, DB, R, C, CONV_K: tl.constexpr, BC: tl.constexpr):
    """The convolution's weight (``DW`` ``[C, CONV_K]``) and bias (``DB`` ``[C]``) gradients, each in its dtype:
    row ``k`` of ``PW`` ``[R, CONV_K + 1, C]`` summed over ``R`` in float32, in order (deterministic)."""
    k = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    acc = tl.zeros((BC,), tl.float32)
    for r in range(R):
        acc += tl.load(PW + (r * (CONV_K + 1) + k) * C + c, mask=mc, other=0.0)
    tl.store(DW + c * CONV_K + k, acc.to(DW.dtype.element_ty), mask=mc & (k < CONV_K))
    tl.store(DB + c, acc.to(DB.dtype.element_ty), mask=mc & (k == CONV_K))


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
    return B * per_seq, cdiv(T, BLOCK_T)


# -- q, k, v -----------------------------------------------------------------------------------------


def _qkv_launch(x, cache, weight, bias, heads: int, norm_v: bool, out_dtype: torch.dtype, parts: int = 3,
                segment: int = 0) -> list[torch.Tensor]:
    """The forward kernel's launch: ``parts`` (3: q, k, v; 1: q) outputs ``[B, heads, T, head_dim]``, and with a
    ``cache`` the next one (the last ``kernel - 1`` rows of the cache and ``x`` together). ``weight`` None: no
    convolution; ``cache`` None: zero left context; ``segment``: the convolution restarts (zero left context)
    every ``segment`` rows (0: never)."""
    B, T, C = x.shape
    hd = C // (parts * heads)
    outs = [_empty(B, heads, T, hd, device=x.device, dtype=out_dtype) for _ in range(parts)]
    conv_k = 0 if weight is None else weight.shape[-1]
    cached = 0 if cache is None else cache.shape[1]
    if cache is not None:
        outs.append(_empty(B, cached, C, device=x.device, dtype=x.dtype))
    _qkv_fwd_kernel[_grid(B, T, parts * heads)](x, cache if cached else x, x if weight is None else weight,
                                                x if bias is None else bias, *(outs[:parts] * 3)[:3],
                                                outs[-1] if cached else x, T, segment or T, cached, *x.stride(),
                                                *(cache if cached else x).stride(), heads, hd, NORM_V=norm_v,
                                                CONV_K=conv_k, PARTS=parts, NEW_CACHE=cached > 0, BT=BLOCK_T,
                                                BD=_block(hd))
    return outs


def _qkv_grad_launch(x, cache, weight, bias, grads, dx, heads: int, norm_v: bool, segment: int = 0,
                     dnew_cache: Optional[torch.Tensor] = None):
    """The backward kernel's launch, for :func:`_qkv_launch`'s outputs' gradients ``grads`` (and ``dnew_cache``,
    the next cache's, None where it has none): ``dx`` filled, and with the convolution the gradients of ``cache``
    (None without one), ``weight`` and ``bias``."""
    B, T, C = x.shape
    parts = len(grads)
    conv_k = 0 if weight is None else weight.shape[-1]
    pad = max(conv_k - 1, 0)
    cached = 0 if cache is None else cache.shape[1]
    grid = (B * parts * heads, cdiv(T + pad, BLOCK_T - pad))  # tiles overlapping by pad rows
    dcache = _empty(B, pad, C, device=x.device, dtype=cache.dtype) if cache is not None else None
    pw = _empty(B * grid[1], conv_k + 1, C, device=x.device, dtype=torch.float32) if conv_k else x
    grads = [g.contiguous() for g in grads]
    new_cache = dnew_cache is not None and cached > 0
    _qkv_bwd_kernel[grid](x, cache if cached else x, x if weight is None else weight, x if bias is None else bias,
                          *(grads * 3)[:3], dnew_cache.contiguous() if new_cache else x, dx,
                          dcache if cached else x, pw, T, segment or T, cached, *x.stride(),
                          *(cache if cached else x).stride(), *dx.stride(), heads, C // (parts * heads),
                          NORM_V=norm_v, CONV_K=conv_k, PARTS=parts, PAD=pad, NEW_CACHE=new_cache, BT=BLOCK_T,
                          BD=_block(C // (parts * heads)), num_warps=CONV_BWD_WARPS if conv_k else 4)
    if not conv_k:
        return None
    dweight = _empty(*weight.shape, device=x.device, dtype=weight.dtype)
    dbias = _empty(C, device=x.device, dtype=bias.dtype)
    _conv_grad_kernel[(conv_k + 1, cdiv(C, CONV_GRAD_BLOCK))](pw, dweight, dbias, pw.shape[0], C,
                                                              CONV_K=conv_k, BC=CONV_GRAD_BLOCK)
    return dcache, dweight, dbias


@kernel_op("memtrain::titans_qkv_heads")
def _qkv_fwd(x: torch.Tensor, heads: int, norm_v: bool,
             out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(_qkv_launch(x, None, None, None, heads, norm_v, out_dtype))


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


@kernel_op("memtrain::titans_qkv_heads_bwd")
def _qkv_bwd(x: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, heads: int,
             norm_v: bool) -> torch.Tensor:
    x = _dense_like(x)
    dx = _empty_strided(x.shape, x.stride(), device=x.device, dtype=x.dtype)
    _qkv_grad_launch(x, None, None, None, (dq, dk, dv), dx, heads, norm_v)
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


# -- the convolution and q, k, v ----------------------------------------------------------------------

CONV_GRAD_BLOCK = 128  # channels per program of the weight and bias gradients' sum
CONV_MAX_KERNEL = 16  # the widest convolution: the backward's 32-row tiles overlap by its width - 1


def _check_width(name: str, weight: torch.Tensor) -> None:
    if not 1 <= weight.shape[-1] <= CONV_MAX_KERNEL:
        raise ValueError(f"{name}: a width-{weight.shape[-1]} convolution; the kernels take widths 1 to "
                         f"{CONV_MAX_KERNEL}")


@kernel_op("memtrain::titans_conv_qkv_heads")
def _conv_qkv_fwd(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, heads: int,
                  norm_v: bool, out_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(_qkv_launch(x, cache, weight, bias, heads, norm_v, out_dtype))


@_conv_qkv_fwd.register_fake
def _(x, cache, weight, bias, heads, norm_v, out_dtype):
    B, T, C = x.shape
    return (*(x.new_empty(B, heads, T, C // (3 * heads), dtype=out_dtype) for _ in range(3)),
            x.new_empty(B, cache.shape[1], C))


@kernel_op("memtrain::titans_conv_qkv_heads_bwd")
def _conv_qkv_bwd(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dq: torch.Tensor,
                  dk: torch.Tensor, dv: torch.Tensor, dnew_cache: Optional[torch.Tensor], heads: int,
                  norm_v: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = _empty(*x.shape, device=x.device, dtype=x.dtype)
    return (dx, *_qkv_grad_launch(x, cache, weight, bias, (dq, dk, dv), dx, heads, norm_v, dnew_cache=dnew_cache))


@_conv_qkv_bwd.register_fake
def _(x, cache, weight, bias, dq, dk, dv, dnew_cache, heads, norm_v):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(cache, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format), torch.empty_like(bias))


def _conv_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.args = inputs[4:6]
    ctx.qkv = [(o.shape, o.dtype) for o in output[:3]]
    ctx.set_materialize_grads(False)  # the next cache's gradient stays None where the loss does not reach it


def _conv_backward(ctx, dq, dk, dv, dnew_cache):
    """The gradients of ``x``, the cache, the weight and the bias; q, k or v that the loss does not reach give
    zeros (as autograd would materialise them), the next cache's gradient is left out (no zeros op). The saved
    tensors are unpacked once: under activation checkpointing (``torch.utils.checkpoint``, non-reentrant) a second
    unpack is an error."""
    saved = ctx.saved_tensors
    dqkv = [torch.zeros(shape, device=saved[0].device, dtype=dtype) if g is None else g
            for g, (shape, dtype) in zip((dq, dk, dv), ctx.qkv)]
    return (*_conv_qkv_bwd(*saved, *dqkv, dnew_cache, *ctx.args), None, None, None)


_conv_qkv_fwd.register_autograd(_conv_backward, setup_context=_conv_setup)


def conv_qkv_heads(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, heads: int,
                   norm_v: bool, out_dtype: torch.dtype):
    """:func:`qkv_heads` of the causal depthwise convolution of ``x`` ``[B, T, C]`` (any strides) after its left
    context ``cache`` ``[B, kernel - 1, C]``: ``weight`` ``[C, 1, kernel]`` (``nn.Conv1d``'s, contiguous) and
    ``bias`` ``[C]``, the convolution's output rounded to ``x``'s dtype as ``F.conv1d`` returns it; and the next
    call's left context (the last ``kernel - 1`` rows of ``cache`` and ``x`` together, contiguous): ``(q, k, v,
    new_cache)``. One kernel each way plus one for the weight's and bias's gradients (summed in float32 over the
    sequences and blocks of tokens, in order); the convolution's output is never stored. The new cache's gradient
    (the next segment's, in MAC) is added inside the backward kernel, where a view of ``x`` would have cost a
    zero-filled gradient of all of ``x`` and an add."""
    _check_width("conv_qkv_heads", weight)
    if cache.shape[1] != weight.shape[-1] - 1:
        raise ValueError(f"conv_qkv_heads: the cache has {cache.shape[1]} rows; a width-{weight.shape[-1]} "
                         f"convolution needs {weight.shape[-1] - 1}")
    return _conv_qkv_fwd(x, cache, weight.contiguous(), bias, heads, norm_v, out_dtype)


@kernel_op("memtrain::titans_conv_queries")
def _conv_queries_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, heads: int, segment: int,
                      out_dtype: torch.dtype) -> torch.Tensor:
    return _qkv_launch(x, None, weight, bias, heads, False, out_dtype, parts=1, segment=segment)[0]


@_conv_queries_fwd.register_fake
def _(x, weight, bias, heads, segment, out_dtype):
    B, T, C = x.shape
    return x.new_empty(B, heads, T, C // heads, dtype=out_dtype)


@kernel_op("memtrain::titans_conv_queries_bwd")
def _conv_queries_bwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dq: torch.Tensor, heads: int,
                      segment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = _empty(*x.shape, device=x.device, dtype=x.dtype)
    _, dweight, dbias = _qkv_grad_launch(x, None, weight, bias, (dq,), dx, heads, False, segment)
    return dx, dweight, dbias


@_conv_queries_bwd.register_fake
def _(x, weight, bias, dq, heads, segment):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format), torch.empty_like(bias))


def _queries_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.args = inputs[3:5]


def _queries_backward(ctx, dq):
    return (*_conv_queries_bwd(*ctx.saved_tensors, dq, *ctx.args), None, None, None)


_conv_queries_fwd.register_autograd(_queries_backward, setup_context=_queries_setup)


def conv_queries(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, heads: int, segment: int,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Retrieval queries ``[B, heads, T, head_dim]`` (contiguous, ``out_dtype``) from the query projection ``x``
    ``[B, T, heads * head_dim]`` (any strides): the causal depthwise convolution (``weight`` ``[C, 1, kernel]``,
    ``bias`` ``[C]``) restarting with zero left context every ``segment`` rows, rounded to ``x``'s dtype, then
    ``normalize(silu(.))`` per head -- :meth:`memtrain.model.titans.memory.NeuralMemory.segment_queries`' form.
    The same kernels as :func:`conv_qkv_heads`, with one part and no cache."""
    _check_width("conv_queries", weight)
    if segment < 1:
        raise ValueError(f"conv_queries: {segment}-row segments; the kernels take segments of at least one row")
    return _conv_queries_fwd(x, weight.contiguous(), bias, heads, segment, out_dtype)


# -- gates -------------------------------------------------------------------------------------------


def _rows(g: torch.Tensor) -> torch.Tensor:
    """``g`` ``[B, T, 3 * heads]`` as the gate kernels read it: any strides between sequences and tokens (MAC's gate
    projection is a column slice of a wider one), adjacent columns."""
    return g if g.stride(-1) == 1 else g.contiguous()


@kernel_op("memtrain::titans_gates")
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


@kernel_op("memtrain::titans_gates_bwd")
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


__all__ = ["conv_qkv_heads", "conv_queries", "gates", "qkv_heads"]
