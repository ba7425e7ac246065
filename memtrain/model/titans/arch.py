"""Titans language models (Behrouz, Zhong, Mirrokni 2025, Sections 3.3 and 4): :class:`TitansLM`
with LMM, MAC, MAG or MAL blocks (``model.type: titans``, ``model.titans.variant``).

The skeleton is the anchor's (:mod:`memtrain.model.anchor`): token embedding, ``n_layers`` pre-norm
residual blocks each ending in a SwiGLU FFN (``x = x + ffn(norm(x))``), a final norm, an LM head
(tied or not); norms, RoPE, qk-norm, grouped-query heads and the OpenLM initialisation as there.
Only the sequence mixer of each block differs. Per block, ``P`` are the block's N_p learnable
persistent tokens (``model.titans.persistent_tokens``, in residual-stream space; Section 3.3),
``M`` its :class:`~memtrain.model.titans.memory.NeuralMemory` (its own state per block), and ``norm1``,
``norm2``, ``norm3`` its pre-norms. ``Attn`` is :class:`~memtrain.model.titans.attention.PrefixAttention`:
the rows passed as prefix are visible to every query and not rotated, the others causal, RoPE-rotated
and document-masked (see that module).

**LMM** (memory alone, Section 4.3 "Memory Without Attention")::

    x = x + M(norm1(P || x))[N_p:]          # the memory writes P first, then the tokens; y_t = M_t(q_t)
    x = x + FFN(norm2(x))

**MAC** (the paper's Memory as a Context, Section 4.1, eqs. 21-25; not titans-pytorch's variant,
which prepends learned long-term-memory tokens per segment). With ``u = norm1(x)`` cut into segments
``S_1, S_2, ...`` of ``segment_len`` tokens (the last may be shorter) and ``state_0`` the memory's
initial state (learned initial weights), for each segment t in order::

    h_t = M.retrieve(S_t, state_{t-1})              # eq. 21: M*_{t-1}(q_t), read only, memory before S_t
    y_t = Attn(queries S_t; keys [norm1(P) | h_t | S_t])            # eqs. 22-23
    m_t, state_t = M(y_t, state_{t-1})              # eq. 24: the attention output is written to memory
    o_t = W_g(norm_y(y_t) * sigmoid(norm_m(m_t)))   # eq. 25: y_t (x) M*_t(y_t), normalised gating
    x = x + (o_1 || o_2 || ...);  x = x + FFN(norm2(x))

- attention is segment-local (Figure 3a): a query in S_t sees the persistent tokens, and of ``h_t``
  and ``S_t`` the positions j <= i of its own document. The paper's figure shows ``h_t`` fully
  visible, but ``h_t[j]`` is computed from token j (its query and the query convolution), so
  letting query i < j see it would leak the future; ``h_t`` is therefore causally masked like
  ``S_t`` (``h_t[j]`` sits at token j's RoPE position).
- ``m_t[i] = M_{t,i}(q(y_t[i]))`` is read per token by the memory's forward, with the weights after
  writing ``y_t[0..i]`` (not after the whole segment, which would again leak the future); the
  memory state (weights, momentum, convolution cache) is carried from segment to segment with full
  back-propagation through it.
- only the segment positions' attention outputs are kept (the persistent and retrieved positions
  produce no outputs).
- RoPE positions restart at every segment start (and at document starts when ``reset_positions``),
  since attention never crosses a segment; so the model is invariant to where a segment starts.

**MAG** (Memory as a Gate, Section 4.2, eqs. 26-28; no segmentation)::

    u = norm1(P || x)                               # eq. 26: x~
    y = SWA*(queries u[N_p:]; keys [u[:N_p] | u[N_p:]])   # eq. 27, prefix always visible
    m = M(u)[N_p:]                                  # the memory writes x~ (P first)
    x = x + W_g(norm_y(y) * sigmoid(norm_m(m)))     # eq. 28: normalise both with learned gains, gate
    x = x + FFN(norm2(x))

**MAL** (Memory as a Layer, Section 4.3, eqs. 29-31; H3-style stacking, residuals on both)::

    x = x + M(norm1(P || x))[N_p:]                  # eqs. 29-30
    x = x + SWA*(queries norm2(x); keys [norm2(P) | norm2(x)])   # eq. 31, persistent prefix
    x = x + FFN(norm3(x))

  (the paper's attention input is ``y = M(x~)`` whose first N_p rows are the memory's outputs at the
  persistent positions; here the attention prefix is ``norm2(P)`` directly -- both are learned,
  input-independent tokens -- so the prefix does not depend on whether the memory state is carried.)

Sliding windows: query i sees keys j with ``i - window < j <= i`` of its own document, plus the
prefix. Normalised gating (MAG, MAC): ``norm_y``, ``norm_m`` are ``model.norm`` with learned gains
("learnable vector-valued weights", Section 4.2) and ``W_g`` is a d x d output projection (Section
4.4, gating before the output projection), initialised depth-scaled like ``wo``.

Memory and documents: in a packed sequence the neural memory is **not** reset at document
boundaries (the memory core has no reset); information can flow through the memory from one document
into the next. Attention respects documents exactly as the anchor's does. The persistent tokens are
written into the memory only when a sequence starts from a fresh state.

Inner-loop stability: with the memory core's own defaults (theta <= 0.1, starting at 0.01; chunk 16)
the inner loop diverged (weights ~1e21, NaN loss) after ~15-115 outer AdamW steps at lr 3e-3 in the
CPU recipes (MAC, MAL), as the outer loop raised the momentum gate and the value scale.
``model.titans.memory_max_lr`` / ``memory_init_lr`` default to 0.003 / 0.001. That alone left eta and
the value norm unbounded, and titans-400m-mag diverged from outer step 4 (MAG / MAL / LMM write the
unit-RMS ``norm1(x)``, whose values are ~2.5x larger per head than MAC's attention outputs, and their
gates move faster); so the memory L2-normalises its values and bounds eta by
``memory_max_momentum`` (0.95), which bounds the inner loop's effective step (see
:mod:`memtrain.model.titans.memory`, "Stability").

Carrying memory: ``forward(..., memory=states)`` continues from the per-block memory states of a
previous call (``output.memory``); the persistent tokens are then not written again. Attention
context is not carried (MAC is exact when the previous call ended on a segment boundary; MAG / MAL
windows restart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain.config import ModelConfig, TitansConfig
from memtrain.model.anchor import (
    TrainingOptions, build_lm_shell, lm_output,
    ModelOutput, RMSNorm, RotaryEmbedding, SwiGLU, _trunc_normal_, make_norm, position_ids_from_doc_ids,
)
from memtrain.model.attention import AttentionMask
from memtrain.model.grouped_linear import fan_out, grouped_linear
from memtrain.model.titans.attention import PrefixAttention, segment_mask, sliding_window_mask
from memtrain.model.titans.memory import NeuralMemory, compiled_scan
from memtrain.model.titans.state import MemoryState

VARIANTS = ("lmm", "mac", "mag", "mal")


@dataclass
class TitansOutput(ModelOutput):
    """:class:`ModelOutput` plus the memory state of every block after the sequence (to continue it)."""

    memory: Optional[list[MemoryState]] = None


@dataclass
class _Context:
    """Per-forward inputs shared by all blocks."""

    cos: Optional[torch.Tensor] = None  # [B, T, 1, hd]
    sin: Optional[torch.Tensor] = None
    mask: Optional[AttentionMask] = None  # MAG / MAL
    segments: Sequence[tuple[int, int]] = ()  # MAC: (start, end)
    segment_masks: Sequence[AttentionMask] = ()
    segment_rope: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()  # MAC: each segment's (cos, sin)


def make_memory(cfg: ModelConfig, t: TitansConfig) -> NeuralMemory:
    return NeuralMemory(cfg.d_model, heads=t.memory_heads, head_dim=t.memory_head_dim, depth=t.memory_depth,
                        expansion=t.expansion, chunk_size=t.memory_chunk_size, gate_mode=t.gate_mode,
                        conv_kernel=t.conv_kernel, max_lr=t.memory_max_lr, init_lr=t.memory_init_lr,
                        kernel=t.kernel, max_momentum=t.memory_max_momentum, value_norm=t.memory_value_norm)


class NormGate(nn.Module):
    """``W_g(norm_y(y) * sigmoid(norm_m(m)))``: the normalised gating of MAG (eq. 28) and MAC (eq. 25)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_y = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.norm_m = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return self.proj((self.norm_y(y) * torch.sigmoid(self.norm_m(m))).to(y.dtype))


