"""The Titans inner loop in Triton (Titans, Sections 3.1-3.2, eqs. 13-16): the chunk-parallel memory update
and retrieval, forward and backward, for a matrix memory (depth 1) and a two-layer SiLU MLP memory (depth 2).
:mod:`.reference` (the PyTorch chunked form) is the specification.

One program per (batch element, head) runs the whole sequence: the loop over chunks is inside the kernel
(one forward launch and one backward launch per layer call). Per chunk of ``C`` tokens, with the chunk-start
weights ``W`` and momentum ``S`` (per layer) in float32 and the chunk's recurrence coefficients
(:func:`.reference.chunk_coefficients`: ``decay`` B_t, ``carry`` f_t, ``mix`` c_{t,i}, the momentum's
``E_end`` and ``m_end``), the forward

1. takes the per-token gradients of ``||M_W(k_i) - v_i||^2`` at ``W`` in factored form: layer inputs
   ``a_i`` and pre-activation deltas ``d_i`` (``u_i = d_i a_i^T``, never materialised);
2. reads every token, layer by layer, ``z_t = B_t W h_t + f_t S h_t - sum_{i<=t} c_{t,i} d_i (a_i . h_t)``
   as masked ``[C, C]`` matrix products (``y_t = M_t(q_t)``, the weights after token t's update);
3. carries ``W' = B_last W + f_last S - sum_i c_{last,i} d_i a_i^T`` and
   ``S' = E_end S - sum_i m_end_i d_i a_i^T`` to the next chunk.

The backward walks the chunks in reverse with the gradients of the chunk-end state carried (float32),
recomputing each chunk's forward from its start state, and returns the gradients of q, k, v, of every
coefficient and of the initial weights and momentum. The coefficients themselves come from two more kernels
(:func:`triton_chunk_coefficients`: the gates of one chunk per program, forward, and the gradients of the gates
theta, eta, alpha from those of the coefficients, backward), the specification being
:func:`.reference.chunk_coefficients` (23 PyTorch ops forward and about 40 backward per call). The second-order
terms are included: ``a_i``, ``d_i`` depend on the chunk-start weights, so the gradient reaching ``W`` also
flows back through the per-token gradients (``silu''`` for depth 2). Memory stays bounded: the forward saves
the state at the start of every ``R``-th chunk only; the backward recomputes the ``R`` states of a group into a
per-program scratch, then differentiates the group in reverse. ``R`` (:func:`_checkpoints`) is at least
``ceil(sqrt(n_chunks))`` (``O(sqrt(n_chunks))`` states per (batch, head) instead of one per chunk) and as
large as a bounded scratch allows, since saved states outlive a call and the scratch does not.

Precision: gates, coefficients, carried state, gradients and all accumulation in float32. With float32
q/k/v the dot products are IEEE float32 (no TF32); with bfloat16 (float16) q/k/v both operands of every dot
are rounded to bfloat16 (float16) for the tensor cores, with float32 accumulation (the interpreter's bfloat16
dot is wrong in Triton 3.8, so the CPU tests check the low-precision path in float16). Block sizes: the head size, hidden width
and chunk size rounded up to powers of two (at least 16), masked. Under ``TRITON_INTERPRET=1`` the same
kernels run on CPU tensors (the tests do).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from memtrain.kernels.launch import block as _block
from memtrain.kernels.op import kernel_op
from memtrain.kernels.titans import requested_backward, requested_forward, requested_stages, requested_wave


# The kernels' integer arguments that vary with a call's length (chunks, padded length, the last chunk's tokens,
# the backward's checkpoint spacing and count). Triton specialises integer arguments by default (equal to 1,
# divisible by 16) and compiles one binary per combination, so every new sequence length could cost another
# 10-30 s compile of each kernel (one GPU session timed a layer benchmark out that way). The widths (C, D, H1)
# stay specialised: they are fixed per model and their divisibility by 16 gives aligned, vectorised loads.
_RUNTIME_INTS = ["NC", "Tp", "N_LAST", "SAVE_EVERY", "NSAVE"]


@triton.jit
def _mm(a, b, DOT: tl.constexpr):
    """``a @ b`` accumulated in float32. ``DOT``: 0 IEEE float32 products (no TF32); 1 both operands rounded to
    bfloat16; 2 to float16 (tensor cores)."""
    if DOT == 0:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))


@triton.jit
def _load_mat(ptr, R, Cc, offs_r, offs_c):
    """A row-major ``[R, Cc]`` float32 matrix into a ``[len(offs_r), len(offs_c)]`` tile (zeros outside)."""
    m = (offs_r[:, None] < R) & (offs_c[None, :] < Cc)
    return tl.load(ptr + offs_r[:, None] * Cc + offs_c[None, :], mask=m, other=0.0)


@triton.jit
def _store_mat(ptr, x, R, Cc, offs_r, offs_c):
    m = (offs_r[:, None] < R) & (offs_c[None, :] < Cc)
    tl.store(ptr + offs_r[:, None] * Cc + offs_c[None, :], x, mask=m)


@triton.jit
def _load_cols(ptr, C, W, col0, Cc, offs_c, offs_x):
    """Columns ``col0 .. col0 + Cc - 1`` of a row-major ``[C, W]`` float32 matrix as a ``[BC, len(offs_x)]`` tile."""
    m = (offs_c[:, None] < C) & (offs_x[None, :] < Cc)
    return tl.load(ptr + offs_c[:, None] * W + col0 + offs_x[None, :], mask=m, other=0.0)


@triton.jit
def _store_cols(ptr, x, C, W, col0, Cc, offs_c, offs_x):
    m = (offs_c[:, None] < C) & (offs_x[None, :] < Cc)
    tl.store(ptr + offs_c[:, None] * W + col0 + offs_x[None, :], x, mask=m)


@triton.jit
def _rows(ptr, n, c, Tp, C, D, offs_c, offs_d):
    """Rows ``c*C + offs_c`` of sequence ``n`` of a ``[N, Tp, D]`` tensor, as float32 ``[BC, BD]``."""
    m = (offs_c[:, None] < C) & (offs_d[None, :] < D)
    off = (n * Tp + c * C + offs_c[:, None]) * D + offs_d[None, :]
    return tl.load(ptr + off, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, x, n, c, Tp, C, D, offs_c, offs_d):
    m = (offs_c[:, None] < C) & (offs_d[None, :] < D)
    tl.store(ptr + (n * Tp + c * C + offs_c[:, None]) * D + offs_d[None, :], x, mask=m)


@triton.jit
def _qkv(Q, K, V, n, c, Tp, C, D, offs_c, offs_d):
    """Chunk ``c``'s queries, keys and values as float32 ``[BC, BD]`` tiles."""
    return (_rows(Q, n, c, Tp, C, D, offs_c, offs_d), _rows(K, n, c, Tp, C, D, offs_c, offs_d),
            _rows(V, n, c, Tp, C, D, offs_c, offs_d))


@triton.jit
def _coefs(DEC, CAR, MIX, EEND, MEND, n, c, NC, C, N_LAST, offs_c):
    """Chunk ``c``'s coefficients, the row ``last`` that gives its end state (``N_LAST - 1`` in the last chunk,
    which may be partial), and the rows of B, f and c at ``last``."""
    last = tl.where(c == NC - 1, N_LAST - 1, C - 1)
    mc = offs_c < C
    base = n * NC + c
    dec = tl.load(DEC + base * C + offs_c, mask=mc, other=0.0)
    car = tl.load(CAR + base * C + offs_c, mask=mc, other=0.0)
    mix = tl.load(MIX + base * C * C + offs_c[:, None] * C + offs_c[None, :], mask=mc[:, None] & mc[None, :],
                  other=0.0)
    ee = tl.load(EEND + base)
    me = tl.load(MEND + base * C + offs_c, mask=mc, other=0.0)
    ml = tl.load(MIX + base * C * C + last * C + offs_c, mask=mc, other=0.0)
    dec_l = tl.load(DEC + base * C + last)
    car_l = tl.load(CAR + base * C + last)
    return last, dec, car, mix, ee, me, ml, dec_l, car_l


@triton.jit
def _inner2(k, v, w1, w2, DOT: tl.constexpr):
    """Per-token gradients of a depth-2 memory at ``(w1, w2)`` in factored form: the hidden activations ``a1``,
    ``silu'`` of their pre-activations, ``curv = e1 silu''`` (``e1`` the hidden delta before ``silu'``: how the
    layer-1 delta moves with its pre-activations, the second-order term) and the deltas of both layers."""
    z1 = _mm(k, tl.trans(w1), DOT)
    sg = tl.sigmoid(z1)
    a1 = z1 * sg
    dsilu = sg + a1 * (1.0 - sg)
    d2 = 2.0 * (_mm(a1, tl.trans(w2), DOT) - v)
    e1 = _mm(d2, w2, DOT)
    return a1, dsilu, e1 * sg * (1.0 - sg) * (2.0 + z1 * (1.0 - 2.0 * sg)), e1 * dsilu, d2


@triton.jit
def _read(h, w, st, a, dd, dec, car, mix, DOT: tl.constexpr):
    """One layer's pre-activations ``B W h + f S h - (c o (h a^T)) d`` for the rows ``h`` of a chunk."""
    p = _mm(h, tl.trans(a), DOT)
    hw = _mm(h, tl.trans(w), DOT)
    hs = _mm(h, tl.trans(st), DOT)
    z = dec[:, None] * hw + car[:, None] * hs - _mm(mix * p, dd, DOT)
    return z, p, hw, hs


@triton.jit
def _advance(w, st, dd, a, ml, me, dec_l, car_l, ee, DOT: tl.constexpr):
    """One layer's chunk-end weights and momentum (deltas ``dd`` ``[BC, out]``, inputs ``a`` ``[BC, in]``)."""
    dt = tl.trans(dd)
    nw = dec_l * w + car_l * st - _mm(dt, ml[:, None] * a, DOT)
    ns = ee * st - _mm(dt, me[:, None] * a, DOT)
    return nw, ns


@triton.jit
def _end_grads(gw, gs, dd, a, ml, me, DOT: tl.constexpr):
    """Gradients through one layer's chunk-end terms ``-sum_i c_last_i d_i a_i^T`` (weights) and
    ``-sum_i m_end_i d_i a_i^T`` (momentum), given the end state's gradients ``gw``, ``gs``: those of the
    deltas, of the inputs, and of ``c_last`` and ``m_end``."""
    dgw = _mm(dd, gw, DOT)
    dgs = _mm(dd, gs, DOT)
    d_a = -ml[:, None] * dgw - me[:, None] * dgs
    d_ml = -tl.sum(dgw * a, axis=1)
    d_me = -tl.sum(dgs * a, axis=1)
    d_dd = -ml[:, None] * _mm(a, tl.trans(gw), DOT) - me[:, None] * _mm(a, tl.trans(gs), DOT)
    return d_dd, d_a, d_ml, d_me


