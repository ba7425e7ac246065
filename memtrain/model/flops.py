"""Parameter counts, training FLOPs per token and device peak FLOP/s (for MFU).

Training FLOPs per token follow the PaLM convention (Chowdhery et al. 2022, Appendix B)::

    flops_per_token = 6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len

``N_matmul`` counts the weights that take part in matrix multiplications: per layer ``wq``
(d x h*dh), ``wk`` and ``wv`` (d x kv*dh each), ``wo`` (h*dh x d) and the three SwiGLU matrices
(3 x d x ffn_dim), plus the LM head (d x V) - counted even when tied to the embedding, because the
head is a matmul either way. The embedding lookup and the norm gains are excluded. Each such weight
costs 2 FLOPs per token forward and 4 backward (6 in all); the second term is the attention score
and value products (QK^T and AV: 2 * 2 * h * dh * T forward per layer, times 3 for training). As in
PaLM, the attention term does not halve for causal masking or shorten for document masking.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from memtrain.config import ModelConfig


def count_parameters(model: nn.Module, include_embedding: bool = True) -> int:
    """Number of parameters, a tied weight counted once.

    ``include_embedding=False`` leaves out the weights of ``nn.Embedding`` modules (with a tied head
    that also removes the head, being the same tensor); a separate LM head still counts.
    """
    skip = set()
    if not include_embedding:
        skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    # parameters() yields each tensor once, so tied weights are not double counted.
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def matmul_parameters(cfg: ModelConfig) -> int:
    """``N_matmul`` of the module docstring: the weights used in matmuls, LM head included."""
    head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    kv_heads = cfg.n_kv_heads or cfg.n_heads
    d = cfg.d_model
    attn = d * cfg.n_heads * head_dim * 2 + d * kv_heads * head_dim * 2  # wq, wo; wk, wv
    ffn = 3 * d * cfg.ffn_dim
    return cfg.n_layers * (attn + ffn) + d * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at context ``seq_len`` (module docstring)."""
    head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    return float(6 * matmul_parameters(cfg) + 12 * cfg.n_layers * cfg.n_heads * head_dim * seq_len)


def crossattn_flops_per_token(memory: nn.Module, batch: int, seq_len: int) -> float:
    """Training FLOPs per token of the cross-attention memory layers (``model.crossattn``, a
    :class:`memtrain.model.crossattn.CrossAttnMemory`; crossattn-memory-banks paper, Sections 3-5), the
    anchor's convention (2 per multiply-add, 3 x forward for training; attention dense over the keys a
    query reads). Per memory layer and token:

    - ``6 x`` the weights of ``W_Q`` and ``W_O`` (factors included with ``proj_rank``), of variant B's
      extra MLP, and of a token router (a sequence router runs once per sequence: ``/ seq_len``);
    - attention ``12 x keys x width``: the whole bank's ``N_m`` keys unrouted, ``top_k x N_c`` routed;
    - the keys and values of the bank tokens projected per forward (``W_K``, ``W_V``, and ``A B^T`` of a
      low-rank bank): ``6 x`` those weights ``x`` projected tokens ``/ (batch x seq_len)``. Unrouted every
      forward projects the whole bank; routed, the distinct chapters of a micro-batch, estimated for
      uniform routing as ``C (1 - (1 - k / C)^n)`` chapters over ``n`` routing decisions (``batch``
      sequences, or ``batch x seq_len`` tokens) -- exact when ``k = C``; a router that concentrates
      its picks projects fewer. Sequence routing decides once per document of a packed row, so training
      rows of several documents project more chapters than this per-row estimate."""
    c = memory.cfg
    tokens = batch * seq_len

    def weights(module: nn.Module) -> int:
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))

    total = 0.0
    for i in memory.layer_indices:
        part, bank = memory.parts[str(i)], memory.bank_for(i)
        attn = part.attn
        per_token = weights(attn.wq) + weights(attn.wo) + (weights(part.ffn) if part.variant == "B" else 0)
        keys = c.top_k * bank.chapter_tokens if c.top_k else bank.tokens
        flops = 6.0 * per_token + 12.0 * keys * attn.width
        if c.top_k:
            router = attn.router.proj.weight.numel()
            flops += 6.0 * router if c.routing == "token" else 6.0 * router / seq_len
            decisions = tokens if c.routing == "token" else batch
            chapters = bank.n_chapters
            projected = chapters * (1.0 - (1.0 - c.top_k / chapters) ** decisions) * bank.chapter_tokens
        else:
            projected = bank.tokens
        kv = weights(attn.wk) + weights(attn.wv) + (bank.rank * bank.width if bank.kind == "lowrank" else 0)
        total += flops + 6.0 * kv * projected / tokens
    return total


