"""Routed memory attention in Triton (crossattn-memory-banks paper, Section 4): sequence-level and token-level
chapter routing over shared chapter storage, forward and backward. :mod:`.reference` is the specification.

One core operation serves both modes, :class:`ChapterAttention`: query *blocks* (at most ``BLOCK_M``
rows of a row table ``Q [R, H, D]``), each reading a list of chapter *slots* (a chapter of ``K`` / ``V``
``[U, N_c, H, D]`` and a log weight added to every logit of that chapter), with an online softmax over
all the slots' keys, flash-attention style. It returns the rows' outputs and log-sum-exps.

- **Sequence level** (:func:`sequence_routed_attention`): the rows are the tokens (``B * T``, no copy),
  the blocks tile each sequence, and every block of sequence ``b`` reads its ``k`` chapters, straight
  from the shared storage (no gathered copy of keys and values per sequence).
- **Token level** (:func:`token_routed_attention`): the (token, slot) pairs are grouped by chapter
  (histogram, prefix sum, stable sort), the query rows are gathered in that order (one row per pair),
  every block holds rows of one chapter and reads that chapter alone; the per-pair outputs and
  log-sum-exps are merged per token by log-sum-exp plus log weight (:func:`.reference.merge_slots`, in
  PyTorch: ``[N, k, H, D]``). Memory: the unique chapters plus a row per pair, never tokens x routed keys.

Backward (recomputation from the saved log-sum-exps, as FlashAttention-2): ``dQ`` per query block (and
the log weights' gradients, summed per block and slot, then per sequence in PyTorch, deterministically);
``dK`` / ``dV`` per (chapter, key tile, head) program, looping over the blocks that read the chapter
through a reverse index (chapter -> (block, slot) pairs, CSR), so every gradient element is written by
one program: deterministic, no atomics; chapters no block reads get exactly zero. No autotuning: block
sizes are fixed per head size (a tuner would rerun kernels; none of these accumulates into its output,
but fixed sizes keep runs reproducible).

Inputs are float32, bfloat16 or float16 (accumulation in float32; float32 dot products in IEEE
precision, not TF32); outputs and log-sum-exps float32. Under ``TRITON_INTERPRET=1`` the same kernels
run on CPU tensors (the tests do).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from memtrain.kernels.launch import block, cdiv


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32: IEEE float32 products for float32 inputs (no TF32), else ``a`` cast
    to ``b``'s dtype (bf16 / fp16 tensor cores)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _kv_tile(K, V, c, keys, h, D, Nc, stride_kc, stride_kn, offs_d, mask_d):
    """Keys and values ``keys`` (``[BLOCK_N]`` indices) of chapter ``c``, head ``h``; and which are real."""
    mask_n = keys < Nc
    off = c * stride_kc + keys[:, None] * stride_kn + h * D + offs_d[None, :]
    mask = mask_n[:, None] & mask_d[None, :]
    return tl.load(K + off, mask=mask, other=0.0), tl.load(V + off, mask=mask, other=0.0), mask_n, off, mask


@triton.jit
def _row_tile(Q, DO, LSE, DELTA, row0, nrows, h, H, D, stride_qr, offs_m, offs_d, mask_d):
    """A query block's rows for head ``h``: queries, output gradients, log-sum-exps and deltas."""
    mask_m = offs_m < nrows
    rows = row0 + offs_m
    off = rows[:, None] * stride_qr + h * D + offs_d[None, :]
    mask = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + off, mask=mask, other=0.0)
    do = tl.load(DO + off, mask=mask, other=0.0)
    lse = tl.load(LSE + rows * H + h, mask=mask_m, other=0.0)
    delta = tl.load(DELTA + rows * H + h, mask=mask_m, other=0.0)
    return q, do, lse, delta, mask_m, off, mask


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, blk_row, blk_rows, blk_slot, blk_nslots, slot_chapter, slot_logw,
                H, D, Nc, scale,
                stride_qr, stride_kc, stride_kn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    row0 = tl.load(blk_row + blk).to(tl.int64)
    nrows = tl.load(blk_rows + blk)
    s0 = tl.load(blk_slot + blk)
    ns = tl.load(blk_nslots + blk)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < nrows
    mask_d = offs_d < D
    rows = row0 + offs_m
    row_off = rows[:, None] * stride_qr + h * D + offs_d[None, :]
    row_mask = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + row_off, mask=row_mask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, ns):
        c = tl.load(slot_chapter + s0 + j).to(tl.int64)
        lw = tl.load(slot_logw + s0 + j).to(tl.float32)
        for n0 in range(0, Nc, BLOCK_N):
            k, v, mask_n, _, _ = _kv_tile(K, V, c, n0 + offs_n, h, D, Nc, stride_kc, stride_kn, offs_d, mask_d)
            s = tl.where(mask_n[None, :], _mm(q, tl.trans(k), IEEE) * scale + lw, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _mm(p, v, IEEE)
            m_i = m_new
    tl.store(O + row_off, acc / l_i[:, None], mask=row_mask)
    tl.store(LSE + rows * H + h, m_i + tl.log(l_i), mask=mask_m)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DLW, blk_row, blk_rows, blk_slot, blk_nslots, slot_chapter,
                   slot_logw, H, D, Nc, scale, max_slots,
                   stride_qr, stride_kc, stride_kn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """dQ of one query block and head; DLW[blk, h, j]: the sum of dS over the block's rows and slot j's keys."""
    blk = tl.program_id(0)
    h = tl.program_id(1)
    s0 = tl.load(blk_slot + blk)
    ns = tl.load(blk_nslots + blk)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q, do, lse, delta, mask_m, row_off, row_mask = _row_tile(
        Q, DO, LSE, DELTA, tl.load(blk_row + blk).to(tl.int64), tl.load(blk_rows + blk), h, H, D, stride_qr,
        offs_m, offs_d, mask_d)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, ns):
        c = tl.load(slot_chapter + s0 + j).to(tl.int64)
        lw = tl.load(slot_logw + s0 + j).to(tl.float32)
        dlw = tl.zeros([BLOCK_M], tl.float32)
        for n0 in range(0, Nc, BLOCK_N):
            k, v, mask_n, _, _ = _kv_tile(K, V, c, n0 + offs_n, h, D, Nc, stride_kc, stride_kn, offs_d, mask_d)
            p = tl.exp(_mm(q, tl.trans(k), IEEE) * scale + lw - lse[:, None])
            p = tl.where(mask_m[:, None] & mask_n[None, :], p, 0.0)
            ds = p * (_mm(do, tl.trans(v), IEEE) - delta[:, None])
            dq += _mm(ds, k, IEEE)
            dlw += tl.sum(ds, 1)
        tl.store(DLW + (blk * H + h) * max_slots + j, tl.sum(dlw, 0))
    tl.store(DQ + row_off, dq * scale, mask=row_mask)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, blk_row, blk_rows, slot_logw, rev_ptr, rev_blk, rev_slot,
                     H, D, Nc, scale,
                     stride_qr, stride_kc, stride_kn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """dK, dV of one key tile of one chapter and head, over every (block, slot) that reads the chapter."""
    u = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    k, v, mask_n, kv_off, kv_mask = _kv_tile(K, V, u, tile * BLOCK_N + tl.arange(0, BLOCK_N), h, D, Nc,
                                             stride_kc, stride_kn, offs_d, mask_d)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    start = tl.load(rev_ptr + u)
    end = tl.load(rev_ptr + u + 1)
    for e in range(start, end):
        blk = tl.load(rev_blk + e)
        lw = tl.load(slot_logw + tl.load(rev_slot + e)).to(tl.float32)
        q, do, lse, delta, mask_m, _, _ = _row_tile(
            Q, DO, LSE, DELTA, tl.load(blk_row + blk).to(tl.int64), tl.load(blk_rows + blk), h, H, D, stride_qr,
            offs_m, offs_d, mask_d)
        p = tl.exp(_mm(q, tl.trans(k), IEEE) * scale + lw - lse[:, None])
        p = tl.where(mask_m[:, None] & mask_n[None, :], p, 0.0)
        ds = p * (_mm(do, tl.trans(v), IEEE) - delta[:, None])
        dv += _mm(tl.trans(p), do, IEEE)
        dk += _mm(tl.trans(ds), q, IEEE)
    tl.store(DK + kv_off, dk * scale, mask=kv_mask)
    tl.store(DV + kv_off, dv, mask=kv_mask)