@triton.jit
def _read_grads(dz, h, w, st, a, dd, p, hw, hs, dec, car, mix, DOT: tl.constexpr):
    """Gradients through :func:`_read` given ``dz``: of h, a, dd, the state (``dw``, ``ds``), and the
    coefficients (``ddec``, ``dcar`` per row, ``dmix``)."""
    ddec = tl.sum(dz * hw, axis=1)
    dcar = tl.sum(dz * hs, axis=1)
    dzt = tl.trans(dz)
    dw = _mm(dzt * dec[None, :], h, DOT)
    ds = _mm(dzt * car[None, :], h, DOT)
    d_dd = -_mm(tl.trans(mix * p), dz, DOT)
    dm = -_mm(dz, tl.trans(dd), DOT)
    dmix = dm * p
    dp = dm * mix
    dh = dec[:, None] * _mm(dz, w, DOT) + car[:, None] * _mm(dz, st, DOT) + _mm(dp, a, DOT)
    d_a = _mm(tl.trans(dp), h, DOT)
    return dh, d_a, d_dd, dw, ds, ddec, dcar, dmix


@triton.jit
def _store_chunk_grads(DQ, DK, DV, DDEC, DCAR, DMIX, DEEND, DMEND, dq, dk, dv, ddec, dcar, dmix, dee, dme, ddec_l,
                       dcar_l, dml, n, c, NC, Tp, C, D, last, offs_c, offs_d):
    """Chunk ``c``'s input gradients: the rows of q, k, v and those of its coefficients. The end row of B, f and
    c (row ``last``, read for the chunk-end state) also gets ``ddec_l``, ``dcar_l`` and ``dml``; ``dmix`` is kept
    lower triangular."""
    mc = offs_c < C
    lower = (offs_c[:, None] >= offs_c[None, :]) & mc[:, None] & mc[None, :]
    is_last = offs_c == last
    ddec += tl.where(is_last, ddec_l, 0.0)
    dcar += tl.where(is_last, dcar_l, 0.0)
    dmix += tl.where(is_last[:, None], dml[None, :], 0.0)
    dmix = tl.where(lower, dmix, 0.0)
    base = n * NC + c
    tl.store(DDEC + base * C + offs_c, ddec, mask=mc)
    tl.store(DCAR + base * C + offs_c, dcar, mask=mc)
    tl.store(DMIX + base * C * C + offs_c[:, None] * C + offs_c[None, :], dmix, mask=mc[:, None] & mc[None, :])
    tl.store(DEEND + base, dee)
    tl.store(DMEND + base * C + offs_c, dme, mask=mc)
    _store_rows(DQ, dq, n, c, Tp, C, D, offs_c, offs_d)
    _store_rows(DK, dk, n, c, Tp, C, D, offs_c, offs_d)
    _store_rows(DV, dv, n, c, Tp, C, D, offs_c, offs_d)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _fwd_kernel(Q, K, V, DEC, CAR, MIX, EEND, MEND, W1, S1, W2, S2,
                Y, W1o, S1o, W2o, S2o, WG1, WG2, SW1, SS1, SW2, SS2,
                NC, Tp, N_LAST, SAVE_EVERY, NSAVE, C, D, H1,
                DEPTH: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, DOT: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BC)
    offs_d = tl.arange(0, BD)
    offs_h = tl.arange(0, BH)
    sz = H1 * D
    w1 = _load_mat(W1 + n * sz, H1, D, offs_h, offs_d)  # [BH, BD]: layer 1 is [H1, D]
    s1 = _load_mat(S1 + n * sz, H1, D, offs_h, offs_d)
    w2 = _load_mat(W2 + n * sz, D, H1, offs_d, offs_h)  # [BD, BH]: layer 2 is [D, H1] (depth 2)
    s2 = _load_mat(S2 + n * sz, D, H1, offs_d, offs_h)
    for c in range(NC):
        if c % SAVE_EVERY == 0:  # the state at this chunk's start, for the backward
            j = c // SAVE_EVERY
            _store_mat(SW1 + (n * NSAVE + j) * sz, w1, H1, D, offs_h, offs_d)
            _store_mat(SS1 + (n * NSAVE + j) * sz, s1, H1, D, offs_h, offs_d)
            if DEPTH == 2:
                _store_mat(SW2 + (n * NSAVE + j) * sz, w2, D, H1, offs_d, offs_h)
                _store_mat(SS2 + (n * NSAVE + j) * sz, s2, D, H1, offs_d, offs_h)
        if c == NC - 1:  # the last chunk's start weights: the state's chunk weights when it is partial
            _store_mat(WG1 + n * sz, w1, H1, D, offs_h, offs_d)
            if DEPTH == 2:
                _store_mat(WG2 + n * sz, w2, D, H1, offs_d, offs_h)
        q, k, v = _qkv(Q, K, V, n, c, Tp, C, D, offs_c, offs_d)
        last, dec, car, mix, ee, me, ml, dec_l, car_l = _coefs(DEC, CAR, MIX, EEND, MEND, n, c, NC, C, N_LAST,
                                                              offs_c)
        if DEPTH == 2:
            a1, dsilu, curv, d1, d2 = _inner2(k, v, w1, w2, DOT)
            h, p1, qw1, qs1 = _read(q, w1, s1, k, d1, dec, car, mix, DOT)
            h = h * tl.sigmoid(h)
            y, p2, hw2, hs2 = _read(h, w2, s2, a1, d2, dec, car, mix, DOT)
            w2, s2 = _advance(w2, s2, d2, a1, ml, me, dec_l, car_l, ee, DOT)
        else:
            d1 = 2.0 * (_mm(k, tl.trans(w1), DOT) - v)
            y, p1, qw1, qs1 = _read(q, w1, s1, k, d1, dec, car, mix, DOT)
        w1, s1 = _advance(w1, s1, d1, k, ml, me, dec_l, car_l, ee, DOT)
        _store_rows(Y, y, n, c, Tp, C, D, offs_c, offs_d)
    _store_mat(W1o + n * sz, w1, H1, D, offs_h, offs_d)
    _store_mat(S1o + n * sz, s1, H1, D, offs_h, offs_d)
    if DEPTH == 2:
        _store_mat(W2o + n * sz, w2, D, H1, offs_d, offs_h)
        _store_mat(S2o + n * sz, s2, D, H1, offs_d, offs_h)


@triton.jit
def _recompute_group(SW1, SS1, SW2, SS2, R1, RS1, R2, RS2, K, V, DEC, CAR, MIX, EEND, MEND, n, grp, c0, c1, NC, Tp,
                     N_LAST, SAVE_EVERY, NSAVE, C, D, H1, offs_c, offs_d, offs_h, DEPTH: tl.constexpr,
                     DOT: tl.constexpr):
    """The chunk-start states of chunks ``c0 .. c1 - 1`` (group ``grp``, from the state the forward saved at its
    start) into the scratch ``R1, RS1, R2, RS2`` (``[N, SAVE_EVERY, ...]``); returns the state at ``c1``."""
    sz = H1 * D
    w1 = _load_mat(SW1 + (n * NSAVE + grp) * sz, H1, D, offs_h, offs_d)
    s1 = _load_mat(SS1 + (n * NSAVE + grp) * sz, H1, D, offs_h, offs_d)
    w2 = _load_mat(SW2 + (n * NSAVE + grp) * sz, D, H1, offs_d, offs_h)
    s2 = _load_mat(SS2 + (n * NSAVE + grp) * sz, D, H1, offs_d, offs_h)
    for c in range(c0, c1):
        j = c - c0
        _store_mat(R1 + (n * SAVE_EVERY + j) * sz, w1, H1, D, offs_h, offs_d)
        _store_mat(RS1 + (n * SAVE_EVERY + j) * sz, s1, H1, D, offs_h, offs_d)
        if DEPTH == 2:
            _store_mat(R2 + (n * SAVE_EVERY + j) * sz, w2, D, H1, offs_d, offs_h)
            _store_mat(RS2 + (n * SAVE_EVERY + j) * sz, s2, D, H1, offs_d, offs_h)
        k = _rows(K, n, c, Tp, C, D, offs_c, offs_d)
        v = _rows(V, n, c, Tp, C, D, offs_c, offs_d)
        last, dec, car, mix, ee, me, ml, dec_l, car_l = _coefs(DEC, CAR, MIX, EEND, MEND, n, c, NC, C, N_LAST, offs_c)
        if DEPTH == 2:
            a1, dsilu, curv, d1, d2 = _inner2(k, v, w1, w2, DOT)
            w2, s2 = _advance(w2, s2, d2, a1, ml, me, dec_l, car_l, ee, DOT)
        else:
            d1 = 2.0 * (_mm(k, tl.trans(w1), DOT) - v)
        w1, s1 = _advance(w1, s1, d1, k, ml, me, dec_l, car_l, ee, DOT)
    return w1, s1, w2, s2