class TitansBlock(nn.Module):
    """One block of any variant (see the module docstring for what each computes)."""

    def __init__(self, cfg: ModelConfig, t: TitansConfig, layer_index: int):
        super().__init__()
        self.variant, self.layer_index = t.variant, layer_index
        self.n_persistent = t.persistent_tokens
        self.persistent = nn.Parameter(torch.empty(t.persistent_tokens, cfg.d_model)) if t.persistent_tokens else None
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.memory = make_memory(cfg, t)
        self.attn = PrefixAttention(cfg, layer_index) if t.variant != "lmm" else None
        self.gate = NormGate(cfg) if t.variant in ("mac", "mag") else None
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.norm3 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if t.variant == "mal" else None
        self.ffn = SwiGLU(cfg.d_model, cfg.ffn_dim)
        self.compiled = False  # set by TitansLM.compile_blocks (MAC keeps its write's output stage per segment)

    # -- pieces ------------------------------------------------------------------------------------
    def _prefix(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The persistent tokens broadcast over the batch, ``[B, N_p, d]`` (None when N_p = 0)."""
        if self.persistent is None:
            return None
        return self.persistent.to(x.dtype).unsqueeze(0).expand(x.shape[0], -1, -1)

    def _write(self, u: torch.Tensor, prefix: Optional[torch.Tensor], state: Optional[MemoryState]):
        """``M(prefix || u)`` for a fresh state (the persistent tokens are written first), ``M(u)`` when
        continuing a state; returns the outputs at ``u``'s positions and the new state."""
        if prefix is not None and state is None:
            y, state = self.memory(torch.cat([prefix, u], dim=1), state)
            return y[:, prefix.shape[1]:], state
        return self.memory(u, state)

    # -- variants ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: _Context, state: Optional[MemoryState]):
        run = {"lmm": self._lmm, "mac": self._mac, "mag": self._mag, "mal": self._mal}[self.variant]
        x, state = run(x, ctx, state)
        norm = self.norm3 if self.norm3 is not None else self.norm2
        return x + self.ffn(norm(x)), state

    def _lmm(self, x, ctx, state):
        p = self._prefix(x)
        y, state = self._write(self.norm1(x), None if p is None else self.norm1(p), state)
        return x + y, state

    def _mag(self, x, ctx, state):
        p = self._prefix(x)
        u = self.norm1(x)
        pn = None if p is None else self.norm1(p)
        kv = u if pn is None else torch.cat([pn, u], dim=1)
        y = self.attn(u, kv, ctx.cos, ctx.sin, ctx.cos, ctx.sin, self.n_persistent, ctx.mask)
        m, state = self._write(u, pn, state)
        return x + self.gate(y, m), state

    def _mal(self, x, ctx, state):
        p = self._prefix(x)
        m, state = self._write(self.norm1(x), None if p is None else self.norm1(p), state)
        x = x + m
        u = self.norm2(x)
        kv = u if p is None else torch.cat([self.norm2(p), u], dim=1)
        return x + self.attn(u, kv, ctx.cos, ctx.sin, ctx.cos, ctx.sin, self.n_persistent, ctx.mask), state

    def _mac(self, x, ctx, state):
        # What depends on u alone is computed once for all segments and split (one split's backward
        # concatenates the segments' gradients): the memory's retrieval queries and output gate, the
        # attention's queries and the segments' own keys and values, the persistent tokens' keys and values.
        # Per segment remain the retrieval from the memory before it, its keys and values, attention and the
        # write. Eagerly, the write's output stage (norm, gate, projection) runs once after the loop (13% of
        # MAC's device ops saved); in compiled blocks (``compile_blocks``) it stays per segment: hoisted there,
        # compiled bf16 blocks' gate gradients came out 2-4x further from fp32 on two of four seeds of
        # tests/test_gpu.py's comparison, cause not found. Every piece acts row by row, so both are the
        # per-segment computation of the module docstring (tests check it).
        p = self._prefix(x)
        u = self.norm1(x)
        mem, attn = self.memory, self.attn
        sizes = [b - a for a, b in ctx.segments]
        queries = attn.queries(u, ctx.cos, ctx.sin).split(sizes, dim=1)
        # The projections used per segment, made once: wk and wv stacked (one GEMM per call; the memory's to_qkv and
        # to_gates likewise), and eagerly each weight's gradient computed once for all segments' rows (grouped_linear:
        # one GEMM where autograd runs one per use and sums them; with the stacked to_qkv/to_gates, 1,152 of 170m-mac's
        # device ops per sequence), the gradients of what each segment uses whole (the persistent tokens' keys and
        # values, the memory's convolution and output gain, the key norm's gain) summed in one op (fan_out). Compiled
        # blocks keep autograd's per-use gradients, so that eager blocks in their form (``compiled`` set) compute what
        # they do.
        grouped = not self.compiled
        n_seg = len(ctx.segments)
        wkv = grouped_linear(attn.kv_weight(), enabled=grouped)
        wo = grouped_linear(attn.wo.weight, attn.wo.bias, enabled=grouped)
        proj = mem.projections(writes=n_seg, outputs=n_seg + 1) if grouped else mem.projections()
        k_norm_calls = n_seg + 1 + (p is not None)  # the segments' own keys, the persistent tokens', each segment's h
        k_gains = iter(fan_out(attn.k_norm.weight, k_norm_calls, grouped) if isinstance(attn.k_norm, RMSNorm)
                       else [None] * k_norm_calls)
        keys, values = (t.split(sizes, dim=1) for t in attn.keys_values(u, ctx.cos, ctx.sin, wkv, next(k_gains)))
        retrieval_q = mem.segment_queries(u, sizes[0]).split(sizes, dim=2)
        retrieval_gate = mem.output_gate(u).split(sizes, dim=1)
        prefix_k = prefix_v = [None] * n_seg
        if p is not None:  # keys [P (unrotated) | h_t | S_t]; h_t[j] at token j's position
            prefix_k, prefix_v = (fan_out(t, n_seg, grouped)
                                  for t in attn.keys_values(self.norm1(p), kv_proj=wkv, k_gain=next(k_gains)))
        per_segment_output = self.compiled  # see above
        ys, ms = [], []
        for i, (mask, (cos, sin)) in enumerate(zip(ctx.segment_masks, ctx.segment_rope)):
            h = mem.gated_output(mem.read(retrieval_q[i], state, u.dtype), retrieval_gate[i], u.dtype, proj)  # eq. 21
            h_k, h_v = attn.keys_values(h, cos, sin, wkv, next(k_gains))
            k, v = [h_k, keys[i]], [h_v, values[i]]
            if p is not None:
                k, v = [prefix_k[i], *k], [prefix_v[i], *v]
            y = attn.attend_heads(queries[i], torch.cat(k, dim=1), torch.cat(v, dim=1), mask, wo)
            # M_t = M_{t-1}(y_t); m[i] = M_{t,i}(q(y_t[i])), before its output stage when that is hoisted
            m, state = (mem(y, state) if per_segment_output else mem.write(y, state, proj=proj))
            ys.append(y)
            ms.append(m)
        y = torch.cat(ys, dim=1)
        if per_segment_output:
            return x + self.gate(y, torch.cat(ms, dim=1)), state
        return x + self.gate(y, mem.gated_output(torch.cat(ms, dim=2), mem.output_gate(y), y.dtype, proj)), state


def segment_bounds(seq_len: int, segment_len: int) -> list[tuple[int, int]]:
    return [(a, min(a + segment_len, seq_len)) for a in range(0, seq_len, segment_len)]


def restart_positions(starts: torch.Tensor) -> torch.Tensor:
    """Positions counting from the last True of ``starts`` ``[B, T]`` (position 0 must be True)."""
    idx = torch.arange(starts.shape[-1], device=starts.device).expand_as(starts)
    return idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values


class TitansLM(TrainingOptions, nn.Module):
    """A Titans language model; see the module docstring. Same call contract as
    :class:`~memtrain.model.anchor.DecoderLM`: ``forward(input_ids, doc_ids=None, memory=None)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = cfg.titans or TitansConfig()
        if t.variant not in VARIANTS:
            raise ValueError(f"unknown model.titans.variant {t.variant!r}; expected one of {', '.join(VARIANTS)}")
        self.cfg, self.titans = cfg, t
        build_lm_shell(self, cfg, nn.ModuleList(TitansBlock(cfg, t, i) for i in range(cfg.n_layers)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The anchor's OpenLM initialisation, extended to the memory and gate projections: fan-in
        ``d_model`` matrices (``wq``, ``wk``, ``wv``, ``w1``, ``w2``, the memory's ``to_qkv`` and
        ``to_out_gate``, the persistent tokens, the embedding, a separate head) draw from
        ``N(0, base^2)`` truncated at 3 sigma; output projections (``wo``, ``w3``, the memory's
        ``to_out``, the gate's ``W_g``) ``1/sqrt(fan_in)/sqrt(2(l+1))``; the memory's own parameters
        (initial weights, gate biases) follow :meth:`NeuralMemory.reset_parameters`; norm gains 1.
        A no-op on the meta device."""
        if self.embed.weight.is_meta:
            return
        cfg = self.cfg
        base = cfg.init_std or 1.0 / math.sqrt(cfg.d_model)
        _trunc_normal_(self.embed.weight, base)
        for block in self.blocks:
            depth = 1.0 / math.sqrt(2 * (block.layer_index + 1))

            def out_proj(linear: nn.Linear) -> None:
                _trunc_normal_(linear.weight, depth / math.sqrt(linear.in_features))

            mem = block.memory
            mem.reset_parameters()
            for linear in (mem.to_qkv, mem.to_out_gate, block.ffn.w1, block.ffn.w2):
                _trunc_normal_(linear.weight, base)
            out_proj(mem.to_out)
            out_proj(block.ffn.w3)
            if block.persistent is not None:
                _trunc_normal_(block.persistent, base)
            if block.attn is not None:
                for linear in (block.attn.wq, block.attn.wk, block.attn.wv):
                    _trunc_normal_(linear.weight, base)
                out_proj(block.attn.wo)
            if block.gate is not None:
                out_proj(block.gate.proj)
        if not cfg.tie_embeddings:
            _trunc_normal_(self.lm_head.weight, base)
        for module in self.modules():
            if isinstance(module, (nn.LayerNorm, RMSNorm)):
                module.reset_parameters()

    def describe(self) -> list[str]:
        """The start-of-run line (and `memtrain recipe show`'s) of what the variant's blocks attend over, naming
        the length key it ignores: MAC reads ``segment_len`` and not ``window``, MAG and MAL the reverse, LMM
        neither. A recipe copied across variants keeps its other key silently otherwise (titans-170m-mac.yaml
        with ``variant=mag`` attends over the default 128-key window, not its 512-token segments)."""
        t = self.titans
        attention = {
            "mac": f"segment-local attention over segments of {t.segment_len} tokens (model.titans.segment_len; "
                   "model.titans.window is not used by MAC)",
            "mag": f"sliding-window attention over {t.window} keys (model.titans.window; model.titans.segment_len "
                   "is not used by MAG)",
            "mal": f"sliding-window attention over {t.window} keys (model.titans.window; model.titans.segment_len "
                   "is not used by MAL)",
            "lmm": "no attention (model.titans.window and segment_len are not used by LMM)",
        }[t.variant]
        memory = (f"memory depth {t.memory_depth}, {t.memory_heads} heads, chunks of {t.memory_chunk_size} tokens, "
                  f"{t.persistent_tokens} persistent tokens")
        return [f"titans {t.variant.upper()}: {self.cfg.n_layers} blocks, {attention}; {memory}"]

    def compile_blocks(self, **compile_kwargs: Any) -> int:
        """Regional compilation (``model.compile: true``): ``torch.compile`` each block in place, as the
        decoder does. Where the Triton kernels run the memory's inner loop (bf16 on CUDA), they are custom
        operators and each block is one graph, MAC's loop over segments unrolled into it; where the PyTorch
        form runs, every memory's ``scan`` calls it under ``torch.compiler.disable`` (:func:`compiled_scan`), so
        Dynamo breaks the graph there and the projections, gates, convolution, norms, attention, gating and FFN
        around it are compiled. The blocks share one class, so Dynamo compiles each variant's code once for all
        blocks (tests/test_compile.py). Returns how many were compiled."""
        scan = compiled_scan()
        for block in self.blocks:
            block.memory.scan = scan
            block.compiled = True
            block.compile(**compile_kwargs)
        return len(self.blocks)

    def _context(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor]) -> _Context:
        t, cfg = self.titans, self.cfg
        B, T = input_ids.shape
        device = input_ids.device
        if t.variant == "lmm":
            return _Context()
        idx = torch.arange(T, device=device).expand(B, T)
        doc_start = torch.zeros_like(idx, dtype=torch.bool)
        if doc_ids is not None and cfg.reset_positions:
            doc_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        if t.variant == "mac":
            segments = segment_bounds(T, t.segment_len)
            positions = restart_positions(doc_start | (idx % t.segment_len == 0))
            cos, sin = self.rope(positions)
            masks, cache = [], {}
            for a, b in segments:
                if doc_ids is None:  # the same mask for every full segment
                    if b - a not in cache:
                        cache[b - a] = segment_mask(None, b - a, t.persistent_tokens, device)
                    masks.append(cache[b - a])
                else:
                    masks.append(segment_mask(doc_ids[:, a:b], b - a, t.persistent_tokens, device))
            rope = [(cos[:, a:b], sin[:, a:b]) for a, b in segments]
            return _Context(cos, sin, segments=segments, segment_masks=masks, segment_rope=rope)
        if doc_ids is not None and cfg.reset_positions:
            positions = position_ids_from_doc_ids(doc_ids)
        else:
            positions = idx
        cos, sin = self.rope(positions)
        mask = sliding_window_mask(doc_ids, T, t.persistent_tokens, t.window, cfg.attention, device)
        return _Context(cos, sin, mask=mask)

    def forward(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                memory: Any = None, labels: Optional[torch.Tensor] = None) -> TitansOutput:
        """``input_ids`` ``[B, T]``; ``doc_ids`` ``[B, T]`` document index per position (attention never
        crosses documents; the neural memory is not reset, see the module docstring); ``memory``: None
        (fresh memories) or the ``memory`` list of a previous output, to continue that sequence; ``labels``
        ``[B, T]``: also return the summed token loss (``loss_sum``, the fused loss when it is on)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len {self.cfg.max_seq_len}")
        if T == 0:
            raise ValueError("input_ids has no tokens (shape [batch, 0]); pass at least one")
        if doc_ids is not None and doc_ids.shape != input_ids.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} differs from input_ids "
                             f"{tuple(input_ids.shape)}")
        if memory is None:
            memory = [None] * len(self.blocks)
        elif len(memory) != len(self.blocks) or not all(isinstance(s, MemoryState) for s in memory):
            raise ValueError(f"memory must be a list of {len(self.blocks)} MemoryState (a previous output's "
                             "memory) or None")
        elif any(s.batch_size != input_ids.shape[0] for s in memory):
            raise ValueError(f"memory holds the state of {memory[0].batch_size} sequence(s), input_ids has "
                             f"{input_ids.shape[0]}; continue a sequence with its own batch's output.memory")
        ctx = self._context(input_ids, doc_ids)
        x = self.embed(input_ids)
        states = []
        for i, (block, state) in enumerate(zip(self.blocks, memory)):
            if self._recompute(i):
                x, state = checkpoint(block, x, ctx, state, use_reentrant=False)
            else:
                x, state = block(x, ctx, state)
            states.append(state)
        logits, loss_sum = lm_output(self, x, labels)
        return TitansOutput(logits=logits, memory=states, loss_sum=loss_sum)


__all__ = ["NormGate", "TitansBlock", "TitansLM", "TitansOutput", "VARIANTS", "make_memory"]