# --------------------------------------------------------------------------------------------------
# Launch configuration and the autograd function


def block_sizes(D: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) for head size ``D`` (tl.dot needs every dimension >= 16)."""
    bd = block(D)
    if bd <= 64:
        return 64, 64, bd
    return (64, 32, bd) if bd <= 128 else (32, 32, bd)


class Blocks:
    """The block table: ``row`` / ``rows`` (first row and row count of each query block), ``slot`` /
    ``nslots`` (its first slot and slot count in ``chapter`` and the log weights), and the reverse index
    ``rev_ptr`` ``[U + 1]`` / ``rev_blk`` / ``rev_slot`` (the (block, global slot) pairs reading each
    chapter, grouped by chapter). ``per_sequence``: for sequence-level tables, blocks per sequence
    (every block of sequence ``b`` reads slots ``b k .. b k + k - 1``); None otherwise."""

    def __init__(self, row: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, nslots: torch.Tensor,
                 chapter: torch.Tensor, n_chapters: int, per_sequence: Optional[int] = None):
        self.row, self.rows = row.to(torch.int32), rows.to(torch.int32)
        self.slot, self.nslots = slot.to(torch.int32), nslots.to(torch.int32)
        self.chapter = chapter.to(torch.int32)
        self.max_slots = int(nslots.max()) if nslots.numel() else 0
        self.per_sequence = per_sequence
        # Reverse index: every (block, j < nslots) pair, grouped by the chapter of its slot.
        nb = row.numel()
        blk = torch.repeat_interleave(torch.arange(nb, device=row.device), nslots.long())
        first = torch.repeat_interleave(slot.long(), nslots.long())
        within = torch.arange(blk.numel(), device=row.device) - torch.repeat_interleave(
            torch.cumsum(nslots.long(), 0) - nslots.long(), nslots.long())
        gslot = first + within
        chap = chapter.long()[gslot]
        order = torch.argsort(chap, stable=True)
        counts = torch.bincount(chap, minlength=n_chapters)
        self.rev_ptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)
        self.rev_blk = blk[order].to(torch.int32)
        self.rev_slot = gslot[order].to(torch.int32)


_empty = torch.empty  # every buffer a kernel writes in full (the tests poison it with NaN)


def _launch_args(q: torch.Tensor, keys: torch.Tensor):
    R, H, D = q.shape
    Nc = keys.shape[1]
    return H, D, Nc, 1.0 / math.sqrt(D), q.stride(0), keys.stride(0), keys.stride(1)


class ChapterAttention(torch.autograd.Function):
    """``(O [R, H, D], LSE [R, H])`` of query rows ``q`` ``[R, H, D]`` over the chapter slots of their
    blocks (module docstring); differentiable in ``q``, ``keys``, ``values`` and ``logw`` (sequence-level
    tables) and through both outputs."""

    @staticmethod
    def forward(ctx, q, keys, values, logw, table: Blocks):
        q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
        R, H, D = q.shape
        bm, bn, bd = block_sizes(D)
        out = _empty(R, H, D, device=q.device, dtype=torch.float32)
        lse = _empty(R, H, device=q.device, dtype=torch.float32)
        ieee = q.dtype == torch.float32
        nb = table.row.numel()
        if nb:
            _fwd_kernel[(nb, H)](q, keys, values, out, lse, table.row, table.rows, table.slot, table.nslots,
                                 table.chapter, logw, *_launch_args(q, keys),
                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, IEEE=ieee)
        ctx.save_for_backward(q, keys, values, logw, out, lse)
        ctx.table = table
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, keys, values, logw, out, lse = ctx.saved_tensors
        table: Blocks = ctx.table
        R, H, D = q.shape
        bm, bn, bd = block_sizes(D)
        ieee = q.dtype == torch.float32
        d_out = torch.zeros_like(out) if d_out is None else d_out.float().contiguous()
        # dS = P (dP - delta) with delta = rowsum(dO * O) - dLSE (d lse / d s = P).
        delta = (d_out * out).sum(-1)
        if d_lse is not None:
            delta = delta - d_lse.float()
        delta = delta.contiguous()
        d_out_in = d_out if ieee else d_out.to(q.dtype)
        dq = _empty(R, H, D, device=q.device, dtype=torch.float32)
        nb = table.row.numel()
        dlw_blocks = torch.zeros(nb, H, max(table.max_slots, 1), device=q.device, dtype=torch.float32)
        dk = torch.zeros(keys.shape, device=q.device, dtype=torch.float32)  # chapters nobody reads: exactly 0
        dv = torch.zeros(values.shape, device=q.device, dtype=torch.float32)
        args = _launch_args(q, keys)
        if nb:
            _bwd_dq_kernel[(nb, H)](q, keys, values, d_out_in, lse, delta, dq, dlw_blocks, table.row, table.rows,
                                    table.slot, table.nslots, table.chapter, logw, H, D, keys.shape[1], args[3],
                                    dlw_blocks.shape[-1], *args[4:],
                                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, IEEE=ieee)
            U, Nc = keys.shape[0], keys.shape[1]
            _bwd_dkdv_kernel[(U, cdiv(Nc, bn), H)](
                q, keys, values, d_out_in, lse, delta, dk, dv, table.row, table.rows, logw, table.rev_ptr,
                table.rev_blk, table.rev_slot, *args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, IEEE=ieee)
        else:
            dq.zero_()
        d_logw = None
        if ctx.needs_input_grad[3]:
            if table.per_sequence is None:
                raise RuntimeError("log-weight gradients need a sequence-level block table")
            k = table.max_slots
            d_logw = dlw_blocks[:, :, :k].sum(1).view(-1, table.per_sequence, k).sum(1).reshape(-1)
            d_logw = d_logw.to(logw.dtype)
        return dq.to(q.dtype), dk.to(keys.dtype), dv.to(values.dtype), d_logw, None


# --------------------------------------------------------------------------------------------------
# The two routing modes


def sequence_routed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                              log_w: torch.Tensor) -> torch.Tensor:
    """:func:`.reference.sequence_routed_attention` with the kernels: ``q`` ``[B, T, H, D]``, ``slots`` /
    ``log_w`` ``[B, k]``; returns ``[B, T, H, D]`` in ``q``'s dtype."""
    B, T, H, D = q.shape
    k = slots.shape[1]
    bm = block_sizes(D)[0]
    per_seq = cdiv(T, bm)
    dev = q.device
    b = torch.arange(B, device=dev).repeat_interleave(per_seq)
    i = torch.arange(per_seq, device=dev).repeat(B)
    table = Blocks(row=b * T + i * bm, rows=torch.clamp(T - i * bm, max=bm), slot=b * k,
                   nslots=torch.full((B * per_seq,), k, device=dev), chapter=slots.reshape(-1),
                   n_chapters=keys.shape[0], per_sequence=per_seq)
    logw = log_w.reshape(-1).float().contiguous()
    out, _ = ChapterAttention.apply(q.reshape(B * T, H, D), keys, values, logw, table)
    return out.view(B, T, H, D).to(q.dtype)