@triton.jit
def _delta_grads(dd1, dd2, da1, dsilu, curv, d2, a1, k, w1, w2, dk, dw1, dw2, DEPTH: tl.constexpr,
                 DOT: tl.constexpr, PAIRED: tl.constexpr):
    """Gradients through the per-token gradients at the chunk-start weights, given those of their factors (the
    deltas ``dd1``, ``dd2`` and layer 2's inputs ``da1``; depth 1 ``d1 = 2 (W1 k - v)``, depth 2 the MLP's deltas
    with the second-order terms through ``silu''``): added to ``dk``, ``dw1``, ``dw2``, and ``dv``. Linear in
    ``(dd1, dd2, da1)``. At depth 1 the MLP's arguments are placeholders. ``PAIRED``: layer 2's two outer products
    are summed before they are added to ``dw2`` (one conversion from the products' tensor-core layout into
    ``dw2``'s, where adding each converts ``dw2`` there and back); the split backward's kernels take it (under
    Triton 3.6 at chunk 16 their spill traffic falls 3-18%), the shipped and lean forms keep the two additions
    (paired, the lean form's spills moved 56% more)."""
    if DEPTH == 2:
        de1 = dd1 * dsilu
        dz1 = dd1 * curv
        dd2 += _mm(de1, tl.trans(w2), DOT)
        dz2 = 2.0 * dd2
        dv = -dz2
        if PAIRED:
            dw2 += _mm(tl.trans(d2), de1, DOT) + _mm(tl.trans(dz2), a1, DOT)
        else:
            dw2 += _mm(tl.trans(d2), de1, DOT)
            dw2 += _mm(tl.trans(dz2), a1, DOT)
        da1 += _mm(dz2, w2, DOT)
        dz1 += da1 * dsilu
    else:
        dz1 = 2.0 * dd1
        dv = -dz1
    dw1 += _mm(tl.trans(dz1), k, DOT)
    dk += _mm(dz1, w1, DOT)
    return dk, dv, dw1, dw2


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_kernel(Q, K, V, DY, DEC, CAR, MIX, EEND, MEND, SW1, SS1, SW2, SS2, R1, RS1, R2, RS2,
                DW1o, DS1o, DW2o, DS2o, DWG1, DWG2,
                DQ, DK, DV, DDEC, DCAR, DMIX, DEEND, DMEND, DW1, DS1, DW2, DS2,
                NC, Tp, N_LAST, SAVE_EVERY, NSAVE, C, D, H1,
                DEPTH: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
                DOT: tl.constexpr, LEAN: tl.constexpr, HAS_WG: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BC)
    offs_d = tl.arange(0, BD)
    offs_h = tl.arange(0, BH)
    sz = H1 * D
    # gradients of the state at the end of the current chunk (carried backwards)
    g1 = _load_mat(DW1o + n * sz, H1, D, offs_h, offs_d)
    gs1 = _load_mat(DS1o + n * sz, H1, D, offs_h, offs_d)
    g2 = _load_mat(DW2o + n * sz, D, H1, offs_d, offs_h)
    gs2 = _load_mat(DS2o + n * sz, D, H1, offs_d, offs_h)
    if not LEAN:  # LEAN (LEAN_BACKWARD): loaded where they are added, and only if the loss reaches them
        gwg1 = _load_mat(DWG1 + n * sz, H1, D, offs_h, offs_d)
        gwg2 = _load_mat(DWG2 + n * sz, D, H1, offs_d, offs_h)
    for gi in range(NSAVE):
        grp = NSAVE - 1 - gi
        c0 = grp * SAVE_EVERY
        c1 = tl.minimum(c0 + SAVE_EVERY, NC)
        _recompute_group(SW1, SS1, SW2, SS2, R1, RS1, R2, RS2, K, V, DEC, CAR, MIX, EEND, MEND, n, grp, c0, c1, NC,
                         Tp, N_LAST, SAVE_EVERY, NSAVE, C, D, H1, offs_c, offs_d, offs_h, DEPTH, DOT)
        tl.debug_barrier()  # the scratch is written by other threads of this program
        for ci in range(c1 - c0):
            c = c1 - 1 - ci
            j = c - c0
            w1 = _load_mat(R1 + (n * SAVE_EVERY + j) * sz, H1, D, offs_h, offs_d)
            s1 = _load_mat(RS1 + (n * SAVE_EVERY + j) * sz, H1, D, offs_h, offs_d)
            w2 = _load_mat(R2 + (n * SAVE_EVERY + j) * sz, D, H1, offs_d, offs_h)
            s2 = _load_mat(RS2 + (n * SAVE_EVERY + j) * sz, D, H1, offs_d, offs_h)
            q, k, v = _qkv(Q, K, V, n, c, Tp, C, D, offs_c, offs_d)
            dy = _rows(DY, n, c, Tp, C, D, offs_c, offs_d)
            last, dec, car, mix, ee, me, ml, dec_l, car_l = _coefs(DEC, CAR, MIX, EEND, MEND, n, c, NC, C, N_LAST,
                                                              offs_c)
            # the chunk-end state: W' = B_l W + f_l S - ..., S' = E S - ...
            ddec_l = tl.sum(tl.sum(g1 * w1, axis=1), axis=0)
            dcar_l = tl.sum(tl.sum(g1 * s1, axis=1), axis=0)
            dee = tl.sum(tl.sum(gs1 * s1, axis=1), axis=0)
            if not LEAN:  # LEAN: after the carried gradients' last use
                dw1 = dec_l * g1
                ds1 = car_l * g1 + ee * gs1
            if DEPTH == 2:
                ddec_l += tl.sum(tl.sum(g2 * w2, axis=1), axis=0)
                dcar_l += tl.sum(tl.sum(g2 * s2, axis=1), axis=0)
                dee += tl.sum(tl.sum(gs2 * s2, axis=1), axis=0)
                if not LEAN:
                    dw2 = dec_l * g2
                    ds2 = car_l * g2 + ee * gs2
                # recompute the chunk
                a1, dsilu, curv, d1, d2 = _inner2(k, v, w1, w2, DOT)
                zh, p1, qw1, qs1 = _read(q, w1, s1, k, d1, dec, car, mix, DOT)
                sh = tl.sigmoid(zh)
                h = zh * sh
                _, p2, hw2, hs2 = _read(h, w2, s2, a1, d2, dec, car, mix, DOT)
                # end-state terms of both layers
                dd1, dk, dml, dme = _end_grads(g1, gs1, d1, k, ml, me, DOT)
                dd2, da1, dml2, dme2 = _end_grads(g2, gs2, d2, a1, ml, me, DOT)
                dml += dml2
                dme += dme2
                if LEAN:  # the carried gradients' last use: the chunk-start state's gradients start here
                    dw1 = dec_l * g1
                    ds1 = car_l * g1 + ee * gs1
                    dw2 = dec_l * g2
                    ds2 = car_l * g2 + ee * gs2
                # the outputs' layer 2
                dh, da, ddd, dw, ds, ddec, dcar, dmix = _read_grads(dy, h, w2, s2, a1, d2, p2, hw2, hs2, dec, car,
                                                                    mix, DOT)
                da1 += da
                dd2 += ddd
                dw2 += dw
                ds2 += ds
                dz_q = dh * (sh + h * (1.0 - sh))  # the gradient of layer 1's output pre-activations
            else:
                d1 = 2.0 * (_mm(k, tl.trans(w1), DOT) - v)
                _, p1, qw1, qs1 = _read(q, w1, s1, k, d1, dec, car, mix, DOT)
                dd1, dk, dml, dme = _end_grads(g1, gs1, d1, k, ml, me, DOT)
                if LEAN:
                    dw1 = dec_l * g1
                    ds1 = car_l * g1 + ee * gs1
                ddec = tl.zeros([BC], dtype=tl.float32)
                dcar = tl.zeros([BC], dtype=tl.float32)
                dmix = tl.zeros([BC, BC], dtype=tl.float32)
                dz_q = dy
            # the outputs' layer 1 (the queries' layer)
            dq, da, ddd, dw, ds, ddec1, dcar1, dmix1 = _read_grads(dz_q, q, w1, s1, k, d1, p1, qw1, qs1, dec, car,
                                                                   mix, DOT)
            dk += da
            dd1 += ddd
            dw1 += dw
            ds1 += ds
            ddec += ddec1
            dcar += dcar1
            dmix += dmix1
            # the per-token gradients at the chunk-start weights: d1 = 2 (W1 k - v) (depth 1), or the deltas of
            # the MLP (depth 2; with the second-order terms through silu'')
            if DEPTH == 2:
                dk, dv, dw1, dw2 = _delta_grads(dd1, dd2, da1, dsilu, curv, d2, a1, k, w1, w2, dk, dw1, dw2,
                                                DEPTH, DOT, False)
            else:
                dk, dv, dw1, _ = _delta_grads(dd1, dd1, dd1, dd1, dd1, dd1, dd1, k, w1, w1, dk, dw1, dw1,
                                              DEPTH, DOT, False)
            _store_chunk_grads(DQ, DK, DV, DDEC, DCAR, DMIX, DEEND, DMEND, dq, dk, dv, ddec, dcar, dmix, dee, dme,
                               ddec_l, dcar_l, dml, n, c, NC, Tp, C, D, last, offs_c, offs_d)
            # the chunk-start state's gradients become the previous chunk's end-state gradients
            g1 = dw1
            gs1 = ds1
            if DEPTH == 2:
                g2 = dw2
                gs2 = ds2
            # the last chunk's start weights are also an output (the state's chunk weights)
            if LEAN:  # their gradient, where the loss reaches them (a later call continues the last chunk)
                if HAS_WG:
                    if c == NC - 1:
                        g1 += _load_mat(DWG1 + n * sz, H1, D, offs_h, offs_d)
                        if DEPTH == 2:
                            g2 += _load_mat(DWG2 + n * sz, D, H1, offs_d, offs_h)
            else:
                at_last = (c == NC - 1).to(tl.float32)
                g1 += at_last * gwg1
                if DEPTH == 2:
                    g2 += at_last * gwg2
        tl.debug_barrier()  # before the next group overwrites the scratch
    _store_mat(DW1 + n * sz, g1, H1, D, offs_h, offs_d)
    _store_mat(DS1 + n * sz, gs1, H1, D, offs_h, offs_d)
    if DEPTH == 2:
        _store_mat(DW2 + n * sz, g2, D, H1, offs_d, offs_h)
        _store_mat(DS2 + n * sz, gs2, D, H1, offs_d, offs_h)


