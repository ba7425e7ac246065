"""The Titans inner loop in Triton for a memory MLP of any depth L (Titans, Sections 3.1-3.2 and 5.5, which
varies L_M from 1 to 4): the chunk-parallel update and retrieval, forward and backward, with the loop over
chunks inside the kernels. :mod:`.triton_kernels` holds the depth-1/2 kernels (every layer's weights and
momentum kept in registers) and the per-layer building blocks used here; :mod:`.reference` is the
specification.

The math per chunk is that of :mod:`.triton_kernels` with the two-layer MLP replaced by L layers
(``a_0 = k``, ``z_l = a_l W_l^T``, ``a_{l+1} = silu(z_l)``, ``M(k) = z_{L-1}``; the per-token gradients in
factored form ``delta_{L-1} = 2 (z_{L-1} - v)``, ``e_l = delta_{l+1} W_{l+1}``,
``delta_l = e_l * silu'(z_l)``). What differs is where the state lives: L layers do not fit in registers, so
each program keeps its weights and momentum as ``[L, BW, BW]`` float32 tiles in global memory (every layer
padded with zeros to one ``BW x BW`` tile, ``BW`` the larger of head size and hidden width rounded up to a
power of two; zeros stay zeros through every product, silu(0) = 0) and the per-layer activations of the
chunk (``a_l``, ``z_l``, ``e_l``, ``delta_l``, the read's ``h_l`` and pre-activations, and their gradients) in a
per-program scratch of ``[BC, BW]`` tiles. Loops over layers are loops in the kernel; a layer's tiles are
loaded when it is processed. Threads of a program exchange tiles through that scratch, so every phase that
reads what another phase wrote starts with a barrier (``tl.debug_barrier``), and so does every overwrite of
a tile other threads may still read. The working set stays on chip for the recipes' shapes (L2: a few MB per
program).

Backward: the chunk-start states are saved every ``R = ceil(sqrt(n_chunks))`` chunks in the forward and the
backward recomputes a group's states into a scratch (as :mod:`.triton_kernels`). Per chunk in reverse it
recomputes the inner gradients and the read, then differentiates (i) the chunk-end terms, (ii) the read layer
by layer from the top, (iii) the per-token gradients: the delta recurrence upwards (with the second-order
term ``silu''``), then the key activations downwards. The gradients of the state at the chunk's start replace
those of its end in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from memtrain.kernels.op import kernel_op
from memtrain.kernels.titans import triton_kernels as tk
from memtrain.kernels.titans.triton_kernels import (_DOT, _RUNTIME_INTS, _advance, _block, _checkpoints, _coefs,
                                                    _end_grads, _mm, _qkv, _read, _read_grads, _rows,
                                                    _store_chunk_grads, _store_rows)

# The activation scratch: one [BC, BW] tile per (buffer, layer). Per chunk: the keys' layer inputs a_l,
# pre-activations z_l, e_l and deltas delta_l; the read's inputs h_l and pre-activations; the gradients of
# delta_l, a_l, and z_l's silu'' term.
_A, _Z, _E, _DL, _H, _ZQ, _GD, _GA, _GZ = (tl.constexpr(i) for i in range(9))
NBUF = tl.constexpr(9)


@triton.jit
def _ld(ptr, offs_r, offs_c, NCOL: tl.constexpr):
    """A full (padded) row-major tile: rows ``offs_r``, columns ``offs_c`` of a ``NCOL``-wide buffer."""
    return tl.load(ptr + offs_r[:, None] * NCOL + offs_c[None, :])


@triton.jit
def _st(ptr, x, offs_r, offs_c, NCOL: tl.constexpr):
    tl.store(ptr + offs_r[:, None] * NCOL + offs_c[None, :], x)


@triton.jit
def _acc(ptr, x, offs_r, offs_c, NCOL: tl.constexpr):
    """``tile += x`` in memory; the barrier keeps every thread's read before any thread's write whatever the
    load's and the store's thread layouts."""
    y = _ld(ptr, offs_r, offs_c, NCOL) + x
    tl.debug_barrier()
    _st(ptr, y, offs_r, offs_c, NCOL)


@triton.jit
def _act(sp, buf, l, DEPTH: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr):
    """The scratch tile of activation buffer ``buf`` at layer ``l`` (``sp``: this program's scratch)."""
    return sp + (buf * DEPTH + l) * BC * BW


@triton.jit
def _dsilu(z):
    sg = tl.sigmoid(z)
    return sg + z * sg * (1.0 - sg)


@triton.jit
def _copy_state(src, dst, offs_w, DEPTH: tl.constexpr, BW: tl.constexpr):
    """Copy a program's ``[L, BW, BW]`` tiles (same layout on both sides: no barrier needed)."""
    for l in range(DEPTH):
        _st(dst + l * BW * BW, _ld(src + l * BW * BW, offs_w, offs_w, BW), offs_w, offs_w, BW)


@triton.jit
def _inner(k, v, wp, sp, offs_c, offs_w, DEPTH: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr,
           DOT: tl.constexpr):
    """Per-token gradients of ``||M_W(k_i) - v_i||^2`` at the weights ``wp`` (``[L, BW, BW]``): writes the
    layer inputs ``a_l``, pre-activations ``z_l``, ``e_l`` and deltas ``delta_l`` into the scratch ``sp``.
    Starts and ends with a barrier."""
    tl.debug_barrier()  # earlier readers of the scratch (the previous chunk) are done
    a = k
    z = k
    for l in range(DEPTH):
        _st(_act(sp, _A, l, DEPTH, BC, BW), a, offs_c, offs_w, BW)
        w = _ld(wp + l * BW * BW, offs_w, offs_w, BW)
        z = _mm(a, tl.trans(w), DOT)
        _st(_act(sp, _Z, l, DEPTH, BC, BW), z, offs_c, offs_w, BW)
        a = z * tl.sigmoid(z)
    d = 2.0 * (z - v)
    _st(_act(sp, _DL, DEPTH - 1, DEPTH, BC, BW), d, offs_c, offs_w, BW)
    tl.debug_barrier()
    for li in range(DEPTH - 1):
        l = DEPTH - 2 - li
        w = _ld(wp + (l + 1) * BW * BW, offs_w, offs_w, BW)
        e = _mm(d, w, DOT)
        d = e * _dsilu(_ld(_act(sp, _Z, l, DEPTH, BC, BW), offs_c, offs_w, BW))
        _st(_act(sp, _E, l, DEPTH, BC, BW), e, offs_c, offs_w, BW)
        _st(_act(sp, _DL, l, DEPTH, BC, BW), d, offs_c, offs_w, BW)
    tl.debug_barrier()


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _fwd_deep_kernel(Q, K, V, DEC, CAR, MIX, EEND, MEND, WC, SC, Y, WG, SW, SS, SCR,
                     NC, Tp, N_LAST, SAVE_EVERY, NSAVE, C, D,
                     DEPTH: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, DOT: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BC)
    offs_w = tl.arange(0, BW)
    LT = DEPTH * BW * BW
    wp = WC + n * LT  # the current weights and momentum, updated in place chunk by chunk
    mp = SC + n * LT
    sp = SCR + n * NBUF * DEPTH * BC * BW
    for c in range(NC):
        tl.debug_barrier()  # the previous chunk's state writes are visible
        if c % SAVE_EVERY == 0:  # the state at this chunk's start, for the backward
            j = c // SAVE_EVERY
            _copy_state(wp, SW + (n * NSAVE + j) * LT, offs_w, DEPTH, BW)
            _copy_state(mp, SS + (n * NSAVE + j) * LT, offs_w, DEPTH, BW)
        if c == NC - 1:  # the last chunk's start weights: the state's chunk weights when it is partial
            _copy_state(wp, WG + n * LT, offs_w, DEPTH, BW)
        q, k, v = _qkv(Q, K, V, n, c, Tp, C, D, offs_c, offs_w)
        last, dec, car, mix, ee, me, ml, dec_l, car_l = _coefs(DEC, CAR, MIX, EEND, MEND, n, c, NC, C, N_LAST,
                                                              offs_c)
        _inner(k, v, wp, sp, offs_c, offs_w, DEPTH, BC, BW, DOT)
        h = q
        for l in range(DEPTH):
            w = _ld(wp + l * BW * BW, offs_w, offs_w, BW)
            st = _ld(mp + l * BW * BW, offs_w, offs_w, BW)
            a = _ld(_act(sp, _A, l, DEPTH, BC, BW), offs_c, offs_w, BW)
            dd = _ld(_act(sp, _DL, l, DEPTH, BC, BW), offs_c, offs_w, BW)
            z, p, hw, hs = _read(h, w, st, a, dd, dec, car, mix, DOT)
            h = tl.where(l < DEPTH - 1, z * tl.sigmoid(z), z)
            nw, ns = _advance(w, st, dd, a, ml, me, dec_l, car_l, ee, DOT)
            tl.debug_barrier()  # every thread has read layer l's state before it is overwritten
            _st(wp + l * BW * BW, nw, offs_w, offs_w, BW)
            _st(mp + l * BW * BW, ns, offs_w, offs_w, BW)
        _store_rows(Y, h, n, c, Tp, C, D, offs_c, offs_w)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_deep_kernel(Q, K, V, DY, DEC, CAR, MIX, EEND, MEND, SW, SS, RW, RS, GW, GS, GWG, SCR,
                     DQ, DK, DV, DDEC, DCAR, DMIX, DEEND, DMEND,
                     NC, Tp, N_LAST, SAVE_EVERY, NSAVE, C, D,
                     DEPTH: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, DOT: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BC)
    offs_w = tl.arange(0, BW)
    TT = BW * BW
    LT = DEPTH * TT
    gw = GW + n * LT  # gradients of the weights / momentum at the current chunk's end, replaced in place by
    gs = GS + n * LT  # those at its start (at exit: the initial state's)
    sp = SCR + n * NBUF * DEPTH * BC * BW
    for gi in range(NSAVE):
        grp = NSAVE - 1 - gi
        c0 = grp * SAVE_EVERY
        c1 = tl.minimum(c0 + SAVE_EVERY, NC)
        # recompute the chunk-start states of this group into the scratch RW / RS
        tl.debug_barrier()
        _copy_state(SW + (n * NSAVE + grp) * LT, RW + n * SAVE_EVERY * LT, offs_w, DEPTH, BW)
        _copy_state(SS + (n * NSAVE + grp) * LT, RS + n * SAVE_EVERY * LT, offs_w, DEPTH, BW)
        for c in range(c0, c1 - 1):
            j = c - c0
            wp = RW + (n * SAVE_EVERY + j) * LT
            mp = RS + (n * SAVE_EVERY + j) * LT
            k = _rows(K, n, c, Tp, C, D, offs_c, offs_w)
            v = _rows(V, n, c, Tp, C, D, offs_c, offs_w)
            _, dec, car, mix, ee, me, ml, dec_l, car_l = _coefs(DEC, CAR, MIX, EEND, MEND, n, c, NC, C, N_LAST,
                                                                offs_c)
            _inner(k, v, wp, sp, offs_c, offs_w, DEPTH, BC, BW, DOT)
            for l in range(DEPTH):
                nw, ns = _advance(_ld(wp + l * TT, offs_w, offs_w, BW), _ld(mp + l * TT, offs_w, offs_w, BW),
                                  _ld(_act(sp, _DL, l, DEPTH, BC, BW), offs_c, offs_w, BW),
                                  _ld(_act(sp, _A, l, DEPTH, BC, BW), offs_c, offs_w, BW),
                                  ml, me, dec_l, car_l, ee, DOT)
                _st(wp + LT + l * TT, nw, offs_w, offs_w, BW)  # the next chunk's start state
                _st(mp + LT + l * TT, ns, offs_w, offs_w, BW)
        for ci in range(c1 - c0):
            c = c1 - 1 - ci
            j = c - c0
            wp = RW + (n * SAVE_EVERY + j) * LT
            mp = RS + (n * SAVE_EVERY + j) * LT
            q, k, v = _qkv(Q, K, V, n, c, Tp, C, D, offs_c, offs_w)
            dy = _rows(DY, n, c, Tp, C, D, offs_c, offs_w)
            last, dec, car, mix, ee, me, ml, dec_l, car_l = _coefs(DEC, CAR, MIX, EEND, MEND, n, c, NC, C, N_LAST,
                                                              offs_c)
            # recompute the chunk: the per-token gradients (scratch A, Z, E, DL), then the read (H, ZQ)
            _inner(k, v, wp, sp, offs_c, offs_w, DEPTH, BC, BW, DOT)
            h = q
            for l in range(DEPTH):
                _st(_act(sp, _H, l, DEPTH, BC, BW), h, offs_c, offs_w, BW)
                z, p, hw, hs = _read(h, _ld(wp + l * TT, offs_w, offs_w, BW), _ld(mp + l * TT, offs_w, offs_w, BW),
                                     _ld(_act(sp, _A, l, DEPTH, BC, BW), offs_c, offs_w, BW),
                                     _ld(_act(sp, _DL, l, DEPTH, BC, BW), offs_c, offs_w, BW), dec, car, mix, DOT)
                _st(_act(sp, _ZQ, l, DEPTH, BC, BW), z, offs_c, offs_w, BW)
                h = z * tl.sigmoid(z)
            # (i) the chunk-end state W' = B_l W + f_l S - sum_i c_l,i d_i a_i^T, S' = E S - sum_i m_i d_i a_i^T
            ddec_l = 0.0
            dcar_l = 0.0
            dee = 0.0
            dml = tl.zeros([BC], dtype=tl.float32)
            dme = tl.zeros([BC], dtype=tl.float32)
            for l in range(DEPTH):
                g = _ld(gw + l * TT, offs_w, offs_w, BW)
                gm = _ld(gs + l * TT, offs_w, offs_w, BW)
                w = _ld(wp + l * TT, offs_w, offs_w, BW)
                st = _ld(mp + l * TT, offs_w, offs_w, BW)
                ddec_l += tl.sum(tl.sum(g * w, axis=1), axis=0)
                dcar_l += tl.sum(tl.sum(g * st, axis=1), axis=0)
                dee += tl.sum(tl.sum(gm * st, axis=1), axis=0)
                d_dd, d_a, d_ml, d_me = _end_grads(g, gm, _ld(_act(sp, _DL, l, DEPTH, BC, BW), offs_c, offs_w, BW),
                                                   _ld(_act(sp, _A, l, DEPTH, BC, BW), offs_c, offs_w, BW), ml, me,
                                                   DOT)
                dml += d_ml
                dme += d_me
                _st(_act(sp, _GD, l, DEPTH, BC, BW), d_dd, offs_c, offs_w, BW)
                _st(_act(sp, _GA, l, DEPTH, BC, BW), d_a, offs_c, offs_w, BW)
                tl.debug_barrier()  # every thread has read layer l's end gradients
                _st(gw + l * TT, dec_l * g, offs_w, offs_w, BW)
                _st(gs + l * TT, car_l * g + ee * gm, offs_w, offs_w, BW)
            # (ii) the read, from the top layer down: y = z_{L-1}, h_{l+1} = silu(z_l), h_0 = q
            ddec = tl.zeros([BC], dtype=tl.float32)
            dcar = tl.zeros([BC], dtype=tl.float32)
            dmix = tl.zeros([BC, BC], dtype=tl.float32)
            dz = dy
            dq = dy
            for li in range(DEPTH):
                l = DEPTH - 1 - li
                tl.debug_barrier()
                h = _ld(_act(sp, _H, l, DEPTH, BC, BW), offs_c, offs_w, BW)
                w = _ld(wp + l * TT, offs_w, offs_w, BW)
                st = _ld(mp + l * TT, offs_w, offs_w, BW)
                a = _ld(_act(sp, _A, l, DEPTH, BC, BW), offs_c, offs_w, BW)
                dd = _ld(_act(sp, _DL, l, DEPTH, BC, BW), offs_c, offs_w, BW)
                _, p, hw, hs = _read(h, w, st, a, dd, dec, car, mix, DOT)
                dh, d_a, d_dd, dw, ds, ddec_, dcar_, dmix_ = _read_grads(dz, h, w, st, a, dd, p, hw, hs, dec, car,
                                                                        mix, DOT)
                ddec += ddec_
                dcar += dcar_
                dmix += dmix_
                ga = _act(sp, _GA, l, DEPTH, BC, BW)
                gd = _act(sp, _GD, l, DEPTH, BC, BW)
                _acc(ga, d_a, offs_c, offs_w, BW)
                _acc(gd, d_dd, offs_c, offs_w, BW)
                _acc(gw + l * TT, dw, offs_w, offs_w, BW)
                _acc(gs + l * TT, ds, offs_w, offs_w, BW)
                dz = dh * _dsilu(_ld(_act(sp, _ZQ, tl.maximum(l - 1, 0), DEPTH, BC, BW), offs_c, offs_w, BW))
                dq = dh  # the last iteration (l = 0) leaves the gradient of q
            # (iii) the per-token gradients at the chunk-start weights; first the delta recurrence upwards:
            # delta_l = e_l * silu'(z_l), e_l = delta_{l+1} W_{l+1}
            for l in range(DEPTH - 1):
                tl.debug_barrier()
                gdl = _ld(_act(sp, _GD, l, DEPTH, BC, BW), offs_c, offs_w, BW)
                z = _ld(_act(sp, _Z, l, DEPTH, BC, BW), offs_c, offs_w, BW)
                e = _ld(_act(sp, _E, l, DEPTH, BC, BW), offs_c, offs_w, BW)
                sg = tl.sigmoid(z)
                de = gdl * (sg + z * sg * (1.0 - sg))
                _st(_act(sp, _GZ, l, DEPTH, BC, BW), gdl * e * sg * (1.0 - sg) * (2.0 + z * (1.0 - 2.0 * sg)), offs_c,
                    offs_w, BW)  # silu''(z_l)
                w = _ld(wp + (l + 1) * TT, offs_w, offs_w, BW)
                gd = _act(sp, _GD, l + 1, DEPTH, BC, BW)
                _acc(gd, _mm(de, tl.trans(w), DOT), offs_c, offs_w, BW)
                dn = _ld(_act(sp, _DL, l + 1, DEPTH, BC, BW), offs_c, offs_w, BW)
                g = gw + (l + 1) * TT
                _acc(g, _mm(tl.trans(dn), de, DOT), offs_w, offs_w, BW)
            tl.debug_barrier()
            # delta_{L-1} = 2 (z_{L-1} - v); then the key activations downwards: z_l = a_l W_l^T, a_l = silu(z_{l-1})
            zt = 2.0 * _ld(_act(sp, _GD, DEPTH - 1, DEPTH, BC, BW), offs_c, offs_w, BW)
            dv = -zt
            dk = zt
            for li in range(DEPTH):
                l = DEPTH - 1 - li
                tl.debug_barrier()
                a = _ld(_act(sp, _A, l, DEPTH, BC, BW), offs_c, offs_w, BW)
                w = _ld(wp + l * TT, offs_w, offs_w, BW)
                g = gw + l * TT
                _acc(g, _mm(tl.trans(zt), a, DOT), offs_w, offs_w, BW)
                da = _ld(_act(sp, _GA, l, DEPTH, BC, BW), offs_c, offs_w, BW) + _mm(zt, w, DOT)
                lp = tl.maximum(l - 1, 0)
                zt = _ld(_act(sp, _GZ, lp, DEPTH, BC, BW), offs_c, offs_w, BW) + da * _dsilu(
                    _ld(_act(sp, _Z, lp, DEPTH, BC, BW), offs_c, offs_w, BW))
                dk = da  # the last iteration (l = 0): the gradient of the keys
            _store_chunk_grads(DQ, DK, DV, DDEC, DCAR, DMIX, DEEND, DMEND, dq, dk, dv, ddec, dcar, dmix, dee, dme,
                               ddec_l, dcar_l, dml, n, c, NC, Tp, C, D, last, offs_c, offs_w)
            if c == NC - 1:  # the last chunk's start weights are also an output (the state's chunk weights)
                tl.debug_barrier()
                for l in range(DEPTH):
                    _acc(gw + l * TT, _ld(GWG + n * LT + l * TT, offs_w, offs_w, BW), offs_w, offs_w, BW)


def _launch_shape(D: int, hidden: int, C: int) -> dict:
    """Block sizes and launch options (``num_stages=1`` as for :mod:`.triton_kernels`: the per-layer tile loads
    inside the loops are not software-pipelined)."""
    BW = max(_block(D), _block(hidden))
    return dict(BC=_block(C), BW=BW, num_warps=8 if BW >= 64 else 4, num_stages=1)


def _pack(ts, BW: int) -> torch.Tensor:
    """Per-layer ``[N, out, in]`` tensors as one zero-padded float32 ``[N, L, BW, BW]`` tensor."""
    return torch.stack([F.pad(t.float(), (0, BW - t.shape[2], 0, BW - t.shape[1])) for t in ts], dim=1)


def _unpack(x: torch.Tensor, shapes) -> list[torch.Tensor]:
    return [x[:, l, :o, :i] for l, (o, i) in enumerate(shapes)]


# The any-depth scan as custom operators, like :mod:`.triton_kernels`' depth-1/2 scan (see there), on the packed
# state: inputs q, k, v ``[N, Tp, D]`` (padded), the chunk coefficients, the weights and momentum
# ``[N, L, BW, BW]``, ``T`` and ``C``; outputs ``y`` (float32), the end weights and momentum, the last chunk's
# start weights (packed) and the states the backward restarts from (not differentiable).

def _deep_checkpoints(NC: int, wc_shape) -> tuple[int, int]:
    """:func:`.triton_kernels._checkpoints` for the packed state ``[N, L, BW, BW]`` (weights and momentum)."""
    N, L, BW = wc_shape[0], wc_shape[1], wc_shape[-1]
    return _checkpoints(NC, 8 * N * L * BW * BW)


def _deep_shapes(q, wc, C):
    N, Tp, D = q.shape
    nsave = _deep_checkpoints(Tp // C, wc.shape)[1]
    return [(N, Tp, D), wc.shape, wc.shape, wc.shape, (N, nsave, *wc.shape[1:]), (N, nsave, *wc.shape[1:])]


@kernel_op("memtrain::titans_deep_fwd")
def _deep_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dec: torch.Tensor, car: torch.Tensor,
              mix: torch.Tensor, e_end: torch.Tensor, m_end: torch.Tensor, wc: torch.Tensor, sc: torch.Tensor,
              T: int, C: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor]:
    N, Tp, D = q.shape
    NC = Tp // C
    R, nsave = _deep_checkpoints(NC, wc.shape)
    depth, BW = wc.shape[1], wc.shape[-1]
    opts = _launch_shape(D, BW, C)  # BW: the packed state's tile, at least D's
    q, k, v, dec, car, mix, e_end, m_end = tk._dense(q, k, v, dec, car, mix, e_end, m_end)
    y, _, _, wg, sw, ss = (tk._empty(*shape, device=q.device) for shape in _deep_shapes(q, wc, C))
    wc, sc = (x.clone(memory_format=torch.contiguous_format) for x in (wc, sc))  # carried in them: the end state
    scratch = tk._empty(N, NBUF.value, depth, opts["BC"], BW, device=q.device)
    _fwd_deep_kernel[(N,)](q, k, v, dec, car, mix, e_end, m_end, wc, sc, y, wg, sw, ss, scratch,
                           NC, Tp, T - (NC - 1) * C, R, nsave, C, D, DEPTH=depth, DOT=_DOT[q.dtype], **opts)
    return y, wc, sc, wg, sw, ss


@_deep_fwd.register_fake
def _(q, k, v, dec, car, mix, e_end, m_end, wc, sc, T, C):
    return tuple(q.new_empty(shape, dtype=torch.float32) for shape in _deep_shapes(q, wc, C))


@kernel_op("memtrain::titans_deep_bwd")
def _deep_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dy: torch.Tensor, dec: torch.Tensor,
              car: torch.Tensor, mix: torch.Tensor, e_end: torch.Tensor, m_end: torch.Tensor, sw: torch.Tensor,
              ss: torch.Tensor, gw: torch.Tensor, gs: torch.Tensor, gwg: torch.Tensor, T: int, C: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
        torch.Tensor, torch.Tensor, torch.Tensor]:
    N, Tp, D = q.shape
    NC = Tp // C
    R, nsave = _deep_checkpoints(NC, (N, *sw.shape[2:]))
    depth, BW = sw.shape[2], sw.shape[-1]
    opts = _launch_shape(D, BW, C)  # BW: the packed state's tile, at least D's
    q, k, v, dec, car, mix, e_end, m_end, sw, ss = tk._dense(q, k, v, dec, car, mix, e_end, m_end, sw, ss)
    gw, gs = (x.float().clone(memory_format=torch.contiguous_format) for x in (gw, gs))  # end-state grads -> initial
    rw, rs = (tk._empty(N, R, depth, BW, BW, device=q.device) for _ in range(2))
    scratch = tk._empty(N, NBUF.value, depth, opts["BC"], BW, device=q.device)
    dq, dk, dv = (tk._empty(N, Tp, D, device=q.device) for _ in range(3))
    dcoef = [tk._empty(*t.shape, device=q.device) for t in (dec, car, mix, e_end, m_end)]
    _bwd_deep_kernel[(N,)](q, k, v, dy.contiguous().float(), dec, car, mix, e_end, m_end, sw, ss, rw, rs,
                           gw, gs, gwg.float().contiguous(), scratch, dq, dk, dv, *dcoef,
                           NC, Tp, T - (NC - 1) * C, R, nsave, C, D, DEPTH=depth, DOT=_DOT[q.dtype], **opts)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *dcoef, gw, gs