def token_routed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                           log_w: torch.Tensor) -> torch.Tensor:
    """:func:`.reference.token_routed_attention` with the kernels: ``q`` ``[N, H, D]``, ``slots`` / ``log_w``
    ``[N, k]``; returns ``[N, H, D]`` in ``q``'s dtype."""
    from memtrain.kernels.routed_attention.reference import merge_slots

    N, H, D = q.shape
    k = slots.shape[1]
    U = keys.shape[0]
    bm = block_sizes(D)[0]
    dev = q.device
    pairs = slots.reshape(N * k)
    order = torch.argsort(pairs, stable=True)  # (token, slot) pairs grouped by chapter
    counts = torch.bincount(pairs, minlength=U)  # histogram
    starts = torch.cumsum(counts, 0) - counts  # prefix sum
    per_chapter = torch.div(counts + bm - 1, bm, rounding_mode="floor")
    chapter_of_block = torch.repeat_interleave(torch.arange(U, device=dev), per_chapter)
    index = torch.arange(chapter_of_block.numel(), device=dev) - torch.repeat_interleave(
        torch.cumsum(per_chapter, 0) - per_chapter, per_chapter)
    table = Blocks(row=starts[chapter_of_block] + index * bm,
                   rows=torch.clamp(counts[chapter_of_block] - index * bm, max=bm),
                   slot=chapter_of_block, nslots=torch.ones_like(chapter_of_block),
                   chapter=torch.arange(U, device=dev), n_chapters=U)
    # The query row of every pair, in chapter order ([N k, H, D]); built by expand + a permutation so that
    # its backward (a sum over each token's k rows) is deterministic.
    rows = q.unsqueeze(1).expand(N, k, H, D).reshape(N * k, H, D)[order]
    zero = torch.zeros(U, device=dev, dtype=torch.float32)
    out, lse = ChapterAttention.apply(rows, keys, values, zero, table)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=dev)
    return merge_slots(out[restore].view(N, k, H, D), lse[restore].view(N, k, H), log_w).to(q.dtype)


__all__ = ["Blocks", "ChapterAttention", "block_sizes", "sequence_routed_attention", "token_routed_attention"]