# The split backward (SPLIT_BACKWARD): the backward above runs one program per (sequence, head) through every
# chunk, and everything it computes per chunk waits for the previous chunk's carried gradients. But all of it is
# affine in those gradients: what the chunk's own outputs send back (the reads' gradients, to q, k, v, the
# coefficients and the chunk-start state) does not depend on them. So per recompute group, three launches:
# the group's chunk-start states into the scratch (one program per sequence and head), the chunks' own part (one
# program per chunk of every sequence and head, all in parallel: the reads and their gradients, the part of the
# work that needs q, dy and the [C, C] mixing products; it also stores the per-token gradients' factors), and the
# carried part (one program per sequence and head, in reverse: the end-state terms and the per-token gradients'
# chain on the factors read back, and the chunk-local state gradients added). The sequential loop then does the
# end-state terms and the chain only: 14 of the 41 matrix products per chunk of the backward above.


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["grp", "c0", "c1"])
def _bwd_recompute_kernel(K, V, DEC, CAR, MIX, EEND, MEND, SW1, SS1, SW2, SS2, R1, RS1, R2, RS2, grp, c0, c1,
                          NC, Tp, N_LAST, SAVE_EVERY, NSAVE, C, D, H1,
                          DEPTH: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
                          DOT: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    _recompute_group(SW1, SS1, SW2, SS2, R1, RS1, R2, RS2, K, V, DEC, CAR, MIX, EEND, MEND, n, grp, c0, c1, NC, Tp,
                     N_LAST, SAVE_EVERY, NSAVE, C, D, H1, tl.arange(0, BC), tl.arange(0, BD), tl.arange(0, BH),
                     DEPTH, DOT)


@triton.jit
def _chunk_program(c0, SAVE_EVERY, D, H1, BC: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr):
    """The indices of a one-program-per-chunk kernel of the split forms (grid: sequences and heads x the chunks of
    a recompute group from ``c0``): ``(n, j, c, sz, at, offs_c, offs_d, offs_h)``, ``j`` the chunk's slot in the
    group's scratch, ``at`` that slot's offset in a state tile of ``sz`` elements."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    sz = H1 * D
    return (n, j, c0 + j, sz, (n * SAVE_EVERY + j) * sz, tl.arange(0, BC), tl.arange(0, BD), tl.arange(0, BH))


# The split forward (SPLIT_FORWARD, MEMTRAIN_TITANS_FORWARD=split): per recompute group two launches. The chunks'
# recurrence alone, one program per sequence and head (the backward's recompute loop: the per-token gradients at
# each chunk's start weights and the chunk-end state, no reads), writes every chunk-start state of the group into a
# scratch and the group's end state as the next saved state; then every chunk of the group reads its outputs at
# once, one program per chunk, from its start state. The loop over chunks keeps the forward's recurrence and drops
# its reads (the q rows, the masked [C, C] products, the output rows).


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["grp", "c0", "c1"])
def _fwd_advance_kernel(K, V, DEC, CAR, MIX, EEND, MEND, SW1, SS1, SW2, SS2, R1, RS1, R2, RS2, W1o, S1o, W2o, S2o,
                        grp, c0, c1, NC, Tp, N_LAST, SAVE_EVERY, NSAVE, C, D, H1,
                        DEPTH: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
                        DOT: tl.constexpr):
    """Group ``grp``'s chunk-start states into ``R*`` from the state saved at its start (``SW*[grp]``), and the
    state at its end into ``SW*[grp + 1]``, or after the last group into ``W1o .. S2o`` (the call's end state)."""
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BC)
    offs_d = tl.arange(0, BD)
    offs_h = tl.arange(0, BH)
    w1, s1, w2, s2 = _recompute_group(SW1, SS1, SW2, SS2, R1, RS1, R2, RS2, K, V, DEC, CAR, MIX, EEND, MEND, n, grp,
                                      c0, c1, NC, Tp, N_LAST, SAVE_EVERY, NSAVE, C, D, H1, offs_c, offs_d, offs_h,
                                      DEPTH, DOT)
    sz = H1 * D
    if grp + 1 < NSAVE:
        at = (n * NSAVE + grp + 1) * sz
        _store_mat(SW1 + at, w1, H1, D, offs_h, offs_d)
        _store_mat(SS1 + at, s1, H1, D, offs_h, offs_d)
        if DEPTH == 2:
            _store_mat(SW2 + at, w2, D, H1, offs_d, offs_h)
            _store_mat(SS2 + at, s2, D, H1, offs_d, offs_h)
    else:
        _store_mat(W1o + n * sz, w1, H1, D, offs_h, offs_d)
        _store_mat(S1o + n * sz, s1, H1, D, offs_h, offs_d)
        if DEPTH == 2:
            _store_mat(W2o + n * sz, w2, D, H1, offs_d, offs_h)
            _store_mat(S2o + n * sz, s2, D, H1, offs_d, offs_h)


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["c0"])
def _fwd_read_kernel(Q, K, V, DEC, CAR, MIX, EEND, MEND, R1, RS1, R2, RS2, Y, WG1, WG2, c0, NC, Tp, N_LAST,
                     SAVE_EVERY, C, D, H1, DEPTH: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                     BH: tl.constexpr, DOT: tl.constexpr):
    """Chunk ``c0 + program_id(1)``'s outputs from its start state (read from the scratch ``R*``), as the forward
    kernel reads them; the last chunk also writes its start weights (``WG*``)."""
    n, j, c, sz, at, offs_c, offs_d, offs_h = _chunk_program(c0, SAVE_EVERY, D, H1, BC, BD, BH)
    w1 = _load_mat(R1 + at, H1, D, offs_h, offs_d)
    s1 = _load_mat(RS1 + at, H1, D, offs_h, offs_d)
    q, k, v = _qkv(Q, K, V, n, c, Tp, C, D, offs_c, offs_d)
    last, dec, car, mix, ee, me, ml, dec_l, car_l = _coefs(DEC, CAR, MIX, EEND, MEND, n, c, NC, C, N_LAST, offs_c)
    if DEPTH == 2:
        w2 = _load_mat(R2 + at, D, H1, offs_d, offs_h)
        s2 = _load_mat(RS2 + at, D, H1, offs_d, offs_h)
        a1, dsilu, curv, d1, d2 = _inner2(k, v, w1, w2, DOT)
        h, p1, qw1, qs1 = _read(q, w1, s1, k, d1, dec, car, mix, DOT)
        h = h * tl.sigmoid(h)
        y, p2, hw2, hs2 = _read(h, w2, s2, a1, d2, dec, car, mix, DOT)
    else:
        d1 = 2.0 * (_mm(k, tl.trans(w1), DOT) - v)
        y, p1, qw1, qs1 = _read(q, w1, s1, k, d1, dec, car, mix, DOT)
    _store_rows(Y, y, n, c, Tp, C, D, offs_c, offs_d)
    if c == NC - 1:  # the last chunk's start weights: the state's chunk weights when it is partial
        _store_mat(WG1 + n * sz, w1, H1, D, offs_h, offs_d)
        if DEPTH == 2:
            _store_mat(WG2 + n * sz, w2, D, H1, offs_d, offs_h)


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["c0"])
def _bwd_local_kernel(Q, K, V, DY, DEC, CAR, MIX, EEND, MEND, R1, RS1, R2, RS2, L1, LS1, L2, LS2, FAC,
                      DQ, DK, DV, DDEC, DCAR, DMIX, c0, NC, Tp, N_LAST, SAVE_EVERY, C, D, H1,
                      DEPTH: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
                      DOT: tl.constexpr):
    """Chunk ``c0 + program_id(1)``'s own part of the backward: everything its outputs' gradient ``dy`` reaches at
    its chunk-start state (read from the scratch ``R*``), as if the chunk-end state's gradients were zero. Writes
    the gradients of q (final), k, v and the coefficients (the carried part adds its own), those of the
    chunk-start state into ``L*`` (``[N, SAVE_EVERY, ...]``, as the scratch) and, at depth 2, the per-token
    gradients' factors ``a1 | silu' | curv | d1 | d2`` into ``FAC`` (``[N, SAVE_EVERY, C, 4 H1 + D]``)."""
    n, j, c, sz, at, offs_c, offs_d, offs_h = _chunk_program(c0, SAVE_EVERY, D, H1, BC, BD, BH)
    w1 = _load_mat(R1 + at, H1, D, offs_h, offs_d)
    s1 = _load_mat(RS1 + at, H1, D, offs_h, offs_d)
    q, k, v = _qkv(Q, K, V, n, c, Tp, C, D, offs_c, offs_d)
    dy = _rows(DY, n, c, Tp, C, D, offs_c, offs_d)
    last, dec, car, mix, ee, me, ml, dec_l, car_l = _coefs(DEC, CAR, MIX, EEND, MEND, n, c, NC, C, N_LAST, offs_c)
    if DEPTH == 2:
        w2 = _load_mat(R2 + at, D, H1, offs_d, offs_h)
        s2 = _load_mat(RS2 + at, D, H1, offs_d, offs_h)
        a1, dsilu, curv, d1, d2 = _inner2(k, v, w1, w2, DOT)
        zh, p1, qw1, qs1 = _read(q, w1, s1, k, d1, dec, car, mix, DOT)
        sh = tl.sigmoid(zh)
        h = zh * sh
        _, p2, hw2, hs2 = _read(h, w2, s2, a1, d2, dec, car, mix, DOT)
        dh, da1, dd2, dw2, ds2, ddec, dcar, dmix = _read_grads(dy, h, w2, s2, a1, d2, p2, hw2, hs2, dec, car, mix,
                                                               DOT)
        _store_mat(LS2 + at, ds2, D, H1, offs_d, offs_h)
        dz_q = dh * (sh + h * (1.0 - sh))
    else:
        d1 = 2.0 * (_mm(k, tl.trans(w1), DOT) - v)
        _, p1, qw1, qs1 = _read(q, w1, s1, k, d1, dec, car, mix, DOT)
        dz_q = dy
    dq, dk, dd1, dw1, ds1, ddec1, dcar1, dmix1 = _read_grads(dz_q, q, w1, s1, k, d1, p1, qw1, qs1, dec, car, mix,
                                                             DOT)
    _store_mat(LS1 + at, ds1, H1, D, offs_h, offs_d)
    if DEPTH == 2:
        ddec += ddec1
        dcar += dcar1
        dmix += dmix1
        dk, dv, dw1, dw2 = _delta_grads(dd1, dd2, da1, dsilu, curv, d2, a1, k, w1, w2, dk, dw1, dw2, DEPTH,
                                        DOT, True)
        _store_mat(L2 + at, dw2, D, H1, offs_d, offs_h)
        # the per-token gradients' factors, for the carried part (which then need not recompute them)
        fw = 4 * H1 + D
        fac = FAC + (n * SAVE_EVERY + j) * C * fw
        _store_cols(fac, a1, C, fw, 0, H1, offs_c, offs_h)
        _store_cols(fac, dsilu, C, fw, H1, H1, offs_c, offs_h)
        _store_cols(fac, curv, C, fw, 2 * H1, H1, offs_c, offs_h)
        _store_cols(fac, d1, C, fw, 3 * H1, H1, offs_c, offs_h)
        _store_cols(fac, d2, C, fw, 4 * H1, D, offs_c, offs_d)
    else:
        ddec, dcar, dmix = ddec1, dcar1, dmix1
        dk, dv, dw1, _ = _delta_grads(dd1, dd1, dd1, dd1, dd1, dd1, dd1, k, w1, w1, dk, dw1, dw1, DEPTH,
                                      DOT, True)
    _store_mat(L1 + at, dw1, H1, D, offs_h, offs_d)
    mc = offs_c < C
    lower = (offs_c[:, None] >= offs_c[None, :]) & mc[:, None] & mc[None, :]
    base = n * NC + c
    tl.store(DDEC + base * C + offs_c, ddec, mask=mc)
    tl.store(DCAR + base * C + offs_c, dcar, mask=mc)
    tl.store(DMIX + base * C * C + offs_c[:, None] * C + offs_c[None, :], tl.where(lower, dmix, 0.0),
             mask=mc[:, None] & mc[None, :])
    _store_rows(DQ, dq, n, c, Tp, C, D, offs_c, offs_d)
    _store_rows(DK, dk, n, c, Tp, C, D, offs_c, offs_d)
    _store_rows(DV, dv, n, c, Tp, C, D, offs_c, offs_d)


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["c0", "c1"])
def _bwd_carry_kernel(K, V, DEC, CAR, MIX, EEND, MEND, R1, RS1, R2, RS2, L1, LS1, L2, LS2, FAC, G1, GS1, G2, GS2,
                      DWG1, DWG2, DK, DV, DDEC, DCAR, DMIX, DEEND, DMEND, DW1, DS1, DW2, DS2, c0, c1,
                      NC, Tp, N_LAST, SAVE_EVERY, C, D, H1,
                      DEPTH: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
                      DOT: tl.constexpr, HAS_WG: tl.constexpr):
    """The carried part of the backward over chunks ``c1 - 1`` down to ``c0``: from the gradients of the group's
    end state (``G*``), per chunk the end-state terms, the chain through the per-token gradients, and the
    chunk-start state's gradients (with the chunk's own part from ``L*``), added to what
    :func:`_bwd_local_kernel` wrote. Leaves the group's start state's gradients in ``DW1 .. DS2``."""
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BC)
    offs_d = tl.arange(0, BD)
    offs_h = tl.arange(0, BH)
    sz = H1 * D
    g1 = _load_mat(G1 + n * sz, H1, D, offs_h, offs_d)
    gs1 = _load_mat(GS1 + n * sz, H1, D, offs_h, offs_d)
    g2 = _load_mat(G2 + n * sz, D, H1, offs_d, offs_h)
    gs2 = _load_mat(GS2 + n * sz, D, H1, offs_d, offs_h)
    mc = offs_c < C
    for ci in range(c1 - c0):
        c = c1 - 1 - ci
        j = c - c0
        at = (n * SAVE_EVERY + j) * sz
        w1 = _load_mat(R1 + at, H1, D, offs_h, offs_d)
        s1 = _load_mat(RS1 + at, H1, D, offs_h, offs_d)
        k = _rows(K, n, c, Tp, C, D, offs_c, offs_d)
        last, dec, car, mix, ee, me, ml, dec_l, car_l = _coefs(DEC, CAR, MIX, EEND, MEND, n, c, NC, C, N_LAST,
                                                              offs_c)
        # the chunk-end state: W' = B_l W + f_l S - ..., S' = E S - ...
        ddec_l = tl.sum(tl.sum(g1 * w1, axis=1), axis=0)
        dcar_l = tl.sum(tl.sum(g1 * s1, axis=1), axis=0)
        dee = tl.sum(tl.sum(gs1 * s1, axis=1), axis=0)
        if DEPTH == 2:
            w2 = _load_mat(R2 + at, D, H1, offs_d, offs_h)
            s2 = _load_mat(RS2 + at, D, H1, offs_d, offs_h)
            ddec_l += tl.sum(tl.sum(g2 * w2, axis=1), axis=0)
            dcar_l += tl.sum(tl.sum(g2 * s2, axis=1), axis=0)
            dee += tl.sum(tl.sum(gs2 * s2, axis=1), axis=0)
            fw = 4 * H1 + D
            fac = FAC + (n * SAVE_EVERY + j) * C * fw
            a1 = _load_cols(fac, C, fw, 0, H1, offs_c, offs_h)
            d1 = _load_cols(fac, C, fw, 3 * H1, H1, offs_c, offs_h)
            d2 = _load_cols(fac, C, fw, 4 * H1, D, offs_c, offs_d)
            dd1, dk, dml, dme = _end_grads(g1, gs1, d1, k, ml, me, DOT)
            dd2, da1, dml2, dme2 = _end_grads(g2, gs2, d2, a1, ml, me, DOT)
            dml += dml2
            dme += dme2
            dw2 = dec_l * g2 + _load_mat(L2 + at, D, H1, offs_d, offs_h)
            gs2 = car_l * g2 + ee * gs2 + _load_mat(LS2 + at, D, H1, offs_d, offs_h)
            dw1 = dec_l * g1 + _load_mat(L1 + at, H1, D, offs_h, offs_d)
            gs1 = car_l * g1 + ee * gs1 + _load_mat(LS1 + at, H1, D, offs_h, offs_d)
            dsilu = _load_cols(fac, C, fw, H1, H1, offs_c, offs_h)
            curv = _load_cols(fac, C, fw, 2 * H1, H1, offs_c, offs_h)
            dk, dv, g1, g2 = _delta_grads(dd1, dd2, da1, dsilu, curv, d2, a1, k, w1, w2, dk, dw1, dw2, DEPTH,
                                          DOT, True)
        else:
            d1 = 2.0 * (_mm(k, tl.trans(w1), DOT) - _rows(V, n, c, Tp, C, D, offs_c, offs_d))
            dd1, dk, dml, dme = _end_grads(g1, gs1, d1, k, ml, me, DOT)
            dw1 = dec_l * g1 + _load_mat(L1 + at, H1, D, offs_h, offs_d)
            gs1 = car_l * g1 + ee * gs1 + _load_mat(LS1 + at, H1, D, offs_h, offs_d)
            dk, dv, g1, _ = _delta_grads(dd1, dd1, dd1, dd1, dd1, dd1, dd1, k, w1, w1, dk, dw1, dw1, DEPTH,
                                         DOT, True)
        # added to the chunk's own part: the rows of k and v, the end row of B, f and c, and E_end, m_end
        m = mc[:, None] & (offs_d[None, :] < D)
        off = (n * Tp + c * C + offs_c[:, None]) * D + offs_d[None, :]
        tl.store(DK + off, tl.load(DK + off, mask=m, other=0.0) + dk, mask=m)
        tl.store(DV + off, tl.load(DV + off, mask=m, other=0.0) + dv, mask=m)
        base = n * NC + c
        tl.store(DDEC + base * C + last, tl.load(DDEC + base * C + last) + ddec_l)
        tl.store(DCAR + base * C + last, tl.load(DCAR + base * C + last) + dcar_l)
        row = DMIX + (base * C + last) * C + offs_c
        ml_mask = offs_c <= last
        tl.store(row, tl.load(row, mask=ml_mask, other=0.0) + dml, mask=ml_mask)
        tl.store(DEEND + base, dee)
        tl.store(DMEND + base * C + offs_c, dme, mask=mc)
        # the last chunk's start weights are also an output (the state's chunk weights)
        if HAS_WG:
            if c == NC - 1:
                g1 += _load_mat(DWG1 + n * sz, H1, D, offs_h, offs_d)
                if DEPTH == 2:
                    g2 += _load_mat(DWG2 + n * sz, D, H1, offs_d, offs_h)
    _store_mat(DW1 + n * sz, g1, H1, D, offs_h, offs_d)
    _store_mat(DS1 + n * sz, gs1, H1, D, offs_h, offs_d)
    if DEPTH == 2:
        _store_mat(DW2 + n * sz, g2, D, H1, offs_d, offs_h)
        _store_mat(DS2 + n * sz, gs2, D, H1, offs_d, offs_h)