@_deep_bwd.register_fake
def _(q, k, v, dy, dec, car, mix, e_end, m_end, sw, ss, gw, gs, gwg, T, C):
    return (*(x.new_empty(x.shape) for x in (q, k, v)),
            *(q.new_empty(t.shape, dtype=torch.float32) for t in (dec, car, mix, e_end, m_end, gw, gs)))


_deep_setup = tk._restart_setup(4, 10)


def _deep_backward(ctx, dy, gw, gs, gwg, *_):
    q, k, v, dec, car, mix, e_end, m_end, sw, ss = ctx.saved_tensors
    T, C = ctx.meta
    state = (sw.shape[0], *sw.shape[2:])
    dy, gw, gs, gwg = tk._grads_or_zeros((dy, gw, gs, gwg), [q.shape, state, state, state], q.device)
    dq, dk, dv, *dcoef, dw, ds = _deep_bwd(q, k, v, dy, dec, car, mix, e_end, m_end, sw, ss, gw, gs, gwg, T, C)
    return dq, dk, dv, *dcoef, dw, ds, None, None


_deep_fwd.register_autograd(_deep_backward, setup_context=_deep_setup)


def _scan(q, k, v, coef, T: int, C: int, w, s):
    """The any-depth scan on padded inputs (:func:`.triton_kernels.chunk_scan`): ``(y, w_end, s_end, wg)``."""
    shapes = [tuple(t.shape[1:]) for t in w]
    BW = max(_block(q.shape[-1]), *(_block(n) for shape in shapes for n in shape))
    y, wc, sc, wg, _, _ = _deep_fwd(q, k, v, *coef, _pack(w, BW), _pack(s, BW), T, C)
    return y, _unpack(wc, shapes), _unpack(sc, shapes), _unpack(wg, shapes)


def chunk_scan(q, k, v, lr, log_eta, log_keep, w, s, chunk_size: int):
    """The inner loop for a memory of any depth, as :func:`.triton_kernels.chunk_scan` (same arguments and
    results; ``w``, ``s`` lists of ``[N, d_out, d_in]``)."""
    return tk.chunk_scan(q, k, v, lr, log_eta, log_keep, w, s, chunk_size, scan_fn=_scan)


__all__ = ["chunk_scan"]