def titans_flops_per_token(model: nn.Module, cfg: ModelConfig) -> float:
    """Training FLOPs per token of a Titans model (``model.type: titans``), an estimate:

    - ``6 x`` the weights of every ``nn.Linear`` (attention, FFN, memory projections and gates, head);
    - attention as ``12 * L_attn * H * d_h * C`` with the context C a query sees: MAC
      ``2 * segment_len + persistent_tokens`` (persistent tokens, the retrieved memory of the segment and
      the segment), MAG / MAL ``window + persistent_tokens``, LMM none;
    - the inner loop: per token and memory module, ``8 P - 2 P_1`` forward (retrieval 2P,
      associative-loss forward 2P, the weight gradients 2P and the deltas back-propagated through
      layers 2..L, ``2 (P - P_1)``; with P the weights of all heads' memory MLPs and P_1 those of
      their first layer, whose input gradient the keys never need), times 3 for the outer forward +
      backward: ``24 P - 6 P_1``;
    - MAC only: the read of the memory before each segment (``NeuralMemory.retrieve``, eq. 21) costs
      another ``6 x`` (the query third of ``to_qkv``, ``to_out_gate``, ``to_out``) and ``6 P`` (the
      MLP forward), and the retrieved tokens are projected to keys and values: ``6 x (wk + wv)``.

    These are the matmuls of the per-token recurrence (``algorithm="sequential"``), which
    tests/test_flops.py counts with ``torch.utils.flop_counter``; the chunk-parallel form does more.
    Work per sequence or per segment on the persistent tokens (their memory writes and key/value
    projections, input-independent) is not counted.
    """
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    t = cfg.titans
    head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    attn_layers = sum(1 for b in getattr(model, "blocks", []) if getattr(b, "attn", None) is not None)
    context = {"mac": 2 * t.segment_len, "mag": t.window, "mal": t.window}.get(t.variant, 0) + t.persistent_tokens
    memory = first = 0
    for m in model.modules():
        init = getattr(m, "init_weights", None)
        if isinstance(init, nn.ParameterList):
            memory += sum(p.numel() for p in init)
            first += init[0].numel()
    reads = 0
    if t.variant == "mac":  # the pre-segment read h_t = M*_{t-1}(q_t) and h_t's keys and values (docstring)
        for b in model.blocks:
            mem = b.memory
            linear += (mem.to_qkv.weight.numel() // 3 + mem.to_out_gate.weight.numel() + mem.to_out.weight.numel()
                       + b.attn.wk.weight.numel() + b.attn.wv.weight.numel())
            reads += sum(p.numel() for p in mem.init_weights)
    # 24 P - 6 P_1: no gradient w.r.t. the keys, so the inner loss's first layer costs only its weight gradient
    # (tests/test_flops.py counts it; 24 P alone was 3 P too many at depth 2, 6 P at depth 1).
    return float(6 * linear + 12 * attn_layers * cfg.n_heads * head_dim * context + 24 * memory - 6 * first
                 + 6 * reads)


# Dense bf16 peak per device, first match wins (so "H100 PCIe" precedes the SXM default).
_PEAK_BF16 = [
    (re.compile(r"H100.*PCIe", re.IGNORECASE), 756e12),
    (re.compile(r"H100|H200", re.IGNORECASE), 989e12),
    (re.compile(r"A100", re.IGNORECASE), 312e12),
    (re.compile(r"A10G", re.IGNORECASE), 125e12),
    (re.compile(r"\bL4\b", re.IGNORECASE), 121e12),  # word boundary: not L40 / L40S
]


def peak_flops_from_name(name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s for a GPU name like ``"NVIDIA H100 80GB HBM3"``; None if unknown."""
    for pattern, peak in _PEAK_BF16:
        if pattern.search(name):
            return peak
    return None


def peak_flops(device: torch.device) -> Optional[float]:
    """Dense bf16 peak FLOP/s of ``device`` for known GPUs; None for CPUs and unknown devices."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_from_name(torch.cuda.get_device_name(device))


__all__ = ["count_parameters", "flops_per_token", "matmul_parameters", "peak_flops", "peak_flops_from_name",
           "titans_flops_per_token"]