# --------------------------------------------------------------------------------------------------
# The chunk coefficients (:func:`.reference.chunk_coefficients`) and their gradients, one program per chunk.
# With x the log gates of one chunk (zeros past its C tokens), ``seg(x)[t, s] = sum_{s<j<=t} x_j`` (s <= t) is
# a cumulative sum down the columns of ``X[j, s] = x_j [j > s]``, as the reference's ``_segsum``. The gradients
# of the sums of exponentials: a coefficient ``exp(seg(x)[t, s])`` depends on ``x_j`` for ``s < j <= t``, so a
# weight matrix ``G[t, s]`` on those terms gives ``dx_j = sum_{t >= j} sum_{s < j} G[t, s]`` (:func:`_rect`).


@triton.jit
def _seg_exp(x, offs, C):
    """``exp(seg(x))`` on ``[BC, BC]``, zero above the diagonal and outside the chunk's C tokens."""
    t, s = offs[:, None], offs[None, :]
    acc = tl.cumsum(tl.where(t > s, x[:, None], 0.0), axis=0)
    return tl.where((s <= t) & (t < C), tl.exp(acc), 0.0)


@triton.jit
def _rect(G, offs):
    """``out[j] = sum_{t >= j} sum_{s < j} G[t, s]``: the gradient of every ``x_j`` inside the segments."""
    before = tl.cumsum(G, axis=1) - G  # [t, j] = sum_{s < j} G[t, s]
    return tl.sum(tl.where(offs[:, None] >= offs[None, :], before, 0.0), axis=0)


@triton.jit
def _chunk_gates(LR, LE, LK, chunk, offs, m, C):
    """One chunk's gates (zeros past its C tokens) and what both kernels build from them: the ratio matrices
    ``keep`` (B_t / B_s) and ``eta`` (E_s / E_i), and the cumulative log eta."""
    lr = tl.load(LR + chunk * C + offs, mask=m, other=0.0)
    le = tl.load(LE + chunk * C + offs, mask=m, other=0.0)
    lk = tl.load(LK + chunk * C + offs, mask=m, other=0.0)
    return lr, le, lk, _seg_exp(lk, offs, C), _seg_exp(le, offs, C), tl.cumsum(le, axis=0)


@triton.jit
def _coef_fwd_kernel(LR, LE, LK, DEC, CAR, MIX, EEND, MEND, C, BC: tl.constexpr):
    chunk = tl.program_id(0)
    offs = tl.arange(0, BC)
    m = offs < C
    lr, le, lk, keep, eta, cum_eta = _chunk_gates(LR, LE, LK, chunk, offs, m, C)
    last = offs[:, None] == C - 1
    tl.store(DEC + chunk * C + offs, tl.exp(tl.cumsum(lk, axis=0)), mask=m)
    tl.store(CAR + chunk * C + offs, tl.sum(keep * tl.exp(cum_eta)[None, :], axis=1), mask=m)
    mix = tl.dot(keep, eta, input_precision="ieee") * lr[None, :]
    tl.store(MIX + chunk * C * C + offs[:, None] * C + offs[None, :], mix, mask=m[:, None] & m[None, :])
    tl.store(EEND + chunk, tl.exp(tl.sum(tl.where(m, le, 0.0), axis=0)))
    tl.store(MEND + chunk * C + offs, tl.sum(tl.where(last, eta, 0.0), axis=0) * lr, mask=m)


@triton.jit
def _coef_bwd_kernel(LR, LE, LK, DDEC, DCAR, DMIX, DEEND, DMEND, DLR, DLE, DLK, C, BC: tl.constexpr):
    chunk = tl.program_id(0)
    offs = tl.arange(0, BC)
    m = offs < C
    lr, le, lk, keep, eta, cum_eta = _chunk_gates(LR, LE, LK, chunk, offs, m, C)
    ddec = tl.load(DDEC + chunk * C + offs, mask=m, other=0.0)
    dcar = tl.load(DCAR + chunk * C + offs, mask=m, other=0.0)
    dmix = tl.load(DMIX + chunk * C * C + offs[:, None] * C + offs[None, :], mask=m[:, None] & m[None, :], other=0.0)
    dmend = tl.load(DMEND + chunk * C + offs, mask=m, other=0.0)
    deend = tl.load(DEEND + chunk)
    eta_last = tl.sum(tl.where(offs[:, None] == C - 1, eta, 0.0), axis=0)  # E_end / E_i
    # theta: mix = (keep @ eta) * theta, m_end = eta[last] * theta
    dlr = tl.sum(dmix * tl.dot(keep, eta, input_precision="ieee"), axis=0) + dmend * eta_last
    d = dmix * lr[None, :]  # [t, i]
    g_carry = dcar[:, None] * keep * tl.exp(cum_eta)[None, :]  # carry_t = sum_s keep[t, s] exp(cum_eta_s)
    g_mix = keep * tl.dot(d, tl.trans(eta), input_precision="ieee")  # [t, s]
    h_mix = eta * tl.dot(tl.trans(keep), d, input_precision="ieee")  # [s, i]
    decay = tl.exp(tl.cumsum(lk, axis=0))
    w = ddec * decay
    dlk = tl.cumsum(w, axis=0, reverse=True) + _rect(g_carry + g_mix, offs)  # decay_t: for t >= j
    e_end = tl.exp(tl.sum(tl.where(m, le, 0.0), axis=0))
    col = tl.sum(g_carry, axis=0)  # exp(cum_eta_s) depends on le_j, j <= s
    wm = dmend * eta_last * lr
    dle = (deend * e_end + tl.cumsum(col, axis=0, reverse=True) + (tl.cumsum(wm, axis=0) - wm)
           + _rect(h_mix, offs))
    tl.store(DLR + chunk * C + offs, dlr, mask=m)
    tl.store(DLE + chunk * C + offs, dle, mask=m)
    tl.store(DLK + chunk * C + offs, dlk, mask=m)


def _empty(*shape, device, dtype=torch.float32) -> torch.Tensor:
    """Every buffer the kernels write (the tests replace this with a NaN fill: unwritten elements show)."""
    return torch.empty(*shape, device=device, dtype=dtype)


_DOT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the dot products' operand precision


# The backward restarts from the states the forward saved at every R-th chunk start and recomputes R of them at
# a time into a scratch. The saved states live from the call's forward until its backward, alongside those of
# every other call of the step (MAC: each block's every segment), the scratch only during one call's backward.
# So R is as large as a scratch of SCRATCH_BYTES allows, at least sqrt(n_chunks) (the spacing that minimises the
# two for a call alone): every chunk is recomputed once either way. titans-170m-mac's 32-chunk segments keep one
# state each (their first) instead of six: 2.8 of its 25.1 GiB of activations at micro-batch 4 x 4096 (traced,
# memtrain.parallel.activation_trace), for a 192 MiB scratch during one call's backward.
SCRATCH_BYTES = 256 * 2**20


def _checkpoints(NC: int, state_bytes: int) -> tuple[int, int]:
    """``(R, nsave)``: the forward saves the state at the start of every ``R``-th of ``NC`` chunks, ``nsave`` of
    them; ``state_bytes``: one chunk-start state of every program (the scratch holds ``R`` of them)."""
    R = min(NC, max(math.ceil(math.sqrt(NC)), SCRATCH_BYTES // max(state_bytes, 1)))
    return max(R, 1), -(-NC // max(R, 1))


def _state_bytes(N: int, w1_shape, w2_shape, depth: int) -> int:
    """Bytes of one chunk-start state (weights and momentum, fp32) of all ``N`` programs of the depth-1/2 scan."""
    per_layer = [w1_shape[-2] * w1_shape[-1]] + ([w2_shape[-2] * w2_shape[-1]] if depth == 2 else [])
    return 8 * N * sum(per_layer)


# The depth-1/2 backward has two compiled forms of one computation. The shipped one forms the chunk-start state's
# gradients as soon as the chunk-end state's are loaded and adds the last chunk's start weights' gradient (zeros
# where the loss does not reach it, as in every recipe's call) in every chunk. The lean one (LEAN_BACKWARD) forms
# them after the carried gradients' last use and, where the loss does not reach those weights, is compiled
# without them: two state tiles fewer through its loops. Compiled for sm_90 by Triton 3.6 (the GPU machines'),
# the lean one's spills move a quarter less local memory per chunk at chunk 16 (2,982 against 3,952 KiB per
# program) and 1% less at chunk 64; by Triton 3.8 a half more at chunk 16 (docs/titans-kernels.md, "Per chunk").
# ptxas allocates as it likes, so that was a measurement to make on a GPU: on an H200 (2026-11-27) the lean form took
# 28% (MAC's shape) and 12% (MAG's) less time per chunk than the shipped one at chunk 16 and 13% more at chunk 64,
# and the split form (below) less than either everywhere. An option, off.
LEAN_BACKWARD = False

# The split backward (:func:`_bwd_local_kernel`, above): per recompute group three launches, the chunks' own part
# in parallel (one program per chunk) and only the carried part in the loop over chunks, instead of one program
# per sequence and head doing all of it in sequence. Its scratch is 2.3 times the other forms' at the recipes'
# widths and chunk 16 (3.1 at chunk 64): beside the recomputed states, the chunk-local state gradients and the
# per-token gradients' factors. The default since it was timed on an H200 (2026-11-27, benchmarks/titans_kernels.py
# at the recipes' shapes, bf16): 29% (MAC's shape), 27% (MAG's) and 28% (the layer target's) less time per chunk
# than the shipped backward, the lean one 28%, 12% and -13%; titans-400m-mag with the split forward and backward
# 25,030 tokens/s against 22,562, at the same peak memory (docs/titans-kernels.md, "Measured: the forms and
# waves"). Takes precedence over LEAN_BACKWARD.
SPLIT_BACKWARD = True


# The split forward (:func:`_fwd_advance_kernel`, :func:`_fwd_read_kernel`): per recompute group the recurrence in
# one program per sequence and head and the reads in one program per chunk, in place of one program per sequence
# and head doing both. Its scratch (the group's chunk-start states) lives during one call's forward: the backward's
# recompute scratch, at most SCRATCH_BYTES. On the H200 (2026-11-27, benchmarks/titans_kernels.py) it took 12%
# (MAC's shape) and 56% (MAG's) more time per chunk than the shipped forward at the recipes' chunk 16, and 19% less
# at the layer target's chunk 64 (28.9 against 35.7 us). It writes every chunk-start state (128 KiB per program at
# the recipes' widths) to its scratch and reads it back, traffic that per token falls as 1 / chunk, while the
# shipped loop's reads grow with the chunk. So by default it runs for chunks of SPLIT_FORWARD_MIN_CHUNK tokens and
# more, the shipped forward below (chunk 32 was not timed: shipped). SPLIT_FORWARD True / False: the split / the
# shipped forward at every chunk size; None: by chunk size.
SPLIT_FORWARD: Optional[bool] = None
SPLIT_FORWARD_MIN_CHUNK = 64


def forward_form(chunk: int) -> str:
    """The depth-1/2 forward's form for chunks of ``chunk`` tokens: what :data:`memtrain.kernels.titans.FORWARD_ENV`
    asks for where it is set, else :data:`SPLIT_FORWARD` where it is True or False, else ``split`` from
    :data:`SPLIT_FORWARD_MIN_CHUNK` tokens per chunk on and ``shipped`` below."""
    split = chunk >= SPLIT_FORWARD_MIN_CHUNK if SPLIT_FORWARD is None else SPLIT_FORWARD
    return requested_forward() or ("split" if split else "shipped")


def backward_form() -> str:
    """The depth-1/2 backward's form: what :data:`memtrain.kernels.titans.BACKWARD_ENV` asks for where it is set,
    else :data:`SPLIT_BACKWARD` / :data:`LEAN_BACKWARD`."""
    return requested_backward() or ("split" if SPLIT_BACKWARD else "lean" if LEAN_BACKWARD else "shipped")


def _waves(N: int) -> list[slice]:
    """The sequences and heads each launch of a one-program-per-sequence kernel covers: all ``N`` in one, or
    :func:`memtrain.kernels.titans.requested_wave` at a time (``MEMTRAIN_TITANS_WAVE``; a multiple of 8)."""
    wave = requested_wave()
    if wave <= 0 or wave >= N:
        return [slice(0, N)]
    return [slice(n0, min(n0 + wave, N)) for n0 in range(0, N, wave)]


def _launch_per_sequence(kernel, N: int, *args, **launch) -> None:
    """``kernel[(N,)](*args, **launch)``, one program per sequence and head, in the waves of :func:`_waves`. Every
    tensor argument is indexed by the program (its first dimension ``N``), so a wave passes the slice of each that
    its programs own: views at an offset of a multiple of 8 rows, as aligned as the whole, so every wave runs the same
    compiled binary and the result is the one launch's, bit for bit."""
    waves = _waves(N)
    if len(waves) == 1:
        kernel[(N,)](*args, **launch)
        return
    for a in args:
        if isinstance(a, torch.Tensor) and (a.dim() == 0 or a.shape[0] != N):
            raise ValueError(f"a tensor argument of shape {tuple(a.shape)} is not indexed by the {N} programs")
    for w in waves:
        kernel[(w.stop - w.start,)](*(a[w] if isinstance(a, torch.Tensor) else a for a in args), **launch)


def _launch_shape(D: int, H1: int, C: int) -> dict:
    """Block sizes and launch options. ``num_stages=1``: the loads inside the chunk loops are not software-
    pipelined; with the default (3) the pipeliner double-buffers the state tiles the backward reloads per chunk
    and the backward needs 337 KB (chunk 16) / 438 KB (chunk 64) of shared memory at head size 64, hidden 128,
    above an H100's 227 KB; with 1 it needs 61 KB / 139 KB (the forward 65 KB at chunk 64), measured by compiling
    for sm_90a ahead of time (``triton.compile`` with a ``GPUTarget``, no GPU needed). The split kernels' loops are
    pipelined where ``MEMTRAIN_TITANS_STAGES`` asks for it and they fit (:func:`loop_stages`)."""
    BC, BD, BH = _block(C), _block(D), _block(H1)
    return dict(BC=BC, BD=BD, BH=BH, num_warps=8 if BH * BD >= 128 * 64 else 4, num_stages=1)


# The split kernels' loops over chunks that MEMTRAIN_TITANS_STAGES pipelines (memtrain.kernels.titans.STAGES_ENV), and
# where. Compiled for sm_90 by Triton 3.6 at head size 64, hidden 128, bf16, 8 warps (docs/titans-kernels.md,
# "Pipelined loops"), the carried loop's shared memory is 38 KiB unpipelined, 134 KiB in 2 stages and 232 KiB in 3 at
# chunk 16, 172 KiB in 2 at chunk 32 and 249 KiB at chunk 64: 2 stages fit an A100's 163 KiB at chunk 16 only. The
# recompute loop and the forward's recurrence need at most 66 KiB in 3 stages at chunk 64. Larger tiles than the
# recipes' (head size x hidden width) were not compiled pipelined, and stay unpipelined.
PIPELINED_KERNELS = ("fwd_advance", "bwd_recompute", "bwd_carry")
PIPELINE_MAX_TILE = 64 * 128
CARRY_PIPELINE_MAX_CHUNK = 16


def loop_stages(kernel: str, D: int, H1: int, C: int, stages: Optional[int] = None) -> int:
    """``num_stages`` of ``kernel`` (a name of :data:`memtrain.kernels.titans.aot.KERNELS`) at head size ``D``, hidden
    width ``H1`` (depth 1: ``D``) and chunk ``C`` when ``stages`` (default: what ``MEMTRAIN_TITANS_STAGES`` asks for,
    :func:`memtrain.kernels.titans.requested_stages`) are asked for: those stages for the split loops of
    :data:`PIPELINED_KERNELS` where their shared memory fits (at most 2 for the carried loop, at chunks of up to
    :data:`CARRY_PIPELINE_MAX_CHUNK`; tiles up to :data:`PIPELINE_MAX_TILE`), else 1."""
    stages = requested_stages() if stages is None else stages
    if stages <= 1 or kernel not in PIPELINED_KERNELS or _block(D) * _block(H1) > PIPELINE_MAX_TILE:
        return 1
    if kernel == "bwd_carry":
        return min(stages, 2) if _block(C) <= CARRY_PIPELINE_MAX_CHUNK else 1
    return stages


def _staged(launch: dict, kernel: str, D: int, H1: int, C: int) -> dict:
    """``launch`` with ``kernel``'s :func:`loop_stages`."""
    return {**launch, "num_stages": loop_stages(kernel, D, H1, C)}


# The autograd of the kernels is four custom operators (torch.library): the coefficients' forward and backward,
# the scan's forward and backward. Dynamo and AOTAutograd trace a custom operator as one opaque node (its
# ``register_fake`` gives the shapes), so compiled Titans blocks keep the scan inside their graph instead of
# breaking it per call (TitansLM.compile_blocks); eagerly each call skips the dispatcher through an autograd.Function
# made of the same implementation, set-up and backward (memtrain.kernels.op).


def _coef_shapes(lr: torch.Tensor):
    N, NC, C = lr.shape
    return (N, NC, C), (N, NC, C), (N, NC, C, C), (N, NC), (N, NC, C)


def _coef_launch(C: int) -> dict:
    """The coefficients' kernels' block size and warps: 4 warps up to chunk 32, 16 from chunk 64 on. Compiled
    for sm_90 (:mod:`.aot`), the backward at chunk 64 under 4 warps got 32 registers and 24.9 KB of spill stores
    per thread (8 warps: 10.3 KB), under 16 warps 1.0 KB; the forward 720 B under 4, 8 B under 16; at chunk 16
    and 32 neither spills under 4."""
    BC = _block(C)
    return dict(BC=BC, num_warps=4 if BC <= 32 else 16)


@kernel_op("memtrain::titans_coef_fwd")
def _coef_fwd(lr: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    N, NC, C = lr.shape
    dec, car, mix, e_end, mend = (_empty(*shape, device=lr.device) for shape in _coef_shapes(lr))
    _coef_fwd_kernel[(N * NC,)](*_dense(lr, log_eta, log_keep), dec, car, mix, e_end, mend, C, **_coef_launch(C))
    return dec, car, mix, e_end, mend


@_coef_fwd.register_fake
def _(lr, log_eta, log_keep):
    return tuple(lr.new_empty(shape, dtype=torch.float32) for shape in _coef_shapes(lr))


@kernel_op("memtrain::titans_coef_bwd")
def _coef_bwd(lr: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor, ddec: torch.Tensor,
              dcar: torch.Tensor, dmix: torch.Tensor, dee: torch.Tensor, dme: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    N, NC, C = lr.shape
    dlr, dle, dlk = (_empty(N, NC, C, device=lr.device) for _ in range(3))
    grads = (g.float().contiguous() for g in (ddec, dcar, dmix, dee, dme))
    _coef_bwd_kernel[(N * NC,)](*_dense(lr, log_eta, log_keep), *grads, dlr, dle, dlk, C, **_coef_launch(C))
    return dlr, dle, dlk


@_coef_bwd.register_fake
def _(lr, log_eta, log_keep, ddec, dcar, dmix, dee, dme):
    return tuple(lr.new_empty(lr.shape, dtype=torch.float32) for _ in range(3))


def _dense(*xs: torch.Tensor) -> list[torch.Tensor]:
    """The kernels index their tensor arguments as dense row-major arrays: a compiled graph may hand a custom
    operator other strides (a no-op when they already are)."""
    return [x.contiguous() for x in xs]


@functools.lru_cache(maxsize=16)
def _shared_zeros(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A float32 zero tensor, allocated once per shape and device and handed to every backward that lacks that
    gradient: the backward operators only read their gradient arguments (the any-depth one clones its end-state
    gradients before its kernel updates them), so it stays zero."""
    return torch.zeros(shape, device=device)


def _grads_or_zeros(grads, shapes, device) -> list[torch.Tensor]:
    """The gradients of a custom operator's outputs (``None`` for an output the loss does not reach, as
    ``set_materialize_grads(False)`` leaves them), zeros of ``shapes`` where missing: the kernels read every
    one. Eagerly the zeros are shared (:func:`_shared_zeros`: no memset per call; eager MAC lacks the chunk-start
    weights' gradients in every call, 240 zero-fills per ``titans-170m-mac`` sequence); while a graph is traced
    (AOTAutograd's backward) they are fresh, as a traced graph holds no real tensors."""
    tracing = torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None
    zeros = (lambda shape: torch.zeros(shape, device=device)) if tracing else (
        lambda shape: _shared_zeros(tuple(shape), torch.device(device)))
    return [zeros(shape) if g is None else g for g, shape in zip(grads, shapes)]


def _coef_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.set_materialize_grads(False)


def _coef_backward(ctx, *grads):
    lr, log_eta, log_keep = ctx.saved_tensors
    return _coef_bwd(lr, log_eta, log_keep, *_grads_or_zeros(grads, _coef_shapes(lr), lr.device))


_coef_fwd.register_autograd(_coef_backward, setup_context=_coef_setup)


def triton_chunk_coefficients(lr: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor):
    """:func:`.reference.chunk_coefficients` (and its gradients) of ``[N, NC, C]`` float32 gates (theta, log eta,
    log(1 - alpha)) by the kernels above, one launch each way, where the PyTorch form issues 23 ops forward and
    about 40 backward per call. Outputs as the reference's: decay, carry ``[N, NC, C]``, mix ``[N, NC, C, C]``,
    momentum decay ``[N, NC]`` and mix ``[N, NC, C]`` at the chunk's end."""
    return _coef_fwd(lr, log_eta, log_keep)


# The depth-1/2 scan. Inputs: q, k, v ``[N, Tp, D]`` (``Tp`` a multiple of ``C``, padded), the coefficients of
# :func:`triton_chunk_coefficients` on ``[N, Tp / C, C]`` gates, the state (layer 1's and layer 2's weights and
# momentum; depth 1 passes layer 1's twice), ``T`` (real tokens), ``C`` and ``depth``. Outputs: ``y``
# ``[N, Tp, D]`` (float32), each layer's end weights and momentum, the last chunk's start weights, and the
# states the backward restarts from (every ``R``-th chunk's start, :func:`_checkpoints`; not differentiable).
# At depth 1 layer 2's outputs are empty (``[N, 0, 0]``) and the kernels, which touch layer 2 only to read it
# at depth 1, get layer 1's tensors in its place.

def _scan_shapes(q, w1, w2, C: int, depth: int) -> list[tuple[int, ...]]:
    """The forward's outputs' shapes: ``y``, ``w1, s1, w2, s2, wg1, wg2`` at the end, the saved ``w1, s1, w2,
    s2``."""
    N, Tp, D = q.shape
    nsave = _checkpoints(Tp // C, _state_bytes(N, w1.shape, w2.shape, depth))[1]
    l1, l2 = tuple(w1.shape[1:]), (tuple(w2.shape[1:]) if depth == 2 else (0, 0))
    return [(N, Tp, D), *((N, *l) for l in (l1, l1, l2, l2, l1, l2)), *((N, nsave, *l) for l in (l1, l1, l2, l2))]


@kernel_op("memtrain::titans_scan_fwd")
def _scan_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dec: torch.Tensor, car: torch.Tensor,
              mix: torch.Tensor, e_end: torch.Tensor, m_end: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
              w2: torch.Tensor, s2: torch.Tensor, T: int, C: int, depth: int, split: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``split``: the split forward (:data:`SPLIT_FORWARD`), the same outputs."""
    N, Tp, D = q.shape
    NC = Tp // C
    H1 = w1.shape[1]
    R, nsave = _checkpoints(NC, _state_bytes(N, w1.shape, w2.shape, depth))
    q, k, v, dec, car, mix, e_end, m_end, w1, s1, w2, s2 = _dense(q, k, v, dec, car, mix, e_end, m_end, w1, s1, w2, s2)
    outs = [_empty(*shape, device=q.device) for shape in _scan_shapes(q, w1, w2, C, depth)]
    y, w1o, s1o, w2o, s2o, wg1, wg2, sw1, ss1, sw2, ss2 = outs
    if depth == 1:
        w2, s2, w2o, s2o, wg2, sw2, ss2 = w1, s1, w1o, s1o, wg1, sw1, ss1
    coef = (dec, car, mix, e_end, m_end)
    ints = (NC, Tp, T - (NC - 1) * C, R)
    launch = dict(DEPTH=depth, DOT=_DOT[q.dtype], **_launch_shape(D, H1, C))
    if split:  # per group: the recurrence (its chunk-start states, the next saved state), then every chunk's reads
        saved = (sw1, ss1, sw2, ss2)
        for t, x in zip(saved[:2 * depth], (w1, s1, w2, s2)):  # depth 1: layer 2's slots are layer 1's
            t[:, 0].copy_(x)  # the first group starts from the initial state
        scratch = [_empty(N, R, *t.shape[2:], device=q.device) for t in saved]
        if depth == 1:
            scratch[2:] = scratch[:2]
        for grp in range(nsave):
            c0, c1 = grp * R, min(grp * R + R, NC)
            _fwd_advance_kernel[(N,)](k, v, *coef, *saved, *scratch, w1o, s1o, w2o, s2o, grp, c0, c1, *ints, nsave,
                                      C, D, H1, **_staged(launch, "fwd_advance", D, H1, C))
            _fwd_read_kernel[(N, c1 - c0)](q, k, v, *coef, *scratch, y, wg1, wg2, c0, *ints, C, D, H1, **launch)
    else:
        _launch_per_sequence(_fwd_kernel, N, q, k, v, *coef, w1, s1, w2, s2, y, w1o, s1o, w2o, s2o, wg1, wg2, sw1,
                             ss1, sw2, ss2, *ints, nsave, C, D, H1, **launch)
    return tuple(outs)


@_scan_fwd.register_fake
def _(q, k, v, dec, car, mix, e_end, m_end, w1, s1, w2, s2, T, C, depth, split):
    return tuple(q.new_empty(shape, dtype=torch.float32) for shape in _scan_shapes(q, w1, w2, C, depth))


@kernel_op("memtrain::titans_scan_bwd")
def _scan_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dy: torch.Tensor, dec: torch.Tensor,
              car: torch.Tensor, mix: torch.Tensor, e_end: torch.Tensor, m_end: torch.Tensor, sw1: torch.Tensor,
              ss1: torch.Tensor, sw2: torch.Tensor, ss2: torch.Tensor, gw1: torch.Tensor, gs1: torch.Tensor,
              gw2: torch.Tensor, gs2: torch.Tensor, gwg1: Optional[torch.Tensor], gwg2: Optional[torch.Tensor], T: int,
              C: int, depth: int, lean: bool, split: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v, the coefficients and the initial state (layer 2's empty at depth 1) from those
    of ``y``, the end state and the last chunk's start weights (layer 1's in layer 2's slots at depth 1; ``None``
    where the loss does not reach them, which only the ``lean`` and ``split`` forms take: :data:`LEAN_BACKWARD`,
    :data:`SPLIT_BACKWARD`)."""
    N, Tp, D = q.shape
    NC = Tp // C
    R, nsave = _checkpoints(NC, _state_bytes(N, sw1.shape, sw2.shape, depth))
    H1 = sw1.shape[-2]
    q, k, v, dec, car, mix, e_end, m_end, sw1, ss1, sw2, ss2 = _dense(q, k, v, dec, car, mix, e_end, m_end, sw1, ss1,
                                                                     sw2, ss2)
    if depth == 1:
        sw2, ss2 = sw1, ss1
    scratch = [_empty(N, R, *t.shape[2:], device=q.device) for t in (sw1, ss1, sw2, ss2)]
    dq, dk, dv = (_empty(N, Tp, D, device=q.device) for _ in range(3))
    dcoef = [_empty(*t.shape, device=q.device) for t in (dec, car, mix, e_end, m_end)]
    dstate = [_empty(*t.shape, device=q.device) for t in (gw1, gs1, gw2, gs2)]
    kernel_dstate = dstate if depth == 2 else dstate[:2] * 2
    if depth == 1:
        dstate[2:] = [q.new_empty(N, 0, 0, dtype=torch.float32) for _ in range(2)]
    has_wg = gwg1 is not None
    if not has_wg:  # never read (the lean and split kernels without them): any float32 pointer will do
        gwg1 = gwg2 = gw1
    grads = [g.contiguous().float() for g in (gw1, gs1, gw2, gs2, gwg1, gwg2)]
    dy = dy.contiguous().float()
    launch = dict(DEPTH=depth, DOT=_DOT[q.dtype], **_launch_shape(D, H1, C))
    ints = (NC, Tp, T - (NC - 1) * C, R)
    if split:  # per group, last first: its states, the chunks' own part, the carried part
        local = [_empty(N, R, *t.shape[2:], device=q.device) for t in (sw1, ss1, sw2, ss2)]
        # the per-token gradients' factors at depth 2 (a1, silu', curv, d1: [C, H1] each; d2: [C, D])
        fac = _empty(N, R, C, 4 * H1 + D, device=q.device) if depth == 2 else local[0]
        if depth == 1:
            scratch[2:], local[2:] = scratch[:2], local[:2]
        for grp in reversed(range(nsave)):
            c0, c1 = grp * R, min(grp * R + R, NC)
            _bwd_recompute_kernel[(N,)](k, v, dec, car, mix, e_end, m_end, sw1, ss1, sw2, ss2, *scratch, grp, c0, c1,
                                        *ints, nsave, C, D, H1, **_staged(launch, "bwd_recompute", D, H1, C))
            _bwd_local_kernel[(N, c1 - c0)](q, k, v, dy, dec, car, mix, e_end, m_end, *scratch, *local, fac, dq, dk,
                                            dv, *dcoef[:3], c0, *ints, C, D, H1, **launch)
            carried = grads[:4] if grp == nsave - 1 else kernel_dstate
            _bwd_carry_kernel[(N,)](k, v, dec, car, mix, e_end, m_end, *scratch, *local, fac, *carried, *grads[4:],
                                    dk, dv, *dcoef, *kernel_dstate, c0, c1, *ints, C, D, H1, HAS_WG=has_wg,
                                    **_staged(launch, "bwd_carry", D, H1, C))
    else:
        _launch_per_sequence(_bwd_kernel, N, q, k, v, dy, dec, car, mix, e_end, m_end, sw1, ss1, sw2, ss2, *scratch,
                             *grads, dq, dk, dv, *dcoef, *kernel_dstate, *ints, nsave, C, D, H1, LEAN=lean,
                             HAS_WG=has_wg, **launch)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *dcoef, *dstate


@_scan_bwd.register_fake
def _(q, k, v, dy, dec, car, mix, e_end, m_end, sw1, ss1, sw2, ss2, gw1, gs1, gw2, gs2, gwg1, gwg2, T, C, depth,
      lean, split):
    l2 = (gw2, gs2) if depth == 2 else [q.new_empty(q.shape[0], 0, 0)] * 2
    return (*(x.new_empty(x.shape) for x in (q, k, v)),
            *(q.new_empty(t.shape, dtype=torch.float32) for t in (dec, car, mix, e_end, m_end, gw1, gs1, *l2)))


def _restart_setup(first_saved: int, first_int: int):
    """A scan forward's autograd set-up: q, k, v and the five coefficients saved with the restart states (the
    outputs from ``first_saved`` on, not differentiable), the integer arguments (from ``first_int``) kept."""
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:8], *output[first_saved:])
        ctx.mark_non_differentiable(*output[first_saved:])
        ctx.set_materialize_grads(False)
        ctx.meta = inputs[first_int:]
    return setup


_scan_setup = _restart_setup(7, 12)


def _scan_backward(ctx, dy, gw1, gs1, gw2, gs2, gwg1, gwg2, *_):
    q, k, v, dec, car, mix, e_end, m_end, sw1, ss1, sw2, ss2 = ctx.saved_tensors
    T, C, depth, _ = ctx.meta
    N = q.shape[0]
    l1 = (N, *sw1.shape[2:])
    l2 = (N, *sw2.shape[2:]) if depth == 2 else l1
    if depth == 1:  # layer 2's slots repeat layer 1's
        gw2, gs2, gwg2 = gw1, gs1, gwg1
    form = backward_form()
    split, lean = form == "split", form == "lean"
    dy, gw1, gs1, gw2, gs2 = _grads_or_zeros((dy, gw1, gs1, gw2, gs2), (q.shape, l1, l1, l2, l2), q.device)
    if not (lean or split) or (gwg1 is None) != (gwg2 is None):  # those two take None for both, nothing else does
        gwg1, gwg2 = _grads_or_zeros((gwg1, gwg2), (l1, l2), q.device)
    dq, dk, dv, *dcoef, dw1, ds1, dw2, ds2 = _scan_bwd(q, k, v, dy, dec, car, mix, e_end, m_end, sw1, ss1, sw2, ss2,
                                                       gw1, gs1, gw2, gs2, gwg1, gwg2, T, C, depth, lean, split)
    if depth == 1:  # w2, s2 were w1, s1 again
        dw2 = ds2 = None
    return dq, dk, dv, *dcoef, dw1, ds1, dw2, ds2, None, None, None, None


_scan_fwd.register_autograd(_scan_backward, setup_context=_scan_setup)


def _scan(q, k, v, coef, T: int, C: int, w, s):
    """The depth-1/2 scan on padded inputs (:func:`chunk_scan`): ``(y, w_end, s_end, wg)``."""
    depth = len(w)
    w1, w2 = w[0], w[-1]
    s1, s2 = s[0], s[-1]
    y, w1o, s1o, w2o, s2o, wg1, wg2, *_ = _scan_fwd(q, k, v, *coef, w1, s1, w2, s2, T, C, depth,
                                                    forward_form(C) == "split")
    if depth == 2:
        return y, [w1o, w2o], [s1o, s2o], [wg1, wg2]
    return y, [w1o], [s1o], [wg1]


def _pad(x: torch.Tensor, pad: tuple[int, ...]) -> torch.Tensor:
    """``F.pad`` that is no op (and no copy, forward or backward) when nothing is padded: a call that ends on a
    chunk boundary, as every MAC segment and MAG / MAL sequence of the recipes does."""
    return F.pad(x, pad) if any(pad) else x


def chunk_scan(q, k, v, lr, log_eta, log_keep, w, s, chunk_size: int, scan_fn=None):
    """The inner loop over ``q``, ``k``, ``v`` ``[N, T, D]`` starting at a chunk boundary, with gates ``[N, T]``
    and the state ``w``, ``s`` (lists of ``[N, d_out, d_in]``, depth 1 or 2); returns ``(y, w, s, wg)`` like
    :func:`.reference.scan` (``y`` and the state in float32; ``wg``: the weights at the last chunk's start).
    ``scan_fn(q, k, v, coef, T, C, w, s)``: the scan on the padded inputs and chunk coefficients (:func:`_scan`;
    :mod:`.triton_deep` passes its own)."""
    N, T, D = q.shape
    C = chunk_size
    NC = -(-T // C)
    pad = NC * C - T
    gates = [_pad(g.float(), (0, pad)).reshape(N, NC, C) for g in (lr, log_eta, log_keep)]
    coef = [c.contiguous() for c in triton_chunk_coefficients(*gates)]
    dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    q, k, v = (_pad(x.to(dt), (0, 0, 0, pad)).contiguous() for x in (q, k, v))
    w, s = [x.float().contiguous() for x in w], [x.float().contiguous() for x in s]
    y, w_end, s_end, wg = (scan_fn or _scan)(q, k, v, coef, T, C, w, s)
    return y[:, :T], w_end, s_end, wg


__all__ = ["chunk_scan", "triton_chunk_coefficients"]
